//! The `wasmctrl` command line. `main.rs` parses and wires; each subcommand lives in its own
//! module.

pub mod call_memory;
mod explain_cmd;
mod input;
mod kinds;
mod locate;
mod migrate_cmd;
mod output;
mod plugin_cmd;
mod plugin_new;
mod plugin_oci;
mod plugin_sign;
mod probe_cmd;
mod rbac_cmd;
mod replicas;
mod rollout_cmd;
mod run_cmd;
mod uninstall_cmd;
mod webhook_args;
mod webhook_cases;

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::{CommandFactory as _, FromArgMatches as _, Parser, Subcommand};

pub use explain_cmd::ExplainCommand;
pub use migrate_cmd::{MigrateCommand, Migrated};
pub use plugin_cmd::{CasesDiffer, PluginCommand, RunOutput};
pub use probe_cmd::ProbeCommand;
pub use rbac_cmd::RbacCommand;
pub use rollout_cmd::{PruneCommand, RolloutCommand};
pub use run_cmd::RunCommand;
pub use uninstall_cmd::UninstallCommand;

/// wasmctrl: a Kubernetes operator host whose reconcile logic runs in sandboxed Wasm plugins.
#[derive(Debug, Parser)]
#[command(name = "wasmctrl", version, about, after_help = EXIT_STATUS)]
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

/// The exit-status convention every command keeps, shown under the top-level help.
const EXIT_STATUS: &str = "Exit status: 0 when the command did what it was asked (for a comparison: \
the answers are the same), 1 when a comparison found a difference (`plugin diff`, `plugin replay`, \
`plugin test`), 2 on an error (bad arguments included).\n\n\
`-o` names the output format wherever a command has one, and nothing else: a file to write \
is named by a long flag of its own (`--output-file`, `--output-signature`, `--save`).";

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
    /// Rewrite a custom resource's stored objects at its storage version, so an older API
    /// version can be retired.
    Migrate(MigrateCommand),
    /// Release every finalizer wasmctrl holds and delete the policies, once the hosts are gone.
    Uninstall(UninstallCommand),
    /// Ask a host's /healthz or /readyz as the kubelet does, from an image without a shell;
    /// exits 0 when it answers 2xx (the chart's `helm test`).
    Probe(ProbeCommand),
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
    /// The webhooks a plugin may serve for its kind (from contract 0.1.1); `wasmctrl plugin
    /// inspect` shows which a given plugin serves.
    plugin_webhooks: [&'static str; 3],
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
            Command::Migrate(command) => command.run().await,
            Command::Uninstall(command) => command.run().await,
            Command::Probe(command) => command.run().await,
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
                        plugin_webhooks: ["validate", "default", "convert"],
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every command, with the path of names that reaches it.
    fn commands(command: &clap::Command, path: String, all: &mut Vec<(String, clap::Command)>) {
        for sub in command.get_subcommands() {
            let path = format!("{path} {}", sub.get_name());
            commands(sub, path.clone(), all);
            all.push((path, sub.clone()));
        }
    }

    #[test]
    fn dash_o_is_the_output_format_everywhere_and_files_are_output_flags() {
        let mut all = Vec::new();
        commands(&Cli::command(), "wasmctrl".to_owned(), &mut all);
        assert!(all.len() > 20, "the tree was walked: {}", all.len());
        for (path, command) in &all {
            for arg in command.get_arguments() {
                let long = arg.get_long().unwrap_or_default();
                if arg.get_short() == Some('o') || long == "output" {
                    assert_eq!(long, "output", "{path}: -o is --output");
                    assert_eq!(arg.get_short(), Some('o'), "{path}: --output is -o");
                    assert!(
                        !arg.get_possible_values().is_empty(),
                        "{path}: -o names a format, one of a fixed set"
                    );
                }
                if long.starts_with("output-") {
                    assert!(
                        arg.get_possible_values().is_empty(),
                        "{path}: --{long} names a file, not a format"
                    );
                }
            }
        }
    }

    #[test]
    fn the_top_level_help_states_the_exit_statuses() {
        let help = Cli::command().render_long_help().to_string();
        for said in ["0 when", "1 when", "2 on an error"] {
            assert!(help.contains(said), "{said:?} in:\n{help}");
        }
    }
}
