//! Compiling a plugin in this process: the engine settings compiled code depends on, and a
//! throwaway engine that compiles with them.

use wasmtime::{Config, Engine};

use crate::error::LoadError;

/// What compiled code depends on: the settings an artifact must have been compiled with for
/// this host to run it. The engine that runs plugins adds how instances are allocated, which
/// compiled code does not depend on, so a plain engine of these settings can compile for it.
pub(crate) fn compile_config() -> Config {
    let mut config = Config::new();
    config.wasm_component_model(true).epoch_interruption(true);
    config
}

/// Compile on a throwaway engine of the host's compilation settings, on one thread.
///
/// wasmtime's compiler keeps its per-thread working state (register allocator arenas, code
/// buffers: ~10 MiB for a 600 KB component) for as long as its engine lives; a host compiles
/// rarely and runs for weeks, so that state goes with the engine when the compile ends. One
/// thread: a compile on each core would hold one set of that state per core, for work that is
/// rare and off the reconcile path.
pub(super) fn compile_here(bytes: &[u8]) -> Result<Vec<u8>, LoadError> {
    let mut config = compile_config();
    config.parallel_compilation(false);
    let compiler = Engine::new(&config)
        .map_err(|e| LoadError::Sandbox(format!("starting the plugin compiler: {e:#}")))?;
    compiler
        .precompile_component(bytes)
        .map_err(|e| LoadError::InvalidComponent(format!("{e:#}")))
}
