//! Developer automation: `cargo xtask <command>`. Every command installs what it needs
//! (the wasm32-wasip2 target, the control plane binaries) before it runs.

mod check_macos;
mod cluster_cmd;
mod dist;
mod release;
mod tasks;
mod up;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "wasmctrl developer tasks")]
struct Xtask {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start everything: the control plane, CRDs, the MyApp policy and sample MyApps, and
    /// the host in the foreground. Ctrl-C tears it down.
    Up,
    /// Install the wasm32-wasip2 target if it is missing.
    Setup,
    /// Build plugin components (target/wasm32-wasip2/plugin/*.wasm): every one, or only the
    /// Rust plugin crates named (no Python toolchain needed then).
    BuildPlugins {
        /// Plugin crates to build, e.g. `myapp-plugin myapp-v2-plugin`; none: all of them,
        /// the Python plugins too.
        plugins: Vec<String>,
    },
    /// Regenerate the CRD YAML in crds/ from the Rust types.
    Crds,
    /// Regenerate docs/reference/ (the CLI and policy field references).
    Reference,
    /// Regenerate deploy/manifests/ (and the chart's CRD copy) from the Helm chart.
    Manifests,
    /// Manage the local control plane.
    Cluster {
        #[command(subcommand)]
        command: cluster_cmd::ClusterCommand,
    },
    /// Build the host's OCI image (static binary, no base image, non-root) as an OCI layout in
    /// target/image, and push it when asked.
    Image {
        /// Push to this reference, e.g. `ghcr.io/acme/wasmctrl:1.0` or, with `--insecure`,
        /// `127.0.0.1:5000/wasmctrl:dev`, with the credentials `docker login` stored for the
        /// registry (`$DOCKER_CONFIG` or `~/.docker/config.json`, credential helpers too).
        #[arg(long)]
        push: Option<String>,
        /// Push over plain HTTP.
        #[arg(long)]
        insecure: bool,
        /// Cargo profile of the binary (the e2e suite sets `image-test`, which builds
        /// faster).
        #[arg(long, env = "WASMCTRL_IMAGE_PROFILE", default_value = "release")]
        profile: String,
    },
    /// Build the release archive of the `wasmctrl` CLI: the image's static binary (release
    /// profile) as dist/wasmctrl-<version>-x86_64-unknown-linux-musl.tar.gz, with a .sha256.
    Dist,
    /// Publish a release to a registry, signed: the host image (an index of linux/amd64 and
    /// linux/arm64 images), the Helm chart (`oci://REGISTRY/charts/wasmctrl`), the MyApp
    /// plugin, and the CLI archives with SHA256SUMS in the output directory.
    Release(release::ReleaseArgs),
    /// Type-check the host and the runtime for macOS (aarch64-apple-darwin): the Rust code
    /// only, the C of dependencies stubbed out.
    CheckMacos,
    /// Run the whole test suite: formatting, lints, unit, plugin and end-to-end tests.
    Test,
    /// Run the benchmarks and print their tables for BENCHMARKS.md.
    Bench {
        /// Which: `plugin` (call latency), `convergence` (N MyApps against a fresh control
        /// plane; sizes from WASMCTRL_BENCH_SIZES, default 1000,5000), `profile` (the host's
        /// CPU by reconcile stage during a convergence, default 1000), or `all` (plugin and
        /// convergence).
        #[arg(default_value = "all")]
        which: tasks::BenchSet,
    },
}

fn main() -> anyhow::Result<()> {
    match Xtask::parse().command {
        Command::Up => up::up(),
        Command::Setup => tasks::setup(),
        Command::BuildPlugins { plugins } if plugins.is_empty() => tasks::build_plugins(),
        Command::BuildPlugins { plugins } => tasks::build_named_plugins(&plugins),
        Command::Crds => tasks::crds(),
        Command::Reference => tasks::reference(),
        Command::Manifests => tasks::manifests(),
        Command::Cluster { command } => cluster_cmd::run(command),
        Command::Dist => dist::dist(),
        Command::Release(args) => release::release(&args),
        Command::CheckMacos => check_macos::check_macos(),
        Command::Test => tasks::test(),
        Command::Image {
            push,
            insecure,
            profile,
        } => tasks::image(&profile, push.as_deref(), insecure),
        Command::Bench { which } => tasks::bench(which),
    }
}
