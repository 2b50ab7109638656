//! Tests for the suite's runner to run: see xtask/tests/test_runner.rs.

#[cfg(test)]
mod tests {
    use std::time::Duration;

    /// Never ends; the runner must terminate it.
    #[test]
    #[ignore = "hangs on purpose; run by xtask/tests/test_runner.rs"]
    fn hangs_on_purpose() {
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }

    /// Runs beside the hanging test, to show the run goes on.
    #[test]
    #[ignore = "run by xtask/tests/test_runner.rs"]
    fn passes_beside_the_hang() {}
}
