//! Reading a response body through a size cap.
//!
//! Every body the host reads from a server a team names (a plugin, a manifest, a token, a
//! signature) goes through [`read_capped`], so a server that sends without end, or more
//! than it said it would, costs the host at most the cap in memory, never the whole stream.

/// A body that passed its cap.
#[derive(Debug, thiserror::Error)]
#[error("{what} is more than {limit} bytes, the host's limit for it")]
pub struct TooLarge {
    /// What was read, for the message ("the manifest of …").
    pub what: String,
    /// The cap, in bytes.
    pub limit: usize,
}

/// How reading a capped body ended when it did not end well.
#[derive(Debug, thiserror::Error)]
pub enum CappedError {
    /// The body passed its cap (or the length it announced did).
    #[error(transparent)]
    TooLarge(#[from] TooLarge),
    /// The connection failed while reading.
    #[error("reading {what}")]
    Transport {
        what: String,
        #[source]
        source: reqwest::Error,
    },
}

/// The whole body of `response`, at most `limit` bytes. A body that announces more is
/// refused before a byte is read; one that sends more is refused as soon as it passes the
/// cap, with no more than `limit` bytes held (the buffer grows in steps, never past it).
pub async fn read_capped(
    mut response: reqwest::Response,
    limit: usize,
    what: &str,
) -> Result<Vec<u8>, CappedError> {
    let too_large = || TooLarge {
        what: what.to_owned(),
        limit,
    };
    let announced = response.content_length();
    if announced.is_some_and(|length| length > limit as u64) {
        return Err(too_large().into());
    }
    let first = announced
        .map_or(8 << 10, |length| length as usize)
        .min(limit);
    let mut bytes = Vec::with_capacity(first);
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|source| CappedError::Transport {
            what: what.to_owned(),
            source,
        })?
    {
        let needed = bytes.len() + chunk.len();
        if needed > limit {
            return Err(too_large().into());
        }
        if needed > bytes.capacity() {
            let grown = (bytes.capacity() * 2).max(needed).min(limit);
            bytes.reserve_exact(grown - bytes.len());
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(bytes)
}

/// Up to `limit` bytes of `response`'s body as text, for an error message: a longer body is
/// cut, a failing one gives what arrived.
pub async fn error_text(mut response: reqwest::Response, limit: usize) -> String {
    let mut bytes = Vec::new();
    while bytes.len() < limit {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                let room = limit - bytes.len();
                bytes.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            Ok(None) | Err(_) => break,
        }
    }
    String::from_utf8_lossy(&bytes).trim().to_owned()
}
