use std::fmt;
use std::str::FromStr;

use sha2::{Digest as _, Sha256};

/// The content address of a plugin: `sha256:<64 hex digits>`.
///
/// Plugins are identified by what they are, not where they came from, so the same bytes served
/// from a file, a ConfigMap or a registry share one compiled artifact.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest([u8; 32]);

impl Digest {
    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self(Sha256::digest(bytes).into())
    }

    /// The 64 hex digits without the `sha256:` prefix.
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }

    /// The 32 bytes of the SHA-256 (what a signature of the component's bytes signs).
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The first 12 hex digits, for logs and printer columns.
    pub fn short(&self) -> String {
        self.hex()[..12].to_owned()
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// A string that is not a `sha256:` digest.
#[derive(Debug, thiserror::Error)]
#[error("invalid digest {input:?}: expected \"sha256:\" followed by 64 lowercase hex digits")]
pub struct InvalidDigest {
    input: String,
}

impl FromStr for Digest {
    type Err = InvalidDigest;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = || InvalidDigest {
            input: s.to_owned(),
        };
        let hex_part = s.strip_prefix("sha256:").ok_or_else(invalid)?;
        if hex_part.len() != 64 || hex_part.bytes().any(|b| b.is_ascii_uppercase()) {
            return Err(invalid());
        }
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(hex_part, &mut bytes).map_err(|_| invalid())?;
        Ok(Self(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_its_text_form() {
        let d = Digest::of(b"hello");
        assert_eq!(
            d.to_string(),
            "sha256:2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
        );
        assert_eq!(d.to_string().parse::<Digest>().expect("parse"), d);
        assert_eq!(d.short(), "2cf24dba5fb0");
    }

    #[test]
    fn rejects_other_algorithms_and_bad_hex() {
        for bad in [
            "md5:abc",
            "sha256:xyz",
            "sha256:2CF24DBA5FB0A30E26E83B2AC5B9E29E1B161E5C1FA7425E73043362938B9824",
            "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824",
        ] {
            assert!(bad.parse::<Digest>().is_err(), "{bad} must be rejected");
        }
    }
}
