//! Asking a host's HTTP listener (`/healthz`, `/readyz`, `/metrics`) as a kubelet or
//! Prometheus would.

/// A plain HTTP GET on loopback: the status code and the body.
pub async fn http_get(address: std::net::SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    use std::io::{Read as _, Write as _};
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || {
        let mut stream = std::net::TcpStream::connect(address)?;
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
        )?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        let status = response
            .split_whitespace()
            .nth(1)
            .and_then(|code| code.parse().ok())
            .unwrap_or(0);
        let body = response
            .split_once("\r\n\r\n")
            .map(|(_, body)| body.to_owned())
            .unwrap_or_default();
        anyhow::Ok((status, body))
    })
    .await?
}
