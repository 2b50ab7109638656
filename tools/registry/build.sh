#!/usr/bin/env bash
# Builds the OCI registry (CNCF distribution, pinned in go.mod beside this script) that the
# end-to-end tests push plugins to, into a cache keyed by the Go toolchain and the pins.
# Prints the binary's path on its last line of stdout; progress goes to stderr.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache_root=${WASMCTRL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/wasmctrl}
key=$( (go version; cat "$here/go.mod" "$here/go.sum") | sha256sum | cut -c1-16)
out="$cache_root/registry/$key"
mkdir -p "$out"
# Tests running side by side may all find the binary missing: the first to take the lock
# builds it, the others wait and then find it built.
exec 9>"$out/.lock"
flock 9
if [ ! -x "$out/registry" ]; then
  start=$SECONDS
  echo "registry: building distribution's registry (from tools/registry) ..." >&2
  (cd "$here" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out/registry.tmp" \
    github.com/distribution/distribution/v3/cmd/registry)
  mv "$out/registry.tmp" "$out/registry"
  echo "registry: built in $((SECONDS - start))s" >&2
fi
echo "$out/registry"
