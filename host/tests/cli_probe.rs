//! `wasmctrl probe URL`: exit 0 on a 2xx answer, 2 on any other answer or none.

use std::io::{Read as _, Write as _};
use std::net::TcpListener;
use std::process::Command;

/// Serve one HTTP request on a free port with `status` and `body`; the URL to ask.
fn serve_once(status: &'static str, body: &'static str) -> anyhow::Result<String> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let url = format!("http://{}/readyz", listener.local_addr()?);
    std::thread::spawn(move || {
        if let Ok((mut stream, _)) = listener.accept() {
            let mut request = [0u8; 1024];
            let _ = stream.read(&mut request);
            let _ = write!(
                stream,
                "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    Ok(url)
}

fn probe(url: &str) -> anyhow::Result<(Option<i32>, String, String)> {
    let output = Command::new(env!("CARGO_BIN_EXE_wasmctrl"))
        .args(["probe", url, "--timeout-seconds", "5"])
        .output()?;
    Ok((
        output.status.code(),
        String::from_utf8(output.stdout)?,
        String::from_utf8(output.stderr)?,
    ))
}

#[test]
fn a_2xx_answer_exits_0_any_other_or_none_exits_2() -> anyhow::Result<()> {
    let (code, stdout, _) = probe(&serve_once("200 OK", "ok")?)?;
    assert_eq!(code, Some(0));
    assert!(stdout.contains("answered 200 OK: ok"), "{stdout}");

    let (code, _, stderr) = probe(&serve_once(
        "503 Service Unavailable",
        "not ready: syncing",
    )?)?;
    assert_eq!(code, Some(2));
    assert!(
        stderr.contains("503") && stderr.contains("not ready: syncing"),
        "{stderr}"
    );

    let closed = TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let (code, _, stderr) = probe(&format!("http://{closed}/healthz"))?;
    assert_eq!(code, Some(2));
    assert!(stderr.contains("asking http://"), "{stderr}");
    Ok(())
}
