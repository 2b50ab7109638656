//! The `wasmctrl` binary: parse the command line, set up logging, run, and turn any error into
//! one line on stderr and a non-zero exit: 2 for an error, 1 when `plugin replay` found cases
//! whose answer changed (as `diff` does), so a plugin's CI can tell the two apart.

use std::process::ExitCode;

use clap::Parser as _;
use tracing_subscriber::EnvFilter;
use wasmctrl::cli::{CasesDiffer, Cli};

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("WASMCTRL_LOG").unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match cli.run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) if error.is::<CasesDiffer>() => {
            eprintln!("{error}");
            ExitCode::from(1)
        }
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::from(2)
        }
    }
}
