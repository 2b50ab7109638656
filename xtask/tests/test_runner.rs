//! The suite's runner holds every test to a time limit: one test that hangs is terminated
//! and named, and the rest of the suite runs on. Checked against `.config/nextest.toml` and
//! by running a deliberately hanging test through the command `cargo xtask test` uses.

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
    let mut nextest = runner::nextest_run().expect("cargo-nextest");
    nextest.args([
        "--workspace",
        "--profile",
        "hang-check",
        "--run-ignored",
        "only",
        "-E",
        "binary(test_runner) & (test(=hangs_on_purpose) | test(=passes_beside_the_hang))",
    ]);
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
    // Its limit is 4 s and a 1 s grace; the rest is building nothing and listing the tests.
    assert!(took < Duration::from_secs(120), "{took:?}");
}

/// Never ends. Run only by the test above, under a short limit.
#[test]
#[ignore = "hangs on purpose; run by a_test_that_hangs_is_terminated_and_named_while_the_others_run"]
fn hangs_on_purpose() {
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// Runs beside the hanging test, to show the run goes on.
#[test]
#[ignore = "run by a_test_that_hangs_is_terminated_and_named_while_the_others_run"]
fn passes_beside_the_hang() {}
