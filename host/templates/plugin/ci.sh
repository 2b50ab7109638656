#!/usr/bin/env bash
# What this plugin's CI runs: native tests (logic and the CRD), the component build, and the
# golden cases against the built component. Needs the wasm32-wasip2 target (`rustup target add
# wasm32-wasip2`) and the `wasmctrl` CLI: on PATH, or named by WASMCTRL.
set -euo pipefail
cd "$(dirname "$0")"
wasmctrl=${WASMCTRL:-wasmctrl}
# Checked first: a missing CLI should not cost a full build before it is noticed.
if ! command -v "$wasmctrl" >/dev/null 2>&1; then
    cat >&2 <<'MISSING'
ci.sh: the wasmctrl CLI was not found (not on PATH, or WASMCTRL names no program); it runs
the golden cases in cases/. This crate was made by wasmctrl {{wasmctrl_version}}. Install it:
    cargo install --locked --git https://github.com/wasmctrl/wasmctrl wasmctrl
or, from a checkout of wasmctrl:
    cargo install --locked --path host
or take the prebuilt x86_64 Linux binary of a release:
    cargo binstall --git https://github.com/wasmctrl/wasmctrl wasmctrl
or name a wasmctrl binary for this run:
    WASMCTRL=/path/to/wasmctrl ./ci.sh
MISSING
    exit 127
fi
cargo test
cargo build --target wasm32-wasip2 --profile plugin
target_dir=$(cargo metadata --format-version 1 --no-deps |
    sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
"$wasmctrl" plugin test "$target_dir/wasm32-wasip2/plugin/{{crate}}.wasm" cases/
