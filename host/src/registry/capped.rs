//! Reading a response body through a size cap, at a pace.
//!
//! Every body the host reads from a server a team names (a plugin, a manifest, a token, a
//! signature) goes through [`read_capped`], so a server that sends without end, or more
//! than it said it would, costs the host at most the cap in memory, never the whole stream;
//! and one that drips, sending nothing for a while or too little for long, is given up
//! ([`Pace`]) instead of holding its fetch (and the tenant's turn to fetch) for minutes.

use std::time::Duration;

use tokio::time::Instant;

/// How slow a body may come.
#[derive(Debug, Clone, Copy)]
pub struct Pace {
    /// The longest a body may send nothing.
    pub stall: Duration,
    /// After this long, the body must have come at [`Pace::min_bytes_per_second`] on average.
    pub grace: Duration,
    /// The slowest average rate accepted after the grace.
    pub min_bytes_per_second: u64,
}

impl Pace {
    /// What every fetch the host makes must keep up: nothing for 10 s, or under 32 KiB/s
    /// after 10 s, ends it.
    pub const FETCH: Self = Self {
        stall: Duration::from_secs(10),
        grace: Duration::from_secs(10),
        min_bytes_per_second: 32 << 10,
    };
}

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
    /// The body came too slowly.
    #[error("{what} came too slowly: {why}")]
    TooSlow { what: String, why: String },
    /// The connection failed while reading.
    #[error("reading {what}")]
    Transport {
        what: String,
        #[source]
        source: reqwest::Error,
    },
}

/// The whole body of `response`, at most `limit` bytes, at [`Pace::FETCH`]. A body that
/// announces more is refused before a byte is read; one that sends more is refused as soon
/// as it passes the cap, with no more than `limit` bytes held (the buffer grows in steps,
/// never past it).
pub async fn read_capped(
    response: reqwest::Response,
    limit: usize,
    what: &str,
) -> Result<Vec<u8>, CappedError> {
    read_paced(response, limit, what, Pace::FETCH).await
}

/// [`read_capped`] at `pace`.
pub async fn read_paced(
    mut response: reqwest::Response,
    limit: usize,
    what: &str,
    pace: Pace,
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
    let started = Instant::now();
    let too_slow = |why: String| CappedError::TooSlow {
        what: what.to_owned(),
        why,
    };
    loop {
        let next = tokio::time::timeout(pace.stall, response.chunk())
            .await
            .map_err(|_| too_slow(format!("nothing for {:?}", pace.stall)))?;
        let Some(chunk) = next.map_err(|source| CappedError::Transport {
            what: what.to_owned(),
            source,
        })?
        else {
            break;
        };
        let needed = bytes.len() + chunk.len();
        if needed > limit {
            return Err(too_large().into());
        }
        if needed > bytes.capacity() {
            let grown = (bytes.capacity() * 2).max(needed).min(limit);
            bytes.reserve_exact(grown - bytes.len());
        }
        bytes.extend_from_slice(&chunk);
        let elapsed = started.elapsed();
        if elapsed > pace.grace
            && (bytes.len() as f64) < pace.min_bytes_per_second as f64 * elapsed.as_secs_f64()
        {
            return Err(too_slow(format!(
                "{} bytes in {elapsed:.1?}, under {} bytes a second",
                bytes.len(),
                pace.min_bytes_per_second
            )));
        }
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

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    /// A loopback server answering one request with a chunked body: `chunks` of `size`
    /// bytes, `every` apart.
    fn dripping(chunks: usize, size: usize, every: Duration) -> std::net::SocketAddr {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        std::thread::spawn(move || {
            let Ok((mut stream, _)) = listener.accept() else {
                return;
            };
            let mut request = [0u8; 4096];
            let _ = std::io::Read::read(&mut stream, &mut request);
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            );
            for _ in 0..chunks {
                let body = vec![b'x'; size];
                let sent = write!(stream, "{size:x}\r\n")
                    .and_then(|()| stream.write_all(&body))
                    .and_then(|()| stream.write_all(b"\r\n"))
                    .and_then(|()| stream.flush());
                if sent.is_err() {
                    return;
                }
                std::thread::sleep(every);
            }
            let _ = stream.write_all(b"0\r\n\r\n");
        });
        address
    }

    async fn get(address: std::net::SocketAddr) -> reqwest::Response {
        reqwest::get(format!("http://{address}/"))
            .await
            .expect("a response")
    }

    const QUICK: Pace = Pace {
        stall: Duration::from_millis(300),
        grace: Duration::from_millis(300),
        min_bytes_per_second: 10_000,
    };

    #[tokio::test]
    async fn a_body_is_read_whole_within_its_cap_and_refused_past_it() {
        let body = read_paced(
            get(dripping(4, 1000, Duration::ZERO)).await,
            4000,
            "x",
            QUICK,
        )
        .await
        .expect("within the cap");
        assert_eq!(body.len(), 4000);
        let refused = read_paced(
            get(dripping(1000, 1000, Duration::ZERO)).await,
            10_000,
            "x",
            QUICK,
        )
        .await
        .expect_err("past the cap");
        assert!(matches!(refused, CappedError::TooLarge(_)), "{refused}");
    }

    #[tokio::test]
    async fn a_body_that_stalls_or_drips_is_given_up() {
        let stalled = read_paced(
            get(dripping(2, 10, Duration::from_secs(5))).await,
            1 << 20,
            "x",
            QUICK,
        )
        .await
        .expect_err("stalled");
        assert!(stalled.to_string().contains("nothing for"), "{stalled}");
        let dripping = read_paced(
            get(dripping(100, 10, Duration::from_millis(100))).await,
            1 << 20,
            "x",
            QUICK,
        )
        .await
        .expect_err("too slow");
        assert!(
            dripping.to_string().contains("bytes a second"),
            "{dripping}"
        );
    }
}
