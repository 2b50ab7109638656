//! `wasmctrl plugin new`: a plugin crate that builds, tests and runs as it is.
//!
//! The crate is rendered from the templates in `host/templates/plugin/`: a parent type with
//! kube's `CustomResource` derive and a status, a reconciler with one child (a Deployment),
//! native tests, golden cases for `wasmctrl plugin test`, the CRD generated from the types,
//! a ReconcilePolicy, a README and the script its CI runs. The SDK travels inside this binary
//! and is written next to the crate (`vendor/`) unless `--sdk-path` names one, so the crate
//! builds without a checkout of this repository and against the contract this host serves.
//!
//! Inside a Cargo workspace the crate becomes a member (as `cargo new` does) and the
//! workspace root gets the `plugin` build profile if it has none; outside, the crate is its
//! own workspace and carries the profile.

use std::path::{Component, Path, PathBuf};

use anyhow::{Context as _, ensure};
use kube::CustomResourceExt as _;

/// Scaffold a plugin crate.
#[derive(Debug, clap::Args)]
pub struct NewArgs {
    /// The crate's name, e.g. `backup-plugin`; also its directory unless `--dir` says otherwise.
    name: String,
    /// The parent kind's API group, e.g. `example.com`.
    #[arg(long)]
    group: String,
    /// The parent kind's API version, e.g. `v1` or `v1alpha1`.
    #[arg(long)]
    version: String,
    /// The parent kind, in CamelCase, e.g. `Backup`.
    #[arg(long)]
    kind: String,
    /// The kind's plural resource name (default: the lowercase kind, pluralized).
    #[arg(long)]
    plural: Option<String>,
    /// Where to create the crate (default: ./NAME). Must not exist or be empty.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Use the SDK at this path instead of writing this host's copy to `vendor/`.
    #[arg(long, value_name = "DIR")]
    sdk_path: Option<PathBuf>,
    /// Also serve webhooks for the kind: a validator, a defaulter and a converter from an
    /// older API version, with native tests and webhook cases.
    #[arg(long)]
    with_webhooks: bool,
    /// With `--with-webhooks`: the older API version the converter converts from (default:
    /// the version before `--version`, e.g. `v1beta1` before `v1`).
    #[arg(long, value_name = "VERSION", requires = "with_webhooks")]
    convert_from: Option<String>,
}

/// The template files, by path in the new crate.
const TEMPLATES: &[(&str, &str)] = &[
    (
        "Cargo.toml",
        include_str!("../../templates/plugin/Cargo.toml"),
    ),
    (
        "src/lib.rs",
        include_str!("../../templates/plugin/src/lib.rs"),
    ),
    (
        "src/tests.rs",
        include_str!("../../templates/plugin/src/tests.rs"),
    ),
    (
        "cases/new.yaml",
        include_str!("../../templates/plugin/cases/new.yaml"),
    ),
    (
        "cases/ready.yaml",
        include_str!("../../templates/plugin/cases/ready.yaml"),
    ),
    (
        "examples/{{singular}}.yaml",
        include_str!("../../templates/plugin/examples/parent.yaml"),
    ),
    (
        "deploy/policy.yaml",
        include_str!("../../templates/plugin/deploy/policy.yaml"),
    ),
    (
        "README.md",
        include_str!("../../templates/plugin/README.md"),
    ),
    ("ci.sh", include_str!("../../templates/plugin/ci.sh")),
    (
        ".gitignore",
        include_str!("../../templates/plugin/gitignore"),
    ),
];

/// The files `--with-webhooks` adds, by path in the new crate.
const WEBHOOK_TEMPLATES: &[(&str, &str)] = &[
    (
        "src/webhooks.rs",
        include_str!("../../templates/plugin/webhooks/webhooks.rs"),
    ),
    (
        "cases/validate-too-many-replicas.yaml",
        include_str!("../../templates/plugin/webhooks/cases/validate-too-many-replicas.yaml"),
    ),
    (
        "cases/default-replicas.yaml",
        include_str!("../../templates/plugin/webhooks/cases/default-replicas.yaml"),
    ),
    (
        "cases/convert-to-{{older_version}}.yaml",
        include_str!("../../templates/plugin/webhooks/cases/convert-to-older.yaml"),
    ),
];

/// The SDK's files, as this host was built with them.
const SDK_FILES: &[(&str, &str)] = &[
    (
        "Cargo.toml",
        include_str!("../../../plugins/sdk/Cargo.toml"),
    ),
    ("README.md", include_str!("../../../plugins/sdk/README.md")),
    (
        "wit/plugin.wit",
        include_str!("../../../plugins/sdk/wit/plugin.wit"),
    ),
    (
        "src/child.rs",
        include_str!("../../../plugins/sdk/src/child.rs"),
    ),
    (
        "src/conditions.rs",
        include_str!("../../../plugins/sdk/src/conditions.rs"),
    ),
    (
        "src/error.rs",
        include_str!("../../../plugins/sdk/src/error.rs"),
    ),
    (
        "src/glue.rs",
        include_str!("../../../plugins/sdk/src/glue.rs"),
    ),
    (
        "src/labels.rs",
        include_str!("../../../plugins/sdk/src/labels.rs"),
    ),
    (
        "src/lib.rs",
        include_str!("../../../plugins/sdk/src/lib.rs"),
    ),
    (
        "src/log.rs",
        include_str!("../../../plugins/sdk/src/log.rs"),
    ),
    (
        "src/request.rs",
        include_str!("../../../plugins/sdk/src/request.rs"),
    ),
    (
        "src/response.rs",
        include_str!("../../../plugins/sdk/src/response.rs"),
    ),
    (
        "src/testing.rs",
        include_str!("../../../plugins/sdk/src/testing.rs"),
    ),
    (
        "src/webhooks.rs",
        include_str!("../../../plugins/sdk/src/webhooks.rs"),
    ),
];

/// Where the SDK is written inside the new crate.
const VENDORED_SDK: &str = "vendor/wasmctrl-plugin-sdk";

/// The build profile plugins are built with: small components load and compile faster. The
/// same settings as this repository's `[profile.plugin]`.
const PLUGIN_PROFILE: &str = r#"
[profile.plugin]
inherits = "release"
opt-level = 3
lto = true
codegen-units = 1
strip = true
panic = "abort"
debug = false
"#;

/// The names the templates are filled with.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Names {
    name: String,
    crate_name: String,
    group: String,
    version: String,
    kind: String,
    singular: String,
    plural: String,
    /// With `--with-webhooks`: the version the converter converts from.
    older_version: Option<String>,
}

impl Names {
    fn new(args: &NewArgs) -> anyhow::Result<Self> {
        let name = &args.name;
        ensure!(
            !name.is_empty()
                && name.starts_with(|c: char| c.is_ascii_lowercase())
                && name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_'),
            "crate name {name:?}: use lowercase letters, digits, `-` and `_`, starting with a letter"
        );
        let kind = &args.kind;
        ensure!(
            kind.starts_with(|c: char| c.is_ascii_uppercase())
                && kind.chars().all(|c| c.is_ascii_alphanumeric()),
            "kind {kind:?}: use CamelCase letters and digits, starting with a capital (e.g. `Backup`)"
        );
        let group = &args.group;
        ensure!(
            group.contains('.') && group.split('.').all(is_dns_label),
            "group {group:?}: use a DNS subdomain you own, e.g. `example.com`"
        );
        let version = &args.version;
        ensure!(
            is_api_version(version),
            "version {version:?}: use a Kubernetes API version such as `v1`, `v1beta1` or `v2alpha3`"
        );
        let singular = kind.to_ascii_lowercase();
        let plural = match &args.plural {
            Some(plural) => {
                ensure!(
                    is_dns_label(plural),
                    "plural {plural:?}: use lowercase letters, digits and `-`"
                );
                plural.clone()
            }
            None => pluralize(&singular),
        };
        let older_version = match (args.with_webhooks, &args.convert_from) {
            (false, _) => None,
            (true, Some(older)) => {
                ensure!(
                    is_api_version(older) && older != version,
                    "--convert-from {older:?}: use a Kubernetes API version other than {version}"
                );
                Some(older.clone())
            }
            (true, None) => Some(version_before(version).with_context(|| {
                format!("{version} is the first version there is: name the version to convert from with --convert-from")
            })?),
        };
        Ok(Self {
            name: name.clone(),
            crate_name: name.replace('-', "_"),
            group: group.clone(),
            version: version.clone(),
            kind: kind.clone(),
            singular,
            plural,
            older_version,
        })
    }
}

/// The API version Kubernetes sorts just before `version` in the usual progression
/// (`v1beta1` before `v1`, `v1alpha1` before `v1beta1`, `v1alpha1` before `v1alpha2`, `v1`
/// before `v2alpha1`); `None` for `v1alpha1`.
fn version_before(version: &str) -> Option<String> {
    let rest = version.strip_prefix('v')?;
    let digits = rest.chars().take_while(char::is_ascii_digit).count();
    let major: u32 = rest[..digits].parse().ok()?;
    let stage = &rest[digits..];
    let number = |n: &str| n.parse::<u32>().ok();
    if stage.is_empty() {
        return Some(format!("v{major}beta1"));
    }
    if let Some(n) = stage.strip_prefix("beta").and_then(number) {
        return Some(if n > 1 {
            format!("v{major}beta{}", n - 1)
        } else {
            format!("v{major}alpha1")
        });
    }
    let n = stage.strip_prefix("alpha").and_then(number)?;
    match (n, major) {
        (2.., _) => Some(format!("v{major}alpha{}", n - 1)),
        (_, 2..) => Some(format!("v{}", major - 1)),
        _ => None,
    }
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// `v1`, `v1beta1`, `v2alpha3`: what Kubernetes sorts as a version.
fn is_api_version(s: &str) -> bool {
    let Some(rest) = s.strip_prefix('v') else {
        return false;
    };
    let digits = rest.chars().take_while(char::is_ascii_digit).count();
    if digits == 0 || rest.starts_with('0') {
        return false;
    }
    let rest = &rest[digits..];
    if rest.is_empty() {
        return true;
    }
    ["alpha", "beta"].iter().any(|stage| {
        rest.strip_prefix(stage).is_some_and(|n| {
            !n.is_empty() && !n.starts_with('0') && n.chars().all(|c| c.is_ascii_digit())
        })
    })
}

/// Where cargo puts the component, as the scaffold's files name it (relative to the crate),
/// the directory a host must be given for it (`--plugin-dir`: the host reads file sources
/// there only), and the crate's own workspace tables when no workspace encloses it.
fn component_paths(
    workspace: Option<&Workspace>,
    dir: &Path,
    crate_name: &str,
) -> (String, String, String) {
    let wasm = format!("wasm32-wasip2/plugin/{}.wasm", crate_name);
    let (wasm_path, workspace_tables) = match workspace {
        Some(ws) => (
            relative(&ws.root.join("target").join(&wasm), dir),
            String::new(),
        ),
        None => (
            Path::new("target").join(&wasm),
            format!(
                "\n# Its own workspace; remove this table to join an enclosing one (the `plugin`\n\
                 # profile then goes in that workspace's root Cargo.toml).\n[workspace]\n{PLUGIN_PROFILE}"
            ),
        ),
    };
    let plugin_dir = wasm_path
        .parent()
        .map(|dir| dir.to_string_lossy().into_owned())
        .unwrap_or_default();
    (
        wasm_path.to_string_lossy().into_owned(),
        plugin_dir,
        workspace_tables,
    )
}

/// English plural of a lowercase kind, as most CRDs spell it (`policy` → `policies`).
fn pluralize(singular: &str) -> String {
    if let Some(stem) = singular.strip_suffix('y')
        && !stem.ends_with(['a', 'e', 'i', 'o', 'u'])
    {
        return format!("{stem}ies");
    }
    if singular.ends_with(['s', 'x', 'z']) || singular.ends_with("ch") || singular.ends_with("sh") {
        return format!("{singular}es");
    }
    format!("{singular}s")
}

/// A Cargo workspace the new crate lands in.
struct Workspace {
    root: PathBuf,
    manifest: toml_edit::DocumentMut,
}

impl Workspace {
    /// The nearest `Cargo.toml` with a `[workspace]` table above `dir`, if any.
    fn enclosing(dir: &Path) -> anyhow::Result<Option<Self>> {
        for ancestor in dir.ancestors().skip(1) {
            let path = ancestor.join("Cargo.toml");
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            let manifest: toml_edit::DocumentMut = text
                .parse()
                .with_context(|| format!("{} is not valid TOML", path.display()))?;
            if manifest.contains_key("workspace") {
                return Ok(Some(Self {
                    root: ancestor.to_path_buf(),
                    manifest,
                }));
            }
        }
        Ok(None)
    }

    /// Add `member` to `workspace.members` and the `plugin` profile if the root has none.
    /// Returns what changed, for the summary.
    fn adopt(mut self, member: &str) -> anyhow::Result<Vec<String>> {
        let mut changes = Vec::new();
        let workspace = self.manifest["workspace"]
            .as_table_like_mut()
            .context("`workspace` in the root Cargo.toml is not a table")?;
        if workspace.get("members").is_none() {
            workspace.insert("members", toml_edit::value(toml_edit::Array::new()));
        }
        let members = workspace
            .get_mut("members")
            .and_then(|m| m.as_array_mut())
            .context("`workspace.members` in the root Cargo.toml is not a list")?;
        if !members.iter().any(|m| m.as_str() == Some(member)) {
            members.push(member);
            changes.push(format!("added {member:?} to workspace.members"));
        }
        let has_profile = self
            .manifest
            .get("profile")
            .and_then(|p| p.get("plugin"))
            .is_some();
        let mut text = self.manifest.to_string();
        if !has_profile {
            text.push_str(PLUGIN_PROFILE);
            changes.push("added [profile.plugin] (profiles are read from the root only)".into());
        }
        let path = self.root.join("Cargo.toml");
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        Ok(changes)
    }
}

/// `path` relative to `base` (both absolute), with `..` where it climbs.
fn relative(path: &Path, base: &Path) -> PathBuf {
    let path: Vec<Component> = path.components().collect();
    let base: Vec<Component> = base.components().collect();
    let common = path.iter().zip(&base).take_while(|(a, b)| a == b).count();
    let mut out = PathBuf::new();
    for _ in common..base.len() {
        out.push("..");
    }
    for part in &path[common..] {
        out.push(part);
    }
    out
}

fn absolute(path: &Path) -> anyhow::Result<PathBuf> {
    Ok(std::path::absolute(path)?)
}

/// Fill `{{…}}` placeholders.
fn render(template: &str, values: &[(&str, &str)]) -> String {
    let mut text = template.to_owned();
    for (key, value) in values {
        text = text.replace(&format!("{{{{{key}}}}}"), value);
    }
    text
}

/// The CRD of the scaffolded kind, as the crate's own `deploy_crd_yaml_matches_the_types`
/// test generates it (that test is what keeps the two the same).
fn crd_yaml(names: &Names) -> anyhow::Result<String> {
    let mut crd = serde_json::to_value(template_types::Scaffold::crd())?;
    crd["metadata"]["name"] = format!("{}.{}", names.plural, names.group).into();
    let spec = &mut crd["spec"];
    spec["group"] = names.group.clone().into();
    spec["names"]["kind"] = names.kind.clone().into();
    spec["names"]["plural"] = names.plural.clone().into();
    spec["names"]["singular"] = names.singular.clone().into();
    let version = &mut spec["versions"][0];
    version["name"] = names.version.clone().into();
    let schema = &mut version["schema"]["openAPIV3Schema"];
    schema["description"] = format!(
        "Auto-generated derived type for {}Spec via `CustomResource`",
        names.kind
    )
    .into();
    schema["title"] = names.kind.clone().into();
    Ok(format!(
        "# Generated from src/lib.rs by `UPDATE_CRD=1 cargo test`; do not edit.\n{}",
        crate::yaml::to_string(&crd)?
    ))
}

/// Where the crate's SDK dependency points: `--sdk-path`, or the copy written to `vendor/`.
fn sdk_path(args: &NewArgs) -> anyhow::Result<String> {
    Ok(match &args.sdk_path {
        Some(path) => {
            let path = absolute(path)?;
            ensure!(
                path.join("Cargo.toml").is_file(),
                "--sdk-path {}: no Cargo.toml there",
                path.display()
            );
            path.to_string_lossy().into_owned()
        }
        None => VENDORED_SDK.to_owned(),
    })
}

/// What `--with-webhooks` changes in the crate.
struct Flavour {
    /// The SDK's features.
    features: &'static str,
    /// The lines of `lib.rs` that declare the webhooks module.
    webhooks_module: &'static str,
    /// The line of `lib.rs` that exports the plugin.
    export: &'static str,
    /// The files it adds.
    templates: &'static [(&'static str, &'static str)],
}

impl Flavour {
    fn of(with_webhooks: bool) -> Self {
        if with_webhooks {
            Self {
                features: r#"["schemars", "webhooks"]"#,
                webhooks_module: "mod webhooks;\n\npub use webhooks::{MAX_REPLICAS, {{kind}}Rules, {{kind}}Versions};\n",
                export: "wasmctrl_plugin_sdk::export_plugin!(\n    reconciler: {{kind}}Reconciler,\n    validator: {{kind}}Rules,\n    defaulter: {{kind}}Rules,\n    converter: {{kind}}Versions,\n);",
                templates: WEBHOOK_TEMPLATES,
            }
        } else {
            Self {
                features: r#"["schemars"]"#,
                webhooks_module: "",
                export: "wasmctrl_plugin_sdk::export_reconciler!({{kind}}Reconciler);",
                templates: &[],
            }
        }
    }
}

/// Write the crate; returns the summary to print.
pub fn scaffold(args: &NewArgs) -> anyhow::Result<String> {
    let names = Names::new(args)?;
    let dir = absolute(args.dir.as_deref().unwrap_or(Path::new(&args.name)))?;
    if dir.exists() {
        let empty = std::fs::read_dir(&dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .next()
            .is_none();
        ensure!(empty, "{} exists and is not empty", dir.display());
    }
    let workspace = Workspace::enclosing(&dir)?;
    let (wasm_path, plugin_dir, workspace_tables) =
        component_paths(workspace.as_ref(), &dir, &names.crate_name);
    let sdk_path = sdk_path(args)?;
    let flavour = Flavour::of(args.with_webhooks);
    let sdk_dependency = format!(
        "wasmctrl-plugin-sdk = {{ path = {}, features = {} }}",
        toml_edit::Value::from(sdk_path.as_str()),
        flavour.features
    );
    let older_version = names.older_version.clone().unwrap_or_default();
    let values = [
        ("name", names.name.as_str()),
        ("crate", names.crate_name.as_str()),
        ("group", names.group.as_str()),
        ("version", names.version.as_str()),
        ("kind", names.kind.as_str()),
        ("singular", names.singular.as_str()),
        ("plural", names.plural.as_str()),
        ("wasm_path", wasm_path.as_str()),
        ("plugin_dir", plugin_dir.as_str()),
        ("sdk_dependency", sdk_dependency.as_str()),
        ("workspace_tables", workspace_tables.as_str()),
        ("wasmctrl_version", env!("CARGO_PKG_VERSION")),
        ("older_version", older_version.as_str()),
    ];
    // The export lines name the kind: filled first, then with everything else.
    let values_of_lib = [
        ("webhooks_module", flavour.webhooks_module),
        ("export", flavour.export),
    ];
    let mut files: Vec<(PathBuf, String)> = TEMPLATES
        .iter()
        .chain(flavour.templates)
        .map(|(path, text)| {
            (
                PathBuf::from(render(path, &values)),
                render(&render(text, &values_of_lib), &values),
            )
        })
        .collect();
    files.push(("deploy/crd.yaml".into(), crd_yaml(&names)?));
    if args.sdk_path.is_none() {
        files.extend(
            SDK_FILES
                .iter()
                .map(|(path, text)| (Path::new(VENDORED_SDK).join(path), (*text).to_owned())),
        );
    }
    for (path, text) in &files {
        let path = dir.join(path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    make_executable(&dir.join("ci.sh"))?;

    let mut summary = format!(
        "Created the {} plugin for {}.{}/{} in {}\n",
        names.name,
        names.plural,
        names.group,
        names.version,
        dir.display()
    );
    if let Some(workspace) = workspace {
        let root = workspace.root.clone();
        let member = relative(&dir, &root).to_string_lossy().into_owned();
        for change in workspace.adopt(&member)? {
            summary.push_str(&format!(
                "{}: {change}\n",
                root.join("Cargo.toml").display()
            ));
        }
    }
    summary.push_str(&format!(
        "Next:\n  cd {}\n  ./ci.sh        # cargo test, the component build, wasmctrl plugin test\n  \
         then see README.md to run it offline and deploy it\n",
        dir.display()
    ));
    Ok(summary)
}

#[cfg(unix)]
fn make_executable(path: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("making {} executable", path.display()))
}

#[cfg(not(unix))]
fn make_executable(_: &Path) -> anyhow::Result<()> {
    Ok(())
}

/// The scaffold's types with a fixed group and kind: their CRD, renamed, is the new crate's.
/// Field for field (docs and schema attributes included) the same as `templates/plugin/src/
/// lib.rs`; the scaffolded crate's CRD test fails if they drift apart.
mod template_types {
    use kube::CustomResource;
    use schemars::JsonSchema;
    use serde::{Deserialize, Serialize};
    use wasmctrl_plugin_sdk::Condition;

    /// What to run: `replicas` copies of `image`.
    #[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
    #[kube(
        group = "scaffold.wasmctrl.dev",
        version = "v1",
        kind = "Scaffold",
        plural = "scaffolds",
        namespaced,
        status = "ScaffoldStatus",
        printcolumn = r#"{"name":"Replicas","type":"integer","jsonPath":".spec.replicas"}"#,
        printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.readyReplicas"}"#,
        printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
    )]
    #[serde(rename_all = "camelCase")]
    pub struct ScaffoldSpec {
        /// The container image to run.
        #[schemars(length(min = 1))]
        pub image: String,
        /// How many pods to run.
        #[schemars(range(min = 0))]
        pub replicas: i32,
    }

    /// What the plugin observed.
    #[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
    #[serde(rename_all = "camelCase")]
    pub struct ScaffoldStatus {
        /// Pods the Deployment reports ready.
        #[serde(default)]
        pub ready_replicas: i32,
        /// The generation the host last reconciled (written by the host).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub observed_generation: Option<i64>,
        /// `Ready` (from the plugin) and `Reconciled` (from the host).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub conditions: Vec<Condition>,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(name: &str, kind: &str, version: &str) -> NewArgs {
        NewArgs {
            name: name.into(),
            group: "example.com".into(),
            version: version.into(),
            kind: kind.into(),
            plural: None,
            dir: None,
            sdk_path: None,
            with_webhooks: false,
            convert_from: None,
        }
    }

    #[test]
    fn names_are_checked_and_derived() {
        let names = Names::new(&args("backup-plugin", "Backup", "v1alpha1")).expect("valid");
        assert_eq!(names.crate_name, "backup_plugin");
        assert_eq!(
            (names.singular.as_str(), names.plural.as_str()),
            ("backup", "backups")
        );
        for (kind, plural) in [
            ("Policy", "policies"),
            ("Gateway", "gateways"),
            ("Box", "boxes"),
        ] {
            assert_eq!(
                Names::new(&args("p", kind, "v1")).expect("valid").plural,
                plural
            );
        }
        for (name, kind, version) in [
            ("Backup", "Backup", "v1"),
            ("backup", "backup", "v1"),
            ("backup", "Back-up", "v1"),
            ("backup", "Backup", "1"),
            ("backup", "Backup", "v1gamma1"),
            ("backup", "Backup", "v0"),
        ] {
            assert!(
                Names::new(&args(name, kind, version)).is_err(),
                "{name} {kind} {version}"
            );
        }
        let mut bad_group = args("backup", "Backup", "v1");
        bad_group.group = "localhost".into();
        assert!(Names::new(&bad_group).is_err());
    }

    #[test]
    fn every_sdk_file_travels_in_the_binary() {
        let sdk = Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugins/sdk");
        let mut on_disk = Vec::new();
        for dir in ["", "src", "wit"] {
            for entry in std::fs::read_dir(sdk.join(dir)).expect("read the SDK") {
                let path = entry.expect("entry").path();
                if path.is_file() {
                    on_disk.push(relative(&path, &sdk).to_string_lossy().into_owned());
                }
            }
        }
        on_disk.sort();
        let mut embedded: Vec<String> = SDK_FILES.iter().map(|(p, _)| (*p).to_owned()).collect();
        embedded.sort();
        assert_eq!(embedded, on_disk, "update SDK_FILES in plugin_new.rs");
    }

    #[test]
    fn every_placeholder_is_filled_and_the_crd_names_the_kind() {
        let names = Names::new(&args("backup-plugin", "Backup", "v1")).expect("valid");
        let values = [
            ("name", "n"),
            ("crate", "c"),
            ("group", "g"),
            ("version", "v"),
            ("kind", "K"),
            ("singular", "s"),
            ("plural", "p"),
            ("wasm_path", "w"),
            ("plugin_dir", "pd"),
            ("sdk_dependency", "d"),
            ("workspace_tables", "t"),
            ("wasmctrl_version", "0"),
            ("older_version", "o"),
            ("webhooks_module", "m"),
            ("export", "e"),
        ];
        for (path, text) in TEMPLATES.iter().chain(WEBHOOK_TEMPLATES) {
            let rendered = render(text, &values);
            assert!(!rendered.contains("{{"), "{path} keeps a placeholder");
            assert!(!render(path, &values).contains("{{"), "{path}");
        }
        let crd: serde_json::Value =
            serde_yaml_ng::from_str(&crd_yaml(&names).expect("crd")).expect("yaml");
        assert_eq!(crd["metadata"]["name"], "backups.example.com");
        assert_eq!(crd["spec"]["names"]["kind"], "Backup");
        let text = crd.to_string();
        assert!(
            !text.contains("Scaffold") && !text.contains("scaffold"),
            "{text}"
        );
    }

    #[test]
    fn the_converter_converts_from_the_version_before() {
        for (version, before) in [
            ("v1", Some("v1beta1")),
            ("v1beta2", Some("v1beta1")),
            ("v1beta1", Some("v1alpha1")),
            ("v1alpha3", Some("v1alpha2")),
            ("v2alpha1", Some("v1")),
            ("v1alpha1", None),
        ] {
            assert_eq!(version_before(version).as_deref(), before, "{version}");
        }
        let mut first = args("p", "Backup", "v1alpha1");
        first.with_webhooks = true;
        let err = Names::new(&first).expect_err("nothing before v1alpha1");
        assert!(err.to_string().contains("--convert-from"), "{err}");
        first.convert_from = Some("v1alpha1".into());
        assert!(Names::new(&first).is_err(), "not from itself");
        first.convert_from = Some("v1beta9".into());
        assert_eq!(
            Names::new(&first).expect("valid").older_version.as_deref(),
            Some("v1beta9")
        );
    }

    #[test]
    fn relative_paths_climb_where_they_must() {
        assert_eq!(
            relative(Path::new("/w/target/x"), Path::new("/w/plugins/p")),
            Path::new("../../target/x")
        );
        assert_eq!(
            relative(Path::new("/w/plugins/p"), Path::new("/w")),
            Path::new("plugins/p")
        );
    }
}
