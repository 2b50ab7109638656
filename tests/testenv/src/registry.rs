//! A real OCI registry (CNCF distribution, built from `tools/registry`) on loopback, for
//! tests that push plugins and have the host pull them.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

/// A running registry; stopped when dropped.
pub struct Registry {
    /// `127.0.0.1:<port>`.
    pub address: String,
    child: Child,
    _storage: tempfile::TempDir,
}

impl Registry {
    /// Build the registry if the cache lacks it, and start one with its own storage.
    pub fn start() -> anyhow::Result<Self> {
        let binary = build()?;
        let storage = tempfile::tempdir()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let address = format!("127.0.0.1:{port}");
        let config = storage.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {address}\n",
                storage.path().join("data").display()
            ),
        )?;
        let child = Command::new(&binary)
            .arg("serve")
            .arg(&config)
            .env("OTEL_TRACES_EXPORTER", "none")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let registry = Self {
            address,
            child,
            _storage: storage,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(&registry.address).is_err() {
            if Instant::now() > deadline {
                bail!(
                    "the registry did not listen on {} within 30 s",
                    registry.address
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(registry)
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn build() -> anyhow::Result<PathBuf> {
    crate::tools::build("registry")
}
