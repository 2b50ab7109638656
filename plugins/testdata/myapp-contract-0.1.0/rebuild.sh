#!/usr/bin/env bash
# Rebuild myapp-contract-0.1.0.wasm from the commit its source is at (see README.md).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(git -C "$here" rev-parse --show-toplevel)
commit=78569eedf6f1d8d0f18ed6fee21cfa4d332d2f19
work=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$work/src" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git -C "$root" worktree add --detach "$work/src" "$commit" >/dev/null
(cd "$work/src" && CARGO_TARGET_DIR="$work/target" cargo build --quiet --target wasm32-wasip2 --profile plugin -p myapp-plugin)
cp "$work/target/wasm32-wasip2/plugin/myapp_plugin.wasm" "$here/myapp-contract-0.1.0.wasm"
sha256sum "$here/myapp-contract-0.1.0.wasm"
