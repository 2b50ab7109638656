#!/usr/bin/env bash
# Installs the pinned cargo-zigbuild and Zig (requirements.txt beside this script) from PyPI
# into a virtual environment in the cache, keyed by the pins: installed once per machine and
# pin. `cargo xtask release` builds the linux/arm64 host with them (Zig is the C compiler and
# linker for aarch64-unknown-linux-musl: ring, zstd and aws-lc compile C).
#
# Prints the path of the venv's bin directory (cargo-zigbuild, and python -m ziglang) on its
# last line of stdout; progress goes to stderr.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache_root=${WASMCTRL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/wasmctrl}
key=$(cat "$here/requirements.txt" | sha256sum | cut -c1-16)
out="$cache_root/cargo-zigbuild/$key"
# `installed` is written last, so an interrupted install is redone, not used.
if [ -e "$out/installed" ]; then echo "$out/venv/bin"; exit 0; fi

mkdir -p "$out"
exec 9>"$out/.lock"
flock 9
if [ -e "$out/installed" ]; then echo "$out/venv/bin"; exit 0; fi
if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "cargo-zigbuild: installing python3 and python3-venv (apt-get) ..." >&2
    apt-get update -qq >&2 && apt-get install -y -qq python3 python3-venv >&2
  else
    echo "cargo-zigbuild: python3 with venv is required (apt-get install python3 python3-venv)" >&2
    exit 1
  fi
fi
echo "cargo-zigbuild: installing into $out/venv ..." >&2
rm -rf "$out/venv"
python3 -m venv "$out/venv" >&2
"$out/venv/bin/pip" install --quiet --require-hashes --only-binary :all: -r "$here/requirements.txt" >&2
touch "$out/installed"
echo "$out/venv/bin"
