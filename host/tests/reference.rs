//! The reference pages in `docs/reference/` are generated: the CLI's from its clap
//! definitions, the policy fields' from the CRDs. These keep them current; regenerate with
//! `WASMCTRL_BLESS=1 cargo test -p wasmctrl --test reference` (or `cargo xtask reference`).

use std::fmt::Write as _;

use clap::CommandFactory as _;
use kube::CustomResourceExt as _;
use serde_json::Value;

/// Compare (or, with `WASMCTRL_BLESS=1`, rewrite) `docs/reference/<file>` with `generated`.
fn assert_current(file: &str, generated: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../docs/reference")
        .join(file);
    if std::env::var_os("WASMCTRL_BLESS").is_some() {
        std::fs::write(&path, generated).expect("write the reference");
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "docs/reference/{file} is out of date; run `cargo xtask reference`"
    );
}

/// Every command's `--help`, depth first, each under a heading of its full name.
fn cli_reference() -> String {
    let mut out = String::from(
        "# `wasmctrl` command reference\n\n\
         Generated from the CLI's definitions by `cargo xtask reference`; do not edit. Every \
         command prints the same with `--help`. Logs go to stderr, filtered by `WASMCTRL_LOG` \
         (an `EnvFilter` directive: `info` by default, `debug`, or `wasmctrl=debug,kube=info`), \
         in the format `--log-format` names.\n",
    );
    let mut command = wasmctrl::cli::Cli::command();
    command.build();
    write_command(&mut out, &mut command, "wasmctrl");
    out
}

fn write_command(out: &mut String, command: &mut clap::Command, path: &str) {
    let depth = path.split(' ').count().min(4);
    let help = command
        .render_long_help()
        .to_string()
        .lines()
        .map(str::trim_end)
        .collect::<Vec<_>>()
        .join("\n");
    let _ = write!(
        out,
        "\n{} `{path}`\n\n```text\n{}\n```\n",
        "#".repeat(depth + 1),
        help.trim_end()
    );
    for sub in command.get_subcommands_mut() {
        if sub.get_name() == "help" {
            continue;
        }
        let name = format!("{path} {}", sub.get_name());
        write_command(out, sub, &name);
    }
}

/// One row per field of a CRD version's schema, depth first.
fn crd_reference() -> String {
    let mut out = String::from(
        "# Policy fields\n\n\
         Generated from the CustomResourceDefinitions in `crds/` by `cargo xtask reference`; do \
         not edit. A `NamespacedReconcilePolicy` has the same `spec` and `status` as a \
         `ReconcilePolicy` (the host confines it to its namespace: see docs/operating.md). Types \
         are the OpenAPI types; validation is what the API server checks before the host \
         ever sees the object.\n",
    );
    let crd = serde_json::to_value(wasmctrl::policy::ReconcilePolicy::crd()).expect("CRD");
    for version in crd["spec"]["versions"].as_array().into_iter().flatten() {
        let _ = write!(
            out,
            "\n## `{}/{}` `{}`\n\n| field | type | default | validation | description |\n|---|---|---|---|---|\n",
            crd["spec"]["group"].as_str().unwrap_or_default(),
            version["name"].as_str().unwrap_or_default(),
            crd["spec"]["names"]["kind"].as_str().unwrap_or_default(),
        );
        let schema = &version["schema"]["openAPIV3Schema"];
        for part in ["spec", "status"] {
            let required = is_required(schema, part);
            write_field(&mut out, part, &schema["properties"][part], required);
        }
    }
    out
}

fn is_required(schema: &Value, field: &str) -> bool {
    schema["required"]
        .as_array()
        .is_some_and(|r| r.iter().any(|f| f == field))
}

fn write_field(out: &mut String, path: &str, schema: &Value, required: bool) {
    let kind = match schema["type"].as_str() {
        Some("array") => format!("[]{}", schema["items"]["type"].as_str().unwrap_or("object")),
        Some(kind) => kind.to_owned(),
        None if schema["x-kubernetes-int-or-string"] == true => "int or string".to_owned(),
        None => "any".to_owned(),
    };
    let mut checks = Vec::new();
    if required {
        checks.push("required".to_owned());
    }
    for (key, label) in [
        ("minimum", "≥"),
        ("maximum", "≤"),
        ("minLength", "length ≥"),
        ("maxLength", "length ≤"),
        ("minItems", "items ≥"),
        ("maxItems", "items ≤"),
    ] {
        if let Some(bound) = schema.get(key).and_then(Value::as_f64) {
            // Integral bounds as integers, though the schema holds them as floats.
            #[allow(clippy::cast_possible_truncation)]
            let bound = if bound.fract() == 0.0 {
                (bound as i64).to_string()
            } else {
                bound.to_string()
            };
            checks.push(format!("{label} {bound}"));
        }
    }
    if let Some(pattern) = schema["pattern"].as_str() {
        checks.push(format!("matches `{}`", pattern.replace('|', "\\|")));
    }
    if let Some(values) = schema["enum"].as_array() {
        let values: Vec<String> = values.iter().map(|v| format!("`{v}`")).collect();
        checks.push(format!("one of {}", values.join(", ")));
    }
    for rule in schema["x-kubernetes-validations"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if let Some(message) = rule["message"].as_str() {
            checks.push(message.to_owned());
        }
    }
    let default = schema
        .get("default")
        .map(|d| format!("`{d}`"))
        .unwrap_or_default();
    let description = schema["description"]
        .as_str()
        .unwrap_or_default()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|");
    let _ = writeln!(
        out,
        "| `{path}` | {kind} | {default} | {} | {description} |",
        checks.join("; ").replace('|', "\\|")
    );
    let (children, prefix) = match schema["type"].as_str() {
        Some("array") => (&schema["items"], format!("{path}[]")),
        _ => (schema, path.to_owned()),
    };
    if let Some(properties) = children["properties"].as_object() {
        for (name, field) in properties {
            let required = is_required(children, name);
            write_field(out, &format!("{prefix}.{name}"), field, required);
        }
    }
}

#[test]
fn the_cli_reference_is_current() {
    assert_current("cli.md", &cli_reference());
}

#[test]
fn the_policy_field_reference_is_current() {
    assert_current("policy.md", &crd_reference());
}

/// GitHub's anchor for a heading: lower case, punctuation other than `-` and `_` dropped,
/// spaces as `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every relative link in the user docs names a file that exists, and an anchor in a
/// Markdown file names one of its headings.
#[test]
fn every_relative_link_in_the_docs_resolves() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut pages: Vec<std::path::PathBuf> = [
        "README.md",
        "CONTRIBUTING.md",
        "SECURITY.md",
        "CHANGELOG.md",
        "deploy/chart/wasmctrl/README.md",
    ]
    .iter()
    .map(|p| root.join(p))
    .collect();
    for entry in std::fs::read_dir(root.join("docs")).expect("docs/") {
        let path = entry.expect("an entry").path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
    let link = regex::Regex::new(r"\]\(([^)\s]+)\)").expect("regex");
    let mut broken = Vec::new();
    for page in &pages {
        let text = std::fs::read_to_string(page).expect("a page");
        for found in link.captures_iter(&text) {
            let target = &found[1];
            if target.starts_with("http://") || target.starts_with("https://") {
                continue;
            }
            let (file, anchor) = target.split_once('#').unwrap_or((target, ""));
            let path = if file.is_empty() {
                page.clone()
            } else {
                page.parent().expect("a directory").join(file)
            };
            if !path.exists() {
                broken.push(format!("{}: {target} (no such file)", page.display()));
                continue;
            }
            if anchor.is_empty() || path.extension().is_none_or(|e| e != "md") {
                continue;
            }
            let headings: Vec<String> = std::fs::read_to_string(&path)
                .expect("the target")
                .lines()
                .filter_map(|line| line.strip_prefix('#'))
                .map(|h| slug(h.trim_start_matches('#')))
                .collect();
            if !headings.iter().any(|h| h == anchor) {
                broken.push(format!("{}: {target} (no such heading)", page.display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}
