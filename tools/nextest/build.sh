#!/usr/bin/env bash
# Installs cargo-nextest, the test runner `cargo xtask test` runs the suite with (a process
# per test and a time limit per test), at the version pinned here, from crates.io with its
# own lock file, into a cache keyed by the Rust toolchain and this script.
# Prints the binary's path on its last line of stdout; progress goes to stderr.
set -euo pipefail
version=0.9.151
cache_root=${WASMCTRL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/wasmctrl}
key=$( (rustc --version; cat "$0") | sha256sum | cut -c1-16)
out="$cache_root/nextest/$key"
mkdir -p "$out"
exec 9>"$out/.lock"
flock 9
if [ ! -x "$out/bin/cargo-nextest" ]; then
  start=$SECONDS
  echo "nextest: installing cargo-nextest $version (about 5 minutes, once per machine) ..." >&2
  # A target directory of its own: the workspace's build must not wait on it, nor it on
  # the workspace's lock.
  CARGO_TARGET_DIR="$out/build" cargo install --quiet --locked --version "$version" \
    --root "$out" cargo-nextest >&2
  rm -rf "$out/build"
  echo "nextest: installed in $((SECONDS - start))s" >&2
fi
echo "$out/bin/cargo-nextest"
