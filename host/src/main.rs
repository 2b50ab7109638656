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
    end_quietly_when_stdout_closes();
    run()
}

/// A reader that goes away (`wasmctrl … | head -1`) ends the command quietly, with the status
/// a Unix tool killed by SIGPIPE has (141), as `print!` panics once stdout is a closed pipe:
/// that is the end of the output, not a failure to report.
fn end_quietly_when_stdout_closes() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if message.starts_with("failed printing to stdout") && message.contains("Broken pipe") {
            std::process::exit(141);
        }
        report(info);
    }));
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
