//! `wasmctrl plugin run | diff | inspect`: the plugin runtime without a cluster.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::{Subcommand, ValueEnum};
use serde::Serialize;

use super::input;
use crate::plugin::{
    CONTRACT_VERSION, Digest, EngineOptions, JsonObject, Limits, ObservedObject, Plugin,
    PluginEngine, PluginEvent, ReconcileRequest, ReconcileResponse, Verdict,
};

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
        /// The sandbox's limits.
        #[command(flatten)]
        limits: LimitArgs,
        /// Output format.
        #[arg(short, long, value_enum, default_value_t = Format::Yaml)]
        output: Format,
    },
    /// Show what a candidate plugin would do differently from the active one for one parent:
    /// the comparison a shadow run makes for every parent in the cluster.
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
    /// Show a plugin's digest, size, contract version, imports, exports and compile time.
    Inspect {
        /// The plugin component (.wasm).
        plugin: PathBuf,
        /// Output format.
        #[arg(short, long, value_enum, default_value_t = Format::Yaml)]
        output: Format,
    },
}

/// What the plugin is asked: the parent and what the cluster holds for it.
#[derive(Debug, clap::Args)]
pub struct RequestArgs {
    /// The parent object (YAML or JSON).
    #[arg(long)]
    parent: PathBuf,
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
    fn request(&self) -> anyhow::Result<ReconcileRequest> {
        Ok(ReconcileRequest {
            parent: input::read_object(&self.parent)?.to_string(),
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
}

impl LimitArgs {
    fn limits(&self) -> Limits {
        Limits {
            timeout: Duration::from_millis(self.timeout_ms),
            memory_bytes: self.memory_mib << 20,
            max_output_bytes: self.max_output_kib << 10,
            max_children: self.max_children,
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

/// What `plugin run` prints: the plugin's decision.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RunOutput {
    /// Desired children.
    pub children: Vec<JsonObject>,
    /// Desired parent status.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<JsonObject>,
    /// Requested requeue delay in milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requeue_after_ms: Option<u64>,
    /// Events to record.
    pub events: Vec<PluginEvent>,
    /// Clean-up complete.
    pub finalized: bool,
}

impl From<ReconcileResponse> for RunOutput {
    fn from(r: ReconcileResponse) -> Self {
        Self {
            children: r.children,
            status: r.status,
            requeue_after_ms: r
                .requeue_after
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            events: r.events,
            finalized: r.finalized,
        }
    }
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct InspectOutput {
    digest: String,
    size_bytes: Option<usize>,
    contract_version: Option<String>,
    host_contract_version: &'static str,
    compatible: bool,
    compile_ms: f64,
    imports: Vec<String>,
    exports: Vec<String>,
}

impl PluginCommand {
    /// Run the command.
    pub async fn run(self, cache_dir: Option<PathBuf>) -> anyhow::Result<()> {
        match self {
            Self::Run {
                plugin,
                request,
                digest,
                limits,
                output,
            } => {
                let parent = request.parent.clone();
                let request = request.request()?;
                let engine = PluginEngine::new(EngineOptions {
                    cache_dir,
                    ..EngineOptions::default()
                })?;
                let plugin = load(&engine, &plugin, digest.as_ref(), limits.limits())?;
                let response = plugin
                    .reconcile(request)
                    .await
                    .with_context(|| format!("reconciling {}", parent.display()))?;
                print(&RunOutput::from(response), output)
            }
            Self::Diff {
                active,
                candidate,
                request,
                candidate_config,
                limits,
                output,
            } => {
                let request = request.request()?;
                let candidate_request = ReconcileRequest {
                    config: read_config(candidate_config.as_deref())?.or(request.config.clone()),
                    ..request.clone()
                };
                let engine = PluginEngine::new(EngineOptions {
                    cache_dir,
                    ..EngineOptions::default()
                })?;
                let active = load(&engine, &active, None, limits.limits())?;
                let candidate = load(&engine, &candidate, None, limits.limits())?;
                let verdict = crate::plugin::compare(
                    &active.reconcile(request).await,
                    &candidate.reconcile(candidate_request).await,
                );
                let (verdict, detail) = match verdict {
                    Verdict::Unchanged => ("Unchanged", String::new()),
                    Verdict::WouldChange(detail) => ("WouldChange", detail),
                    Verdict::WouldFail(detail) => ("WouldFail", detail),
                };
                print(
                    &DiffOutput {
                        active_digest: active.digest().to_string(),
                        candidate_digest: candidate.digest().to_string(),
                        verdict,
                        detail,
                    },
                    output,
                )
            }
            Self::Inspect { plugin, output } => {
                // No cache: the point is to show what compiling costs.
                let engine = PluginEngine::new(EngineOptions::default())?;
                let started = Instant::now();
                let loaded = load(&engine, &plugin, None, Limits::default())?;
                let compile = started.elapsed();
                let info = loaded.info();
                print(
                    &InspectOutput {
                        digest: info.digest.to_string(),
                        size_bytes: info.size_bytes,
                        contract_version: info.contract_version.clone(),
                        host_contract_version: CONTRACT_VERSION,
                        compatible: info.contract_version.as_deref() == Some(CONTRACT_VERSION),
                        compile_ms: compile.as_secs_f64() * 1e3,
                        imports: info.imports.clone(),
                        exports: info.exports.clone(),
                    },
                    output,
                )
            }
        }
    }
}

fn read_all(paths: &[PathBuf]) -> anyhow::Result<Vec<ObservedObject>> {
    let mut objects = Vec::new();
    for path in paths {
        objects.extend(
            input::read_objects(path)?
                .iter()
                .map(ObservedObject::from_value),
        );
    }
    Ok(objects)
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
        Format::Yaml => serde_yaml_ng::to_string(value)?,
        Format::Json => serde_json::to_string_pretty(value)? + "\n",
    };
    print!("{text}");
    Ok(())
}
