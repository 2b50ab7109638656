//! Asking a host's HTTP listener (`/healthz`, `/readyz`, `/metrics`) as a kubelet or
//! Prometheus would, and serving plugins over HTTP as a web server would.

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

/// A plugin server from [`serve_plugins`]; its thread ends when it is dropped, so keep it
/// for as long as a host may fetch from it.
pub struct PluginServer {
    /// Where it listens, `127.0.0.1:<port>`.
    pub address: std::net::SocketAddr,
    with_token: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for PluginServer {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        // Wake the thread from `accept`; it sees the flag and ends.
        let _ = std::net::TcpStream::connect(self.address);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl PluginServer {
    /// How many requests so far carried the server's token.
    pub fn requests_with_token(&self) -> usize {
        self.with_token.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// The plugin server's URL of the MyApp plugin, and its digest.
pub fn myapp_plugin_url(address: std::net::SocketAddr) -> anyhow::Result<(String, String)> {
    let digest = wasmctrl::plugin::Digest::of(&std::fs::read(wasmctrl_testenv::plugins::guest(
        "myapp_plugin",
    ))?);
    Ok((
        format!("http://{address}/myapp_plugin.wasm"),
        digest.to_string(),
    ))
}

/// A loopback HTTP server for plugin downloads: `GET /<file>` (with `Authorization: Bearer
/// <token>` when a token is given) serves the built plugin `<file>` (without `.wasm`). The
/// first request it ever gets is answered 503, so the host's retry is exercised. It counts
/// the requests that carried the token, so a test can tell whether a credential reached it.
pub fn serve_plugins(token: Option<&'static str>) -> anyhow::Result<PluginServer> {
    use std::io::{BufRead as _, BufReader, Write as _};
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let address = listener.local_addr()?;
    let with_token = std::sync::Arc::<std::sync::atomic::AtomicUsize>::default();
    let counter = with_token.clone();
    let stop = std::sync::Arc::<std::sync::atomic::AtomicBool>::default();
    let stopped = stop.clone();
    let thread = std::thread::spawn(move || {
        let mut first = true;
        for stream in listener.incoming().flatten() {
            if stopped.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            // A client that sends nothing must not keep the thread (and so the drop) forever.
            let _ = stream.set_read_timeout(Some(std::time::Duration::from_secs(10)));
            let _ = stream.set_write_timeout(Some(std::time::Duration::from_secs(10)));
            let mut reader = BufReader::new(&stream);
            let mut request_line = String::new();
            let _ = reader.read_line(&mut request_line);
            let mut authorized = token.is_none();
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                authorized |= token.is_some_and(|token| {
                    line.eq_ignore_ascii_case(&format!("authorization: Bearer {token}\r\n"))
                });
            }
            if authorized && token.is_some() {
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            let path = request_line
                .split_whitespace()
                .nth(1)
                .unwrap_or("/")
                .trim_start_matches('/')
                .to_owned();
            let file = wasmctrl_testenv::plugins::guest_path(path.trim_end_matches(".wasm"));
            let (status, body) = if std::mem::take(&mut first) {
                ("503 Service Unavailable", Vec::new())
            } else if !authorized {
                ("401 Unauthorized", Vec::new())
            } else {
                match std::fs::read(&file) {
                    Ok(bytes) => ("200 OK", bytes),
                    Err(_) => ("404 Not Found", Vec::new()),
                }
            };
            let mut stream = &stream;
            let _ = write!(
                stream,
                "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = stream.write_all(&body);
        }
    });
    Ok(PluginServer {
        address,
        with_token,
        stop,
        thread: Some(thread),
    })
}

/// `GET https://ADDRESS/PATH` with `token` as the bearer, accepting the host's self-signed
/// certificate: the status and body.
pub async fn https_get(
    address: std::net::SocketAddr,
    path: &str,
    token: Option<&str>,
) -> anyhow::Result<(u16, String)> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::builder()
        .danger_accept_invalid_certs(true)
        .build()?;
    let mut request = client.get(format!("https://{address}{path}"));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await?;
    let status = response.status().as_u16();
    Ok((status, response.text().await?))
}

/// A loopback server that answers every request with the headers of a 64 MiB plugin body and
/// sends a few bytes of it; then, holding the connection open, nothing (`drip: None`) or a
/// byte every `drip`. Counts the connections it accepted.
pub struct DrippingServer {
    /// Where it listens, `127.0.0.1:<port>`.
    pub address: std::net::SocketAddr,
    /// Connections accepted so far.
    pub connections: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

/// Start a [`DrippingServer`]; it ends with the test's process (each test runs in a process
/// of its own).
pub fn dripping_server(drip: Option<std::time::Duration>) -> anyhow::Result<DrippingServer> {
    use std::io::{Read as _, Write as _};
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let address = listener.local_addr()?;
    let connections = std::sync::Arc::<std::sync::atomic::AtomicUsize>::default();
    let counted = connections.clone();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            std::thread::spawn(move || {
                let mut request = [0u8; 4096];
                let _ = stream.read(&mut request);
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n\0asm",
                    64 << 20
                );
                let Some(every) = drip else {
                    // Hold the connection, sending nothing, until the client goes.
                    let _ = stream.read(&mut request);
                    return;
                };
                while stream
                    .write_all(b"\0")
                    .and_then(|()| stream.flush())
                    .is_ok()
                {
                    std::thread::sleep(every);
                }
            });
        }
    });
    Ok(DrippingServer {
        address,
        connections,
    })
}
