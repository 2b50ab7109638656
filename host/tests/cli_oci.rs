//! `wasmctrl plugin push` and `plugin inspect REF` as a user runs them, against a local
//! registry: what push prints is what a user pastes, so the pinned reference, both digests
//! and the policy snippet must be the ones the registry and the component really have.

use std::process::Command;

use anyhow::{Context as _, bail};
use serde_json::Value;
use wasmctrl_runtime::Digest;

/// Run the `wasmctrl` binary with `args`; its stdout, or an error with what it printed.
fn wasmctrl(args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new(env!("CARGO_BIN_EXE_wasmctrl"))
        .env("WASMCTRL_LOG", "off")
        // No registry login of the machine's user leaks into the test, nor is needed.
        .env("DOCKER_CONFIG", env!("CARGO_TARGET_TMPDIR"))
        .args(args)
        .output()
        .context("running wasmctrl")?;
    if !output.status.success() {
        bail!(
            "wasmctrl {args:?} failed ({}):\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8(output.stdout)?)
}

/// The value on the line of `text` that starts with `label` (after indentation).
fn line_value<'a>(text: &'a str, label: &str) -> anyhow::Result<&'a str> {
    text.lines()
        .find_map(|line| line.trim_start().strip_prefix(label))
        .map(str::trim)
        .with_context(|| format!("no {label:?} line in:\n{text}"))
}

#[test]
fn push_prints_the_pins_a_policy_needs_and_inspect_reads_them_back() -> anyhow::Result<()> {
    let registry = wasmctrl_testenv::registry::Registry::start()?;
    let file = wasmctrl_testenv::plugins::guest_path("myapp_plugin");
    let component = Digest::of(&std::fs::read(&file)?).to_string();
    let reference = format!("{}/plugins/myapp:1.0.0", registry.address);
    let file = file.display().to_string();

    let pushed = wasmctrl(&["plugin", "push", &file, &reference, "--plain-http"])?;
    assert_eq!(
        pushed.lines().next(),
        Some(format!("pushed {reference}").as_str())
    );
    let manifest = line_value(&pushed, "manifest:")?;
    assert!(
        manifest.starts_with("sha256:") && manifest != component,
        "{pushed}"
    );
    assert_eq!(line_value(&pushed, "component:")?, component);

    // The snippet is YAML a policy's spec takes as it is.
    let (_, snippet) = pushed
        .split_once("Pin it in a ReconcilePolicy's spec:")
        .context("a policy snippet")?;
    let snippet: Value = serde_yaml_ng::from_str(&dedent(snippet))?;
    let pinned = format!("{}/plugins/myapp@{manifest}", registry.address);
    assert_eq!(snippet["plugin"]["digest"], component.as_str(), "{pushed}");
    assert_eq!(
        snippet["plugin"]["source"]["oci"]["reference"],
        pinned.as_str(),
        "{pushed}"
    );
    assert_eq!(snippet["plugin"]["source"]["oci"]["insecure"], true);

    // `inspect` of the tag and of the pinned reference finds the same artifact.
    for asked in [&reference, &pinned] {
        let inspected: Value = serde_json::from_str(&wasmctrl(&[
            "plugin",
            "inspect",
            asked,
            "--plain-http",
            "-o",
            "json",
        ])?)?;
        assert_eq!(inspected["reference"], pinned.as_str(), "{inspected}");
        assert_eq!(inspected["manifestDigest"], manifest, "{inspected}");
        assert_eq!(inspected["digest"], component.as_str(), "{inspected}");
        assert_eq!(inspected["compatible"], true, "{inspected}");
        let exports = inspected["exports"].to_string();
        assert!(
            exports.contains("wasmctrl:plugin/reconciler@"),
            "{inspected}"
        );
    }
    Ok(())
}

/// `text` with the indentation its lines share removed.
fn dedent(text: &str) -> String {
    let indent = text
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| line.len() - line.trim_start().len())
        .min()
        .unwrap_or(0);
    text.lines()
        .map(|line| line.get(indent..).unwrap_or("").to_owned())
        .collect::<Vec<_>>()
        .join("\n")
}
