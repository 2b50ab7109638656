#!/usr/bin/env bash
# Builds the Helm CLI (pinned in go.mod beside this script) that the tests lint and render the
# chart with, into a cache keyed by the Go toolchain and the pins.
# Prints the binary's path on its last line of stdout; progress goes to stderr.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache_root=${WASMCTRL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/wasmctrl}
key=$( (go version; cat "$here/go.mod" "$here/go.sum" "$0") | sha256sum | cut -c1-16)
out="$cache_root/helm/$key"
mkdir -p "$out"
# Tests running side by side may all find the binary missing: the first to take the lock
# builds it, the others wait and then find it built.
exec 9>"$out/.lock"
flock 9
if [ ! -x "$out/helm" ]; then
  start=$SECONDS
  echo "helm: building helm (from tools/helm) ..." >&2
  # As Helm's own Makefile builds a release: the Kubernetes version `helm template` and
  # `helm lint` assume without --kube-version is the one its client-go speaks (v0.37 → 1.37),
  # not the source's fallback 1.20, so a chart's kubeVersion is checked as users' helm does.
  client_go=$(cd "$here" && go list -m -f '{{.Version}}' k8s.io/client-go)
  minor=${client_go#v0.}; minor=${minor%%.*}
  ldflags="-s -w"
  for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
    ldflags="$ldflags -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$minor"
  done
  (cd "$here" && CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$out/helm.tmp" \
    helm.sh/helm/v3/cmd/helm)
  mv "$out/helm.tmp" "$out/helm"
  echo "helm: built in $((SECONDS - start))s" >&2
fi
echo "$out/helm"
