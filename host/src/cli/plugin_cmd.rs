//! `wasmctrl plugin run | diff | replay | test | new | inspect | push | pull`: the plugin runtime
//! without a cluster, and plugins in a registry.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use clap::{Subcommand, ValueEnum};
use serde::Serialize;

use super::input;
use super::kinds::KindTable;
use super::locate::{self, Step};
use super::webhook_cases::{self, CaseResult};
pub use crate::case::RunOutput;
use crate::case::{Case, Expected, RecordedError, compare_answers};
use crate::controller::offline::OfflinePolicy;
use crate::plugin::{
    CONTRACT_VERSIONS, CallError, Digest, EngineOptions, Hide, Limits, ObservedObject, Plugin,
    PluginEngine, ReconcileRequest, Verdict,
};
use crate::policy::ReconcilePolicySpec;

/// Offline plugin commands.
#[derive(Debug, Subcommand)]
pub enum PluginCommand {
    /// Evaluate one reconcile exactly as the host does and print the decision.
    Run {
        /// The plugin component (.wasm).
        plugin: PathBuf,
        /// What the plugin is asked.
        #[command(flatten)]
        request: RequestArgs,
        /// Refuse the plugin unless its bytes hash to this `sha256:` digest.
        #[arg(long)]
        digest: Option<Digest>,
        /// Run as the host runs this ReconcilePolicy: the plugin sees only the children the
        /// parent controls and the related objects the policy selects, gets the policy's
        /// config (unless `--config`) and limits, and its answer is validated and stamped
        /// (namespace, ownerReference, labels) with the status completed (`observedGeneration`,
        /// `Reconciled`). CustomResourceDefinitions in the same file tell their kinds' scope.
        #[arg(long, value_name = "POLICY.yaml")]
        policy: Option<PathBuf>,
        /// CustomResourceDefinitions of the policy's custom child kinds, for their scope.
        #[arg(long = "crd", value_name = "FILE", requires = "policy")]
        crds: Vec<PathBuf>,
        /// Call the plugin's webhooks instead of reconcile: `validate` or `default` the
        /// `--parent` as written (with `--old`, an update), or convert it to another version.
        #[command(flatten)]
        webhook: WebhookArgs,
        /// The sandbox's limits (a policy's own limits take precedence).
        #[command(flatten)]
        limits: LimitArgs,
        /// Output format.
        #[arg(short, long, value_enum, default_value_t = Format::Yaml)]
        output: Format,
    },
    /// Show what a candidate plugin would do differently from the active one for one parent:
    /// the comparison a shadow run makes for every parent in the cluster. Exits 0 when the
    /// answers are the same, 1 when the candidate would change or fail, 2 on an error.
    Diff {
        /// The active plugin component (.wasm).
        active: PathBuf,
        /// The candidate plugin component (.wasm).
        candidate: PathBuf,
        /// What both plugins are asked.
        #[command(flatten)]
        request: RequestArgs,
        /// The candidate's config, when it differs from `--config`.
        #[arg(long)]
        candidate_config: Option<PathBuf>,
        /// The sandbox's limits.
        #[command(flatten)]
        limits: LimitArgs,
        /// Output format.
        #[arg(short, long, value_enum, default_value_t = Format::Yaml)]
        output: Format,
    },
    /// Run saved or recorded cases against a plugin and say, per case, whether its answer is
    /// unchanged, would change or would fail. Exits 1 when any case is not unchanged.
    Replay {
        /// The plugin component (.wasm).
        plugin: PathBuf,
        /// Case files (`explain --save`, `run --record-dir`), or directories of them.
        #[arg(required = true)]
        cases: Vec<PathBuf>,
        /// Compare with the answers recorded in the cases: a regression suite.
        #[arg(long, conflicts_with = "against", required_unless_present = "against")]
        expect: bool,
        /// Compare with this plugin's answers to the same cases.
        #[arg(long, value_name = "OLD.wasm")]
        against: Option<PathBuf>,
        /// Also convert each case's parent to this API version (`example.com/v1alpha1`) and
        /// back through the plugin's converter: a case whose parent does not come back
        /// unchanged would fail. Repeat for each version the kind is served at.
        #[arg(long, value_name = "API_VERSION")]
        convert_to: Vec<String>,
        /// The sandbox's limits.
        #[command(flatten)]
        limits: LimitArgs,
        /// Output format.
        #[arg(short, long, value_enum, default_value_t = ReplayFormat::Text)]
        output: ReplayFormat,
    },
    /// Run golden cases: each case's request against the plugin, its answer compared with the
    /// case's `expect` (or, for a recorded case, what was recorded). Exits 1 on any mismatch,
    /// so a plugin repository's CI can run it.
    Test {
        /// The plugin component (.wasm).
        plugin: PathBuf,
        /// Case files, or directories of them.
        #[arg(required = true)]
        cases: Vec<PathBuf>,
        /// Write the plugin's answer into the `expect` of every case it does not match (or that
        /// has none), instead of failing. Review the change before committing it.
        #[arg(long)]
        update: bool,
        /// The sandbox's limits.
        #[command(flatten)]
        limits: LimitArgs,
        /// Output format.
        #[arg(short, long, value_enum, default_value_t = ReplayFormat::Text)]
        output: ReplayFormat,
    },
    /// Create a plugin crate that builds, tests and runs as it is: the parent type and its CRD,
    /// a reconciler with one child, native tests, golden cases, a ReconcilePolicy, a README
    /// and the script its CI runs.
    New(super::plugin_new::NewArgs),
    /// Show a plugin's digest, size, contract version, imports, exports and compile time; of
    /// a file, or of a plugin in a registry (`REGISTRY/REPOSITORY:TAG`), with its manifest's
    /// digest.
    Inspect {
        /// The plugin component (.wasm), or a registry reference.
        plugin: String,
        /// How to reach the registry, for a reference.
        #[command(flatten)]
        registry: super::plugin_oci::RegistryArgs,
        /// Output format.
        #[arg(short, long, value_enum, default_value_t = Format::Yaml)]
        output: Format,
    },
    /// Publish a plugin to an OCI registry as a Wasm artifact that `oras`, `wkg` and `crane`
    /// read too, with the credentials `docker login` (or `oras login`) stored. Prints the
    /// reference pinned by the manifest's digest, the component's digest, and the policy
    /// lines that pin them.
    Push(super::plugin_oci::PushArgs),
    /// Download a plugin from an OCI registry; the manifest's and the component's digests
    /// are checked on the way.
    Pull(super::plugin_oci::PullArgs),
    /// Make an ECDSA P-256 key pair for signing plugins, as `cosign generate-key-pair` does.
    Keygen(super::plugin_sign::KeygenArgs),
    /// Sign a plugin file (a `.sig` bundle beside it, as `cosign sign-blob --bundle`) or a
    /// registry artifact (a signature in the repository, as `cosign sign`).
    Sign(super::plugin_sign::SignArgs),
    /// Check a plugin's signatures as the host does, and print who signed it.
    Verify(super::plugin_sign::VerifyArgs),
}

/// What the plugin is asked: the parent and what the cluster holds for it, or a case file.
#[derive(Debug, clap::Args)]
pub struct RequestArgs {
    /// A case file (`wasmctrl explain --save`, a recorded case) holding all of the request.
    #[arg(long, conflicts_with_all = ["parent", "children", "related", "config", "finalizing"])]
    case: Option<PathBuf>,
    /// The parent object (YAML or JSON).
    #[arg(long, required_unless_present = "case")]
    parent: Option<PathBuf>,
    /// Observed children (YAML or JSON; multi-document and `kind: List` files work).
    #[arg(long = "children", value_name = "FILE")]
    children: Vec<PathBuf>,
    /// Related objects (YAML or JSON).
    #[arg(long = "related", value_name = "FILE")]
    related: Vec<PathBuf>,
    /// The plugin config (one YAML or JSON object).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Call as if the parent were being deleted.
    #[arg(long)]
    finalizing: bool,
}

impl RequestArgs {
    /// The plugin's error, with a position in the JSON it was given (a decoding error)
    /// moved to where that value is in the user's file.
    fn locate(&self, error: CallError, parent: &str, config: Option<&str>) -> anyhow::Error {
        let message = error.to_string();
        let relocate = |file: &Path, json: &str, prefix: &[Step]| {
            let text = std::fs::read_to_string(file).ok()?;
            locate::relocate(&message, json, file, &text, prefix)
        };
        // The SDK names the config when that is what failed to decode; else it is the parent.
        let relocated = if message.contains("plugin config is invalid") {
            match (&self.case, &self.config, config) {
                (Some(case), _, Some(json)) => relocate(case, json, &[Step::Key("config".into())]),
                (None, Some(file), Some(json)) => relocate(file, json, &[]),
                _ => None,
            }
        } else {
            match (&self.case, &self.parent) {
                (Some(case), _) => relocate(case, parent, &[Step::Key("parent".into())]),
                (None, Some(file)) => relocate(file, parent, &[]),
                (None, None) => None,
            }
        };
        match relocated {
            Some(message) => anyhow::anyhow!(message),
            None => error.into(),
        }
    }

    /// The file the parent came from, for messages.
    fn source(&self) -> &Path {
        self.case
            .as_deref()
            .or(self.parent.as_deref())
            .unwrap_or(Path::new(""))
    }

    fn request(&self) -> anyhow::Result<ReconcileRequest> {
        if let Some(case) = &self.case {
            return Ok(Case::read(case)?.request());
        }
        let parent = self
            .parent
            .as_deref()
            .context("--parent or --case is required")?;
        Ok(ReconcileRequest {
            parent: input::read_object(parent)?.to_string(),
            children: read_all(&self.children)?,
            related: read_all(&self.related)?,
            config: read_config(self.config.as_deref())?,
            finalizing: self.finalizing,
        })
    }
}

fn read_config(path: Option<&Path>) -> anyhow::Result<Option<String>> {
    Ok(path
        .map(input::read_object)
        .transpose()?
        .map(|c| c.to_string()))
}

/// What `plugin run` was given, less the policy.
struct RunArgs {
    plugin: PathBuf,
    request: RequestArgs,
    digest: Option<Digest>,
    limits: LimitArgs,
    output: Format,
}

/// `plugin run` without a policy: the request exactly as given.
async fn run_plainly(engine: PluginEngine, run: RunArgs) -> anyhow::Result<()> {
    let request = run.request.request()?;
    let plugin = load(
        &engine,
        &run.plugin,
        run.digest.as_ref(),
        run.limits.limits(),
    )?;
    let (parent, config) = (request.parent.clone(), request.config.clone());
    let response = plugin
        .reconcile(request)
        .await
        .map_err(|e| run.request.locate(e, &parent, config.as_deref()))
        .with_context(|| format!("reconciling {}", run.request.source().display()))?;
    print(&RunOutput::from(response), run.output)
}

/// `plugin run --policy`: the request as the host would build it (notes on stderr for what
/// it leaves out), the answer as the host would apply and write it.
async fn run_as_host(
    engine: PluginEngine,
    run: RunArgs,
    policy: &Path,
    crds: &[PathBuf],
) -> anyhow::Result<()> {
    let as_host = AsHost::read(policy, crds)?;
    let (request, left_out) = as_host.request(&run.request)?;
    for note in left_out {
        eprintln!("note: the host would not pass {note}");
    }
    let limits = crate::registry::limits_over(run.limits.limits(), as_host.limits());
    let plugin = load(&engine, &run.plugin, run.digest.as_ref(), limits)?;
    let parent: serde_json::Value = serde_json::from_str(&request.parent)?;
    let (parent_json, config) = (request.parent.clone(), request.config.clone());
    let response = plugin
        .reconcile(request)
        .await
        .map_err(|e| run.request.locate(e, &parent_json, config.as_deref()))
        .with_context(|| format!("reconciling {}", run.request.source().display()))?;
    let answer = as_host.policy.answer(&parent, response.clone())?;
    print(
        &RunOutput {
            children: answer.children,
            status: Some(answer.status),
            ..RunOutput::from(response)
        },
        run.output,
    )
}

/// A ReconcilePolicy read for `plugin run --policy`.
struct AsHost {
    policy: OfflinePolicy,
    spec_limits: Option<crate::policy::PolicyLimits>,
}

impl AsHost {
    /// The policy in `path` (the only ReconcilePolicy there), with the scope of its child
    /// kinds from the built-in table and the CRDs in `path` and `crds`.
    fn read(path: &Path, crds: &[PathBuf]) -> anyhow::Result<Self> {
        let mut kinds = KindTable::builtin();
        let mut policies = Vec::new();
        for file in std::iter::once(path).chain(crds.iter().map(PathBuf::as_path)) {
            for object in input::read_objects(file)? {
                match object["kind"].as_str() {
                    Some("ReconcilePolicy") if file == path => policies.push(object),
                    Some("CustomResourceDefinition") => {
                        kinds.add_crd(&object).with_context(|| {
                            format!("{}: a CustomResourceDefinition", file.display())
                        })?
                    }
                    _ => {}
                }
            }
        }
        let [object] = <[_; 1]>::try_from(policies).map_err(|found| {
            anyhow::anyhow!(
                "{} holds {} ReconcilePolicies, expected one",
                path.display(),
                found.len()
            )
        })?;
        let name = object["metadata"]["name"]
            .as_str()
            .with_context(|| format!("{}: the policy has no metadata.name", path.display()))?;
        let spec: ReconcilePolicySpec = serde_json::from_value(object["spec"].clone())
            .with_context(|| format!("{}: policy {name} has an invalid spec", path.display()))?;
        let spec_limits = spec.limits.clone();
        let policy = OfflinePolicy::new(name, spec, |api_version, kind| {
            kinds.get(api_version, kind).map(|k| k.namespaced)
        })
        .with_context(|| format!("{}: policy {name}", path.display()))?;
        Ok(Self {
            policy,
            spec_limits,
        })
    }

    fn limits(&self) -> Option<&crate::policy::PolicyLimits> {
        self.spec_limits.as_ref()
    }

    /// The request the host would send, from what `args` gives, and what it would leave out.
    fn request(&self, args: &RequestArgs) -> anyhow::Result<(ReconcileRequest, Vec<String>)> {
        let (parent, children, related, config, finalizing) = match &args.case {
            Some(case) => {
                let case = Case::read(case)?;
                (
                    case.parent,
                    case.children,
                    case.related,
                    case.config.map(|c| c.to_string()),
                    case.finalizing,
                )
            }
            None => {
                let parent = args
                    .parent
                    .as_deref()
                    .context("--parent or --case is required")?;
                (
                    input::read_object(parent)?,
                    read_values(&args.children)?,
                    read_values(&args.related)?,
                    read_config(args.config.as_deref())?,
                    args.finalizing,
                )
            }
        };
        let offline = self
            .policy
            .request(&parent, children, related, config, finalizing)?;
        Ok((offline.request, offline.left_out))
    }
}

/// What `plugin diff` prints.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct DiffOutput {
    active_digest: String,
    candidate_digest: String,
    /// `Unchanged`, `WouldChange` or `WouldFail`.
    verdict: &'static str,
    #[serde(skip_serializing_if = "String::is_empty")]
    detail: String,
}

/// `plugin run`'s webhook calls.
#[derive(Debug, clap::Args)]
pub struct WebhookArgs {
    /// Ask the plugin's `validate` whether writing `--parent` is allowed.
    #[arg(long, group = "webhook_call")]
    validate: bool,
    /// Ask the plugin's `default` to fill in `--parent`.
    #[arg(long, group = "webhook_call")]
    default: bool,
    /// Ask the plugin's `convert` to rewrite `--parent` to this `apiVersion`.
    #[arg(long, value_name = "API_VERSION", group = "webhook_call")]
    convert_to: Option<String>,
    /// The object as stored before the write, for `--validate` and `--default`: the write
    /// is an update.
    #[arg(long, value_name = "FILE", requires = "webhook_call")]
    old: Option<PathBuf>,
}

impl WebhookArgs {
    fn asked(&self) -> bool {
        self.validate || self.default || self.convert_to.is_some()
    }

    /// `plugin run` with a webhook flag: the call's answer, printed.
    async fn run(&self, engine: PluginEngine, run: RunArgs, policy: bool) -> anyhow::Result<()> {
        anyhow::ensure!(
            !policy,
            "--policy applies to reconcile; a webhook call takes --config"
        );
        let plugin = load(
            &engine,
            &run.plugin,
            run.digest.as_ref(),
            run.limits.limits(),
        )?;
        print(&self.call(&plugin, &run.request).await?, run.output)
    }

    /// Make the call on the request's parent and config; the answer as cases expect it, or
    /// the call's error (a conversion that does not come back is one too).
    async fn call(
        &self,
        plugin: &Plugin,
        request: &RequestArgs,
    ) -> anyhow::Result<serde_json::Value> {
        let object = |path: &Path| -> anyhow::Result<crate::plugin::JsonObject> {
            match input::read_object(path)? {
                serde_json::Value::Object(map) => Ok(map),
                _ => anyhow::bail!("{} is not an object", path.display()),
            }
        };
        let parent = object(
            request
                .parent
                .as_deref()
                .context("a webhook call takes --parent, not --case")?,
        )?;
        let what = request.source().display().to_string();
        if let Some(to) = &self.convert_to {
            anyhow::ensure!(
                self.old.is_none(),
                "--old applies to --validate and --default"
            );
            let conversion = webhook_cases::Conversion {
                object: parent,
                to: to.clone(),
            };
            let (answer, broken) = webhook_cases::convert(plugin, &conversion)
                .await
                .with_context(|| format!("converting {what} to {to}"))?;
            if let Some(broken) = broken {
                anyhow::bail!("converting {what} to {to}: {broken}");
            }
            return Ok(answer);
        }
        let write = webhook_cases::Write {
            operation: None,
            object: Some(parent),
            old_object: self.old.as_deref().map(object).transpose()?,
            user: None,
            config: request
                .config
                .as_deref()
                .map(input::read_object)
                .transpose()?,
        };
        let request = write.request()?;
        Ok(if self.validate {
            webhook_cases::validate(plugin, request)
                .await
                .with_context(|| format!("validating {what}"))?
        } else {
            webhook_cases::default(plugin, request)
                .await
                .with_context(|| format!("defaulting {what}"))?
        })
    }
}

/// Sandbox limits for one call; the defaults are the host's.
#[derive(Debug, clap::Args)]
pub struct LimitArgs {
    /// Wall-clock deadline for the call, in milliseconds.
    #[arg(long, default_value_t = Limits::default().timeout.as_millis() as u64)]
    timeout_ms: u64,
    /// Memory cap, in MiB.
    #[arg(long, default_value_t = Limits::default().memory_bytes >> 20)]
    memory_mib: usize,
    /// Cap on the total size of the response, in KiB.
    #[arg(long, default_value_t = Limits::default().max_output_bytes >> 10)]
    max_output_kib: usize,
    /// Cap on the number of desired children.
    #[arg(long, default_value_t = Limits::default().max_children)]
    max_children: usize,
    /// Wall-clock deadline for a webhook call (validate, default, convert), in milliseconds.
    #[arg(long, default_value_t = Limits::default().webhook_timeout.as_millis() as u64)]
    webhook_timeout_ms: u64,
}

impl LimitArgs {
    fn limits(&self) -> Limits {
        Limits {
            timeout: Duration::from_millis(self.timeout_ms),
            memory_bytes: self.memory_mib << 20,
            max_output_bytes: self.max_output_kib << 10,
            max_children: self.max_children,
            webhook_timeout: Duration::from_millis(self.webhook_timeout_ms),
        }
    }
}

/// Output formats.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Format {
    /// YAML.
    Yaml,
    /// JSON (pretty-printed).
    Json,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct InspectOutput {
    /// From a registry: the reference pinned by the manifest's digest.
    #[serde(skip_serializing_if = "Option::is_none")]
    reference: Option<String>,
    /// From a registry: the manifest's digest.
    #[serde(skip_serializing_if = "Option::is_none")]
    manifest_digest: Option<String>,
    /// The component's digest (what `spec.plugin.digest` takes).
    digest: String,
    size_bytes: usize,
    /// The contract the plugin was built for.
    contract_version: Option<String>,
    /// The contracts this host serves.
    host_contract_versions: &'static [&'static str],
    /// Whether this host would load it.
    compatible: bool,
    /// Why not, when it would not.
    #[serde(skip_serializing_if = "Option::is_none")]
    refused: Option<String>,
    compile_ms: f64,
    /// The webhooks it serves for its kind (`validate`, `default`, `convert`), as its
    /// `served` export says; empty for a plugin that exports none.
    webhooks: Vec<&'static str>,
    /// Why the webhooks it serves are not known (its `served` call failed, or this host
    /// would refuse it).
    #[serde(skip_serializing_if = "Option::is_none")]
    webhooks_unknown: Option<String>,
    imports: Vec<String>,
    exports: Vec<String>,
    /// The signatures found beside it (not verified: `plugin verify` checks them).
    signatures: Vec<super::plugin_sign::FoundSignature>,
}

impl PluginCommand {
    /// Run the command.
    pub async fn run(self, cache_dir: Option<PathBuf>) -> anyhow::Result<()> {
        match self {
            Self::Run {
                plugin,
                request,
                digest,
                policy,
                crds,
                webhook,
                limits,
                output,
            } => {
                let engine = engine(cache_dir)?;
                let run = RunArgs {
                    plugin,
                    request,
                    digest,
                    limits,
                    output,
                };
                match policy {
                    _ if webhook.asked() => webhook.run(engine, run, policy.is_some()).await,
                    Some(policy) => run_as_host(engine, run, &policy, &crds).await,
                    None => run_plainly(engine, run).await,
                }
            }
            Self::Diff {
                active,
                candidate,
                request,
                candidate_config,
                limits,
                output,
            } => {
                let engine = engine(cache_dir)?;
                let candidate_config = read_config(candidate_config.as_deref())?;
                diff(
                    &engine,
                    &active,
                    &candidate,
                    &request,
                    candidate_config,
                    &limits,
                    output,
                )
                .await
            }
            Self::Replay {
                plugin,
                cases,
                expect,
                against,
                convert_to,
                limits,
                output,
            } => {
                let engine = engine(cache_dir)?;
                let baseline = match against {
                    Some(path) if !expect => {
                        Baseline::Plugin(load(&engine, &path, None, limits.limits())?)
                    }
                    _ => Baseline::Recorded,
                };
                let plugin = load(&engine, &plugin, None, limits.limits())?;
                let report = replay(&plugin, &baseline, &case_files(&cases)?, &convert_to).await?;
                conclude(&report, report.all_unchanged(), output)
            }
            Self::Test {
                plugin,
                cases,
                update,
                limits,
                output,
            } => {
                let engine = engine(cache_dir)?;
                let plugin = load(&engine, &plugin, None, limits.limits())?;
                let report = test(&plugin, &case_files(&cases)?, update).await?;
                conclude(&report, report.failed == 0, output)
            }
            Self::New(args) => {
                print!("{}", super::plugin_new::scaffold(&args)?);
                Ok(())
            }
            Self::Inspect {
                plugin,
                registry,
                output,
            } => print(&inspect(&plugin, &registry).await?, output),
            Self::Push(args) => args.run().await,
            Self::Pull(args) => args.run().await,
            Self::Keygen(args) => args.run(),
            Self::Sign(args) => args.run().await,
            Self::Verify(args) => args.run().await,
        }
    }
}

/// `plugin diff`: both plugins asked the same, their answers compared; an error (exit 1) when
/// the candidate would change or fail.
async fn diff(
    engine: &PluginEngine,
    active: &Path,
    candidate: &Path,
    request: &RequestArgs,
    candidate_config: Option<String>,
    limits: &LimitArgs,
    output: Format,
) -> anyhow::Result<()> {
    let request = request.request()?;
    let candidate_request = ReconcileRequest {
        config: candidate_config.or(request.config.clone()),
        ..request.clone()
    };
    let active = load(engine, active, None, limits.limits())?;
    let candidate = load(engine, candidate, None, limits.limits())?;
    let verdict = crate::plugin::compare(
        &active.reconcile(request).await,
        &candidate.reconcile(candidate_request).await,
    );
    print(
        &DiffOutput {
            active_digest: active.digest().to_string(),
            candidate_digest: candidate.digest().to_string(),
            verdict: verdict.name(),
            detail: verdict.detail().to_owned(),
        },
        output,
    )?;
    // As `diff` and `replay` do: 1 when the two differ, so a CI step can gate on it.
    match verdict {
        Verdict::Unchanged => Ok(()),
        Verdict::WouldChange(_) => {
            Err(CasesDiffer("the candidate would change the answer".to_owned()).into())
        }
        Verdict::WouldFail(_) => Err(CasesDiffer("the candidate would fail".to_owned()).into()),
    }
}

/// Print a report of cases; `wasmctrl` exits 1 unless they all `passed`, with the summary
/// on stderr when the report (JSON, YAML) does not end with it.
fn conclude(report: &impl CasesReport, passed: bool, format: ReplayFormat) -> anyhow::Result<()> {
    print!("{}", report.render(format)?);
    if passed {
        Ok(())
    } else if matches!(format, ReplayFormat::Text) {
        // The text report ends with the summary already: a terminal shows it once.
        Err(CasesDiffer(String::new()).into())
    } else {
        Err(CasesDiffer(report.summary()).into())
    }
}

/// What `replay` and `test` report on a set of cases.
trait CasesReport {
    fn summary(&self) -> String;
    fn render(&self, format: ReplayFormat) -> anyhow::Result<String>;
}

/// The engine for an offline command, compiling through the artifact cache when there is one.
fn engine(cache_dir: Option<PathBuf>) -> anyhow::Result<PluginEngine> {
    PluginEngine::new(EngineOptions {
        cache_dir,
        ..EngineOptions::default()
    })
    .context("starting the plugin engine")
}

/// What `inspect` shows of a file, or of a registry reference (with its manifest).
async fn inspect(
    plugin: &str,
    registry: &super::plugin_oci::RegistryArgs,
) -> anyhow::Result<InspectOutput> {
    let mut found = if super::plugin_oci::is_remote(plugin) {
        let pulled = super::plugin_oci::fetch(plugin, registry).await?;
        let mut found = inspection(&pulled.bytes, plugin)?;
        found.reference = Some(pulled.pinned_reference);
        found.manifest_digest = Some(pulled.manifest_digest);
        found
    } else {
        let bytes =
            std::fs::read(plugin).with_context(|| format!("cannot read plugin {plugin}"))?;
        inspection(&bytes, plugin)?
    };
    let (_, signatures) = super::plugin_sign::signatures_of(plugin, registry).await?;
    found.signatures = super::plugin_sign::summarize(&signatures);
    Ok(found)
}

fn inspection(bytes: &[u8], what: &str) -> anyhow::Result<InspectOutput> {
    // No cache: the point is to show what compiling costs.
    let engine = PluginEngine::new(EngineOptions::default())?;
    let found = engine
        .inspect(bytes)
        .with_context(|| format!("inspecting plugin {what}"))?;
    Ok(InspectOutput {
        reference: None,
        manifest_digest: None,
        digest: found.digest.to_string(),
        size_bytes: found.size_bytes,
        contract_version: found.contract_version,
        host_contract_versions: CONTRACT_VERSIONS,
        compatible: found.refusal.is_none(),
        refused: found.refusal,
        compile_ms: found.compile_time.as_secs_f64() * 1e3,
        webhooks: found
            .webhooks
            .as_ref()
            .map(|served| served.names())
            .unwrap_or_default(),
        webhooks_unknown: found.webhooks.err(),
        imports: found.imports,
        exports: found.exports,
        signatures: Vec::new(),
    })
}

/// Some replayed cases would change or fail: `wasmctrl` exits 1, as `diff` does, saying why
/// on stderr unless the report on stdout already did (an empty message).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct CasesDiffer(String);

/// What a replayed case's answer is compared with.
enum Baseline {
    /// The answer recorded in the case.
    Recorded,
    /// Another plugin's answer to the same case.
    Plugin(Plugin),
}

/// Output formats of `replay`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ReplayFormat {
    /// A line per case, and the differences.
    Text,
    /// YAML.
    Yaml,
    /// JSON (pretty-printed).
    Json,
}

/// One replayed case.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct ReplayedCase {
    case: PathBuf,
    /// `Unchanged`, `WouldChange` or `WouldFail`.
    verdict: &'static str,
    #[serde(skip_serializing_if = "String::is_empty")]
    detail: String,
}

/// Every replayed case.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct ReplayReport {
    cases: Vec<ReplayedCase>,
    unchanged: usize,
    would_change: usize,
    would_fail: usize,
}

impl ReplayReport {
    fn all_unchanged(&self) -> bool {
        self.unchanged == self.cases.len()
    }
}

impl CasesReport for ReplayReport {
    fn summary(&self) -> String {
        format!(
            "{} cases: {} unchanged, {} would change, {} would fail",
            self.cases.len(),
            self.unchanged,
            self.would_change,
            self.would_fail
        )
    }

    fn render(&self, format: ReplayFormat) -> anyhow::Result<String> {
        let rows = self.cases.iter().map(|case| {
            let verdict = match case.verdict {
                "Unchanged" => "unchanged",
                "WouldChange" => "would-change",
                _ => "would-fail",
            };
            (verdict, case.case.as_path(), case.detail.as_str())
        });
        render_cases(self, format, 13, rows, &self.summary())
    }
}

/// A report on cases (`replay`, `test`): `report` itself as YAML or JSON, or as text a line
/// per case (its label padded to `width`, its file, the detail indented below) and the
/// summary.
fn render_cases<'a, R: Serialize>(
    report: &R,
    format: ReplayFormat,
    width: usize,
    rows: impl Iterator<Item = (&'a str, &'a Path, &'a str)>,
    summary: &str,
) -> anyhow::Result<String> {
    Ok(match format {
        ReplayFormat::Yaml => crate::yaml::to_string(report)?,
        ReplayFormat::Json => serde_json::to_string_pretty(report)? + "\n",
        ReplayFormat::Text => {
            let mut out = String::new();
            for (label, case, detail) in rows {
                out.push_str(&format!("{label:<width$} {}\n", case.display()));
                for line in detail.lines() {
                    out.push_str(&format!("    {line}\n"));
                }
            }
            out.push_str(summary);
            out.push('\n');
            out
        }
    })
}

/// Run every case on `plugin` and compare each answer with the `baseline`.
async fn replay(
    plugin: &Plugin,
    baseline: &Baseline,
    cases: &[PathBuf],
    convert_to: &[String],
) -> anyhow::Result<ReplayReport> {
    let mut report = ReplayReport {
        cases: Vec::new(),
        unchanged: 0,
        would_change: 0,
        would_fail: 0,
    };
    for path in cases {
        let case = Case::read(path)?;
        let request = case.request();
        let expected = match baseline {
            Baseline::Recorded => case.expected_answer().with_context(|| {
                format!(
                    "{} has no recorded or expected answer; compare with a plugin instead (--against)",
                    path.display()
                )
            })?,
            Baseline::Plugin(other) => other
                .reconcile(request.clone())
                .await
                .map_err(|e| RecordedError::of(&e)),
        };
        let actual = plugin.reconcile(request).await;
        // The author's own tool: every value is quoted.
        let mut verdict = compare_answers(&expected, &actual, Hide::nothing());
        if let (false, Some(parent)) = (
            matches!(verdict, Verdict::WouldFail(_)),
            case.parent.as_object(),
        ) {
            for to in convert_to {
                if let Err(problem) =
                    crate::admission::conversion::round_trip(plugin, "", parent, to).await
                {
                    verdict = Verdict::WouldFail(problem);
                    break;
                }
            }
        }
        match verdict {
            Verdict::Unchanged => report.unchanged += 1,
            Verdict::WouldChange(_) => report.would_change += 1,
            Verdict::WouldFail(_) => report.would_fail += 1,
        }
        report.cases.push(ReplayedCase {
            case: path.clone(),
            verdict: verdict.name(),
            detail: verdict.detail().to_owned(),
        });
    }
    Ok(report)
}

/// One golden case's result.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct TestedCase {
    case: PathBuf,
    /// `Passed`, `Failed` or `Updated`.
    result: &'static str,
    #[serde(skip_serializing_if = "String::is_empty")]
    detail: String,
}

/// Every golden case's result.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct TestReport {
    cases: Vec<TestedCase>,
    passed: usize,
    failed: usize,
    updated: usize,
}

impl CasesReport for TestReport {
    fn summary(&self) -> String {
        let mut summary = format!(
            "{} cases: {} passed, {} failed",
            self.cases.len(),
            self.passed,
            self.failed
        );
        if self.updated > 0 {
            summary.push_str(&format!(", {} updated", self.updated));
        }
        summary
    }

    fn render(&self, format: ReplayFormat) -> anyhow::Result<String> {
        let rows = self.cases.iter().map(|case| {
            let result = match case.result {
                "Passed" => "ok",
                "Updated" => "updated",
                _ => "FAILED",
            };
            (result, case.case.as_path(), case.detail.as_str())
        });
        render_cases(self, format, 8, rows, &self.summary())
    }
}

/// Run every golden case on `plugin`; with `update`, write the plugin's answer into each case
/// it does not match instead of failing it.
async fn test(plugin: &Plugin, cases: &[PathBuf], update: bool) -> anyhow::Result<TestReport> {
    let mut report = TestReport {
        cases: Vec::new(),
        passed: 0,
        failed: 0,
        updated: 0,
    };
    for path in cases {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read case {}", path.display()))?;
        if webhook_cases::is_webhook_case(&text) {
            let (result, detail) =
                match webhook_cases::run_case(plugin, path, &text, update).await? {
                    CaseResult::Passed => {
                        report.passed += 1;
                        ("Passed", String::new())
                    }
                    CaseResult::Failed(detail) => {
                        report.failed += 1;
                        ("Failed", detail)
                    }
                    CaseResult::Updated(detail) => {
                        report.updated += 1;
                        ("Updated", detail)
                    }
                };
            report.cases.push(TestedCase {
                case: path.clone(),
                result,
                detail,
            });
            continue;
        }
        let mut case = Case::parse(&text, &path.display().to_string())?;
        let actual = plugin.reconcile(case.request()).await;
        let verdict = match case.expected_answer() {
            Some(expected) => compare_answers(&expected, &actual, Hide::nothing()),
            None if update => Verdict::WouldChange("no expected answer yet".to_owned()),
            None => anyhow::bail!(
                "{} has no expected answer (`expect:`); `wasmctrl plugin test PLUGIN CASES --update` writes the plugin's",
                path.display()
            ),
        };
        let (result, detail) = match verdict {
            Verdict::Unchanged => {
                report.passed += 1;
                ("Passed", String::new())
            }
            changed if update => {
                case.expect = Some(Expected::of(&actual));
                write_case(path, &case)?;
                report.updated += 1;
                ("Updated", changed.detail().to_owned())
            }
            failed => {
                report.failed += 1;
                ("Failed", failed.detail().to_owned())
            }
        };
        report.cases.push(TestedCase {
            case: path.clone(),
            result,
            detail,
        });
    }
    Ok(report)
}

/// Write `case` back to `path`, as JSON when the file is JSON.
fn write_case(path: &Path, case: &Case) -> anyhow::Result<()> {
    let text = if path.extension().is_some_and(|e| e == "json") {
        serde_json::to_string_pretty(case)? + "\n"
    } else {
        case.to_yaml()?
    };
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// The case files among `paths`: files as given, directories searched for `.yaml`, `.yml`
/// and `.json` files, in name order.
fn case_files(paths: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    fn walk(dir: &Path, found: &mut Vec<PathBuf>) -> anyhow::Result<()> {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .map(|e| e.map(|e| e.path()))
            .collect::<Result<_, _>>()?;
        entries.sort();
        for path in entries {
            if path.is_dir() {
                walk(&path, found)?;
            } else if path
                .extension()
                .is_some_and(|e| e == "yaml" || e == "yml" || e == "json")
            {
                found.push(path);
            }
        }
        Ok(())
    }
    let mut found = Vec::new();
    for path in paths {
        if path.is_dir() {
            walk(path, &mut found)?;
        } else {
            found.push(path.clone());
        }
    }
    anyhow::ensure!(!found.is_empty(), "no case files found in {paths:?}");
    Ok(found)
}

/// Every object in `paths`, in order.
fn read_values(paths: &[PathBuf]) -> anyhow::Result<Vec<serde_json::Value>> {
    let mut objects = Vec::new();
    for path in paths {
        objects.extend(input::read_objects(path)?);
    }
    Ok(objects)
}

fn read_all(paths: &[PathBuf]) -> anyhow::Result<Vec<ObservedObject>> {
    Ok(read_values(paths)?
        .iter()
        .map(ObservedObject::from_value)
        .collect())
}

fn load(
    engine: &PluginEngine,
    path: &Path,
    digest: Option<&Digest>,
    limits: Limits,
) -> anyhow::Result<Plugin> {
    let bytes =
        std::fs::read(path).with_context(|| format!("cannot read plugin {}", path.display()))?;
    engine
        .load(&bytes, digest, limits)
        .with_context(|| format!("loading plugin {}", path.display()))
}

fn print<T: Serialize>(value: &T, format: Format) -> anyhow::Result<()> {
    let text = match format {
        Format::Yaml => crate::yaml::to_string(value)?,
        Format::Json => serde_json::to_string_pretty(value)? + "\n",
    };
    print!("{text}");
    Ok(())
}
