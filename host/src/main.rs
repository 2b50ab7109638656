//! The `wasmctrl` binary: parse the command line, set up logging, run, and turn any error into
//! one line on stderr and a non-zero exit: 2 for an error, 1 when `plugin replay` found cases
//! whose answer changed (as `diff` does), so a plugin's CI can tell the two apart.

use std::process::ExitCode;

use wasmctrl::cli::{CasesDiffer, Cli};

wasmctrl::host_allocator!();

fn main() -> ExitCode {
    // The host compiles plugins in a child process of this executable; that child does only
    // that (no runtime, no logging setup).
    if let Some(code) = wasmctrl::plugin::compile_child_if_asked() {
        return code;
    }
    run()
}

#[tokio::main]
async fn run() -> ExitCode {
    let cli = Cli::parse_invoked();
    let telemetry = match wasmctrl::telemetry::init(cli.log_format) {
        Ok(telemetry) => telemetry,
        Err(error) => {
            eprintln!("error: {error:#}");
            return ExitCode::from(2);
        }
    };
    let result = cli.run().await;
    // Flushing blocks on the exporter's thread, so not on a runtime worker.
    tokio::task::spawn_blocking(move || telemetry.shutdown())
        .await
        .ok();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) if error.is::<CasesDiffer>() => {
            let said = error.to_string();
            if !said.is_empty() {
                eprintln!("{said}");
            }
            ExitCode::from(1)
        }
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::from(2)
        }
    }
}
