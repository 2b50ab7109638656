use std::fmt;

/// Why a plugin could not decide. Each variant tells the host how to react.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// The parent is malformed; retrying will not help until the user changes it.
    InvalidParent(String),
    /// Something that may clear by itself; the host retries with backoff.
    Transient(String),
    /// A failure retrying will not fix; the host reports it and waits for a change.
    Permanent(String),
}

impl Error {
    /// The parent is malformed (for example its spec violates a rule the schema cannot express).
    pub fn invalid_parent(message: impl Into<String>) -> Self {
        Self::InvalidParent(message.into())
    }
    /// A condition that may clear by itself.
    pub fn transient(message: impl Into<String>) -> Self {
        Self::Transient(message.into())
    }
    /// A failure retrying will not fix.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self::Permanent(message.into())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidParent(m) => write!(f, "invalid parent: {m}"),
            Self::Transient(m) => write!(f, "transient: {m}"),
            Self::Permanent(m) => write!(f, "permanent: {m}"),
        }
    }
}

impl std::error::Error for Error {}

/// Serializing a child or status can only fail on a plugin bug (e.g. a map with non-string
/// keys), so it is permanent.
impl From<serde_json::Error> for Error {
    fn from(e: serde_json::Error) -> Self {
        Self::Permanent(format!("serializing output: {e}"))
    }
}

/// Turns any error into the SDK's [`Error`] of the kind that tells the host how to react, the
/// way anyhow's `Context` turns errors into `anyhow::Error`: one call before `?` instead of a
/// `map_err` closure each time.
///
/// The message is the error's `Display` text. To say what was being done, put that in the
/// error first, or build the [`Error`] yourself (`Error::transient(format!(…))`).
///
/// ```
/// use wasmctrl_plugin_sdk::{Error, ResultExt};
///
/// /// A size from the parent's spec: the user must fix a bad one, so it is an invalid parent.
/// fn size(spec_size: &str) -> Result<u32, Error> {
///     let size = spec_size.parse::<u32>().invalid_parent()?;
///     Ok(size)
/// }
///
/// assert_eq!(size("3"), Ok(3));
/// assert_eq!(
///     size("three"),
///     Err(Error::invalid_parent("invalid digit found in string"))
/// );
/// ```
pub trait ResultExt<T> {
    /// The error as [`Error::Transient`]: it may clear by itself, so the host retries with
    /// backoff.
    fn transient(self) -> Result<T, Error>;
    /// The error as [`Error::Permanent`]: retrying will not fix it, so the host reports it and
    /// waits for a change.
    fn permanent(self) -> Result<T, Error>;
    /// The error as [`Error::InvalidParent`]: the parent itself is wrong, so the host reports it
    /// and waits for the user to change it.
    fn invalid_parent(self) -> Result<T, Error>;
}

/// Any error that can be displayed. An SDK [`Error`] converted again keeps its old kind's
/// prefix in the message (`transient: permanent: …`); return it with `?` as it is instead.
impl<T, E: fmt::Display> ResultExt<T> for Result<T, E> {
    fn transient(self) -> Result<T, Error> {
        self.map_err(|e| Error::transient(e.to_string()))
    }

    fn permanent(self) -> Result<T, Error> {
        self.map_err(|e| Error::permanent(e.to_string()))
    }

    fn invalid_parent(self) -> Result<T, Error> {
        self.map_err(|e| Error::invalid_parent(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failing(message: &str) -> Result<(), String> {
        Err(message.to_owned())
    }

    #[test]
    fn each_conversion_gives_its_own_kind_with_the_error_message() {
        assert_eq!(
            failing("backend down").transient(),
            Err(Error::Transient("backend down".into()))
        );
        assert_eq!(
            failing("cannot work").permanent(),
            Err(Error::Permanent("cannot work".into()))
        );
        assert_eq!(
            failing("bad spec").invalid_parent(),
            Err(Error::InvalidParent("bad spec".into()))
        );
    }

    #[test]
    fn an_ok_value_passes_through_untouched() {
        let ok: Result<u8, std::num::ParseIntError> = "7".parse();
        assert_eq!(ok.clone().transient(), Ok(7));
        assert_eq!(ok.clone().permanent(), Ok(7));
        assert_eq!(ok.invalid_parent(), Ok(7));
    }

    #[test]
    fn a_library_error_keeps_its_display_text() {
        let parsed = "x".parse::<u32>().permanent();
        assert_eq!(
            parsed,
            Err(Error::permanent("invalid digit found in string"))
        );
    }
}
