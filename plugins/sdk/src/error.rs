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
