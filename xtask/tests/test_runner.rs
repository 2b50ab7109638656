//! The suite's runner holds every test to a time limit: one test that hangs is terminated
//! and named, and the rest of the suite runs on. Checked against `.config/nextest.toml` and
//! by running a deliberately hanging test (in the small crate `hang-check` beside this file,
//! outside the workspace) through the command `cargo xtask test` uses, with the suite's
//! configuration.

use std::time::{Duration, Instant};

use wasmctrl_testenv::repo_root;
use wasmctrl_testenv::runner;

/// The longest any test may run under the suite's settings.
const LONGEST_ALLOWED: Duration = Duration::from_secs(25 * 60);

fn config() -> toml_edit::DocumentMut {
    let path = repo_root().join(".config/nextest.toml");
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
        .parse()
        .expect("nextest.toml parses")
}

/// The time after which a `slow-timeout` table terminates a test, if it does.
fn terminates_after(slow_timeout: &toml_edit::Item) -> Option<Duration> {
    let table = slow_timeout.as_inline_table()?;
    let period = table.get("period")?.as_str()?;
    let seconds: u64 = period.strip_suffix('s')?.parse().ok()?;
    let times = u64::try_from(table.get("terminate-after")?.as_integer()?).ok()?;
    Some(Duration::from_secs(seconds * times))
}

#[test]
fn every_time_limit_of_the_suite_terminates_the_test() {
    let config = config();
    let default = &config["profile"]["default"];
    let limit = terminates_after(&default["slow-timeout"])
        .expect("the default profile terminates a test that runs too long");
    assert!(limit <= Duration::from_secs(10 * 60), "{limit:?}");
    let overrides = default["overrides"]
        .as_array_of_tables()
        .expect("the default profile's overrides");
    for (i, over) in overrides.iter().enumerate() {
        if let Some(slow) = over.get("slow-timeout") {
            let limit = terminates_after(slow).unwrap_or_else(|| {
                panic!("override {i} sets a slow-timeout that never terminates")
            });
            assert!(limit <= LONGEST_ALLOWED, "override {i}: {limit:?}");
        }
    }
}

#[test]
fn a_test_that_hangs_is_terminated_and_named_while_the_others_run() {
    // The suite's configuration but for its per-binary overrides, which name binaries only
    // the workspace has (nextest refuses a filter that matches no binary).
    let mut suite_config = config();
    if let Some(default) = suite_config["profile"]["default"].as_table_mut() {
        default.remove("overrides");
    }
    let dir = tempfile::tempdir().expect("a temporary directory");
    let config_file = dir.path().join("nextest.toml");
    std::fs::write(&config_file, suite_config.to_string()).expect("writing the configuration");
    let mut nextest = runner::nextest_run().expect("cargo-nextest");
    nextest
        .arg("--manifest-path")
        .arg(repo_root().join("xtask/tests/hang-check/Cargo.toml"))
        .arg("--config-file")
        .arg(&config_file)
        .args(["--profile", "hang-check", "--run-ignored", "only"])
        // Its own target directory: a build of two empty tests, never the workspace's.
        .env(
            "CARGO_TARGET_DIR",
            std::env::temp_dir().join("wasmctrl-hang-check-target"),
        );
    let started = Instant::now();
    let mut output = Vec::new();
    let (summary, status) =
        runner::run_passing_through(&mut nextest, |line| output.push(line.to_owned()))
            .expect("running cargo-nextest");
    let took = started.elapsed();

    assert!(!status.success(), "a run with a hanging test must fail");
    let summary = summary.expect("a summary line");
    assert_eq!(
        (summary.run, summary.passed, summary.timed_out),
        (2, 1, 1),
        "{output:#?}"
    );
    assert!(
        output
            .iter()
            .any(|line| line.contains("TIMEOUT") && line.contains("hangs_on_purpose")),
        "the hanging test is named as timed out: {output:#?}"
    );
    // Its limit is 4 s and a 1 s grace; the rest is building two empty tests and listing them.
    assert!(took < Duration::from_secs(120), "{took:?}");
}
