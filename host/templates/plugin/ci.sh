#!/usr/bin/env bash
# What this plugin's CI runs: native tests (logic and the CRD), the component build, and the
# golden cases against the built component. Needs `wasmctrl` on PATH and the wasm32-wasip2
# target (`rustup target add wasm32-wasip2`).
set -euo pipefail
cd "$(dirname "$0")"
cargo test
cargo build --target wasm32-wasip2 --profile plugin
target_dir=$(cargo metadata --format-version 1 --no-deps |
    sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
wasmctrl plugin test "$target_dir/wasm32-wasip2/plugin/{{crate}}.wasm" cases/
