//! The `wasmctrl` command line. `main.rs` parses and wires; each subcommand lives in its own
//! module.

pub mod call_memory;
mod explain_cmd;
mod input;
mod kinds;
mod locate;
mod plugin_cmd;
mod plugin_new;
mod plugin_oci;
mod plugin_sign;
mod rbac_cmd;
mod rollout_cmd;
mod run_cmd;
mod uninstall_cmd;

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::{CommandFactory as _, FromArgMatches as _, Parser, Subcommand};

pub use explain_cmd::ExplainCommand;
pub use plugin_cmd::{CasesDiffer, PluginCommand, RunOutput};
pub use rbac_cmd::RbacCommand;
pub use rollout_cmd::{PruneCommand, RolloutCommand};
pub use run_cmd::RunCommand;
pub use uninstall_cmd::UninstallCommand;

/// wasmctrl: a Kubernetes operator host whose reconcile logic runs in sandboxed Wasm plugins.
#[derive(Debug, Parser)]
#[command(name = "wasmctrl", version, about)]
pub struct Cli {
    /// Where precompiled plugins are cached.
    #[arg(long, global = true, env = "WASMCTRL_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
    /// How log lines are written: `text` (coloured only on a terminal) or `json` (one
    /// object per line, for a cluster's log pipeline).
    #[arg(
        long,
        global = true,
        env = "WASMCTRL_LOG_FORMAT",
        value_enum,
        default_value_t
    )]
    pub log_format: crate::telemetry::LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Top-level commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Work with plugins offline: evaluate a reconcile, inspect a component.
    #[command(subcommand)]
    Plugin(PluginCommand),
    /// Run the operator host: turn every ReconcilePolicy in the cluster into a controller.
    Run(Box<RunCommand>),
    /// Print the Roles, ClusterRole and bindings that exactly the given policies need.
    Rbac(RbacCommand),
    /// Show why a parent looks the way it does: its last reconciles, as the host recorded them.
    Explain(ExplainCommand),
    /// Operate a policy's rollout: status, promote, pause, resume, abort, retry.
    #[command(subcommand)]
    Rollout(RolloutCommand),
    /// Answer a policy's prune guard: confirm the deletions it holds.
    #[command(subcommand)]
    Prune(PruneCommand),
    /// Release every finalizer wasmctrl holds and delete the policies, once the hosts are gone.
    Uninstall(UninstallCommand),
    /// Print this wasmctrl's version and the plugin contract versions it serves.
    Version,
    /// Print a shell completion script, e.g. `source <(wasmctrl completion bash)`.
    Completion {
        /// The shell to complete for.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

/// What `wasmctrl version` prints.
#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct VersionOutput {
    wasmctrl: &'static str,
    /// Plugins built for these contracts load; any other is refused at load.
    plugin_contracts: Vec<String>,
}

/// The file name under which kubectl finds this binary as a plugin: with a link
/// `kubectl-wasmctrl` on `PATH`, `kubectl wasmctrl …` runs it.
pub const KUBECTL_PLUGIN_FILE: &str = "kubectl-wasmctrl";

impl Cli {
    /// Parse this process's command line, exiting with clap's message on an error or for
    /// `--help`.
    pub fn parse_invoked() -> Self {
        Self::parse_invoked_from(std::env::args_os())
    }

    /// Parse `args`, the first being how the program was invoked. Run as
    /// [`KUBECTL_PLUGIN_FILE`] (by kubectl, or by hand), help, usage and errors name the
    /// command as the user typed it, `kubectl wasmctrl`; the commands are the same.
    pub fn parse_invoked_from(args: impl IntoIterator<Item = impl Into<OsString>>) -> Self {
        let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
        let mut command = Self::command();
        if args.first().is_some_and(is_kubectl_plugin) {
            command = command.bin_name("kubectl wasmctrl");
        }
        let matches = command.get_matches_from(args);
        Self::from_arg_matches(&matches).unwrap_or_else(|error| error.exit())
    }

    /// Run the parsed command.
    pub async fn run(self) -> anyhow::Result<()> {
        crate::ensure_crypto_provider();
        let cache_dir = self.cache_dir.or_else(default_cache_dir);
        match self.command {
            Command::Plugin(command) => command.run(cache_dir).await,
            Command::Run(command) => command.run(cache_dir).await,
            Command::Rbac(command) => command.run().await,
            Command::Explain(command) => command.run().await,
            Command::Rollout(command) => command.run().await,
            Command::Prune(command) => command.run().await,
            Command::Uninstall(command) => command.run().await,
            Command::Completion { shell } => {
                clap_complete::generate(
                    shell,
                    &mut Cli::command(),
                    "wasmctrl",
                    &mut std::io::stdout(),
                );
                Ok(())
            }
            Command::Version => {
                print!(
                    "{}",
                    crate::yaml::to_string(&VersionOutput {
                        wasmctrl: env!("CARGO_PKG_VERSION"),
                        plugin_contracts: crate::plugin::CONTRACT_VERSIONS
                            .iter()
                            .map(|v| format!("wasmctrl:plugin@{v}"))
                            .collect(),
                    })?
                );
                Ok(())
            }
        }
    }
}

/// Whether `argv0` names the kubectl plugin (`kubectl-wasmctrl`, `.exe` or not), wherever
/// the link lives.
fn is_kubectl_plugin(argv0: &OsString) -> bool {
    Path::new(argv0)
        .file_stem()
        .is_some_and(|stem| stem == KUBECTL_PLUGIN_FILE)
}

/// `$XDG_CACHE_HOME/wasmctrl/artifacts`, else `~/.cache/wasmctrl/artifacts`.
fn default_cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))?;
    Some(base.join("wasmctrl").join("artifacts"))
}
