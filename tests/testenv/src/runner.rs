//! How the suite's tests are run: cargo-nextest (`tools/nextest`) with the settings in
//! `.config/nextest.toml`, a process per test and a time limit per test. `cargo xtask test`
//! runs the suite through [`nextest_run`], and `xtask/tests/test_runner.rs` runs a
//! deliberately hanging test through the same command to show the limit holds.

use std::io::{BufRead as _, BufReader};
use std::process::{Command, Stdio};

use anyhow::Context as _;

/// Set in the environment of a test run whose guest plugins are already built (as
/// `cargo xtask test` builds them before the tests), so that each test process does not
/// run cargo for every guest again (see [`crate::plugins::guest`]).
pub const PLUGINS_BUILT_ENV: &str = "WASMCTRL_PLUGINS_BUILT";

/// `cargo nextest run` from the repository root, with the pinned nextest (installed into the
/// cache on first use); add the packages, filters and profile. nextest builds with the cargo
/// in `CARGO` (as `cargo xtask` sets it), else the one on `PATH`.
pub fn nextest_run() -> anyhow::Result<Command> {
    let nextest = crate::tools::build("nextest")?;
    // `cargo nextest` is cargo running `cargo-nextest nextest`: call it directly.
    let mut command = Command::new(nextest);
    command
        // Plain text: the summary line is read (a `CARGO_TERM_COLOR=always` would colour it).
        .args(["nextest", "run", "--color", "never"])
        .current_dir(crate::repo_root());
    without_cargos_package_variables(&mut command);
    Ok(command)
}

/// `cargo run` and the test runners give a program the variables describing its own package
/// (`CARGO_PKG_NAME`, `CARGO_MANIFEST_DIR`, …). Build scripts such as ring's rerun when those
/// change, so passing them on to anything that builds would make every build from xtask or
/// from a test and every build from a shell invalidate each other.
pub fn without_cargos_package_variables(command: &mut Command) {
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name.starts_with("CARGO_PKG_")
            || name.starts_with("CARGO_MANIFEST_")
            || name.starts_with("CARGO_BIN_EXE_")
            || matches!(
                &*name,
                "CARGO_CRATE_NAME"
                    | "CARGO_BIN_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
                    | "CARGO_TARGET_TMPDIR"
            )
        {
            command.env_remove(&*name);
        }
    }
}

/// What one run of the runner reported in its summary line.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Summary {
    pub run: u64,
    pub passed: u64,
    pub failed: u64,
    pub timed_out: u64,
    pub skipped: u64,
}

impl Summary {
    /// Read nextest's closing line, e.g. `Summary [ 12.3s] 5 tests run: 3 passed (1 slow),
    /// 1 failed, 1 timed out, 2 skipped`.
    pub fn parse(line: &str) -> Option<Self> {
        let (_, counts) = line.trim_start().strip_prefix("Summary")?.split_once(']')?;
        let mut summary = Self::default();
        for part in counts.split(',') {
            // "5 tests run: 3 passed (1 slow)" holds two counts.
            for piece in part.split(':') {
                let piece = piece.split('(').next().unwrap_or_default().trim();
                let Some((number, what)) = piece.split_once(' ') else {
                    continue;
                };
                let Ok(number) = number.parse::<u64>() else {
                    continue;
                };
                match what.trim() {
                    "test run" | "tests run" => summary.run = number,
                    "passed" => summary.passed = number,
                    "failed" => summary.failed += number,
                    "timed out" => summary.timed_out = number,
                    "skipped" => summary.skipped = number,
                    _ => {}
                }
            }
        }
        Some(summary)
    }
}

/// Run `command` (a [`nextest_run`]), passing its output through, and return its summary and
/// whether it succeeded; `tee` sees every line of its output too.
pub fn run_passing_through(
    command: &mut Command,
    mut tee: impl FnMut(&str),
) -> anyhow::Result<(Option<Summary>, std::process::ExitStatus)> {
    let mut child = command
        .stderr(Stdio::piped())
        .spawn()
        .context("starting cargo-nextest")?;
    let stderr = child.stderr.take().context("cargo-nextest's stderr")?;
    let mut summary = None;
    for line in BufReader::new(stderr).lines() {
        let line = line?;
        eprintln!("{line}");
        tee(&line);
        if let Some(found) = Summary::parse(&line) {
            summary = Some(found);
        }
    }
    let status = child.wait()?;
    Ok((summary, status))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_line_is_read_in_every_form() {
        assert_eq!(
            Summary::parse(
                "     Summary [  90.002s] 5 tests run: 3 passed (1 slow), 1 failed, 1 timed out, 19 skipped"
            ),
            Some(Summary {
                run: 5,
                passed: 3,
                failed: 1,
                timed_out: 1,
                skipped: 19,
            })
        );
        assert_eq!(
            Summary::parse("     Summary [   0.010s] 1 test run: 1 passed, 0 skipped"),
            Some(Summary {
                run: 1,
                passed: 1,
                ..Summary::default()
            })
        );
        assert_eq!(Summary::parse("        PASS [   0.005s] a::b"), None);
    }
}
