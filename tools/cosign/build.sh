#!/usr/bin/env bash
# Builds cosign (pinned in go.mod beside this script), which the end-to-end tests run to
# check that cosign and wasmctrl accept each other's signatures, into a cache keyed by the
# Go toolchain and the pins.
# Prints the binary's path on its last line of stdout; progress goes to stderr.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache_root=${WASMCTRL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/wasmctrl}
key=$( (go version; cat "$here/go.mod" "$here/go.sum") | sha256sum | cut -c1-16)
out="$cache_root/cosign/$key"
mkdir -p "$out"
# Tests running side by side may all find the binary missing: the first to take the lock
# builds it, the others wait and then find it built.
exec 9>"$out/.lock"
flock 9
if [ ! -x "$out/cosign" ]; then
  start=$SECONDS
  echo "cosign: building cosign (from tools/cosign; a few minutes, once) ..." >&2
  (cd "$here" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out/cosign.tmp" \
    github.com/sigstore/cosign/v2/cmd/cosign)
  mv "$out/cosign.tmp" "$out/cosign"
  echo "cosign: built in $((SECONDS - start))s" >&2
fi
echo "$out/cosign"
