#!/usr/bin/env bash
# Builds the local control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# kubectl, kwok) from the pinned Go modules beside this script, into a cache directory that
# survives between runs and is keyed by the pins: a build happens only when a pin changes.
#
# Prints the directory holding the binaries on its last line of stdout; progress goes to stderr.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache_root=${WASMCTRL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/wasmctrl}
key=$( (go version; cat "$here"/*/go.mod "$here"/*/go.sum "$here/build.sh") | sha256sum | cut -c1-16)
out="$cache_root/cluster/$key"
bins=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok)

complete() { for b in "${bins[@]}"; do [ -x "$out/bin/$b" ] || return 1; done; }
if complete; then echo "$out/bin"; exit 0; fi

mkdir -p "$out/bin"
k8s_version=$(sed -n 's/^require k8s.io\/kubernetes \(v[0-9.]*\)$/\1/p' "$here/kubernetes/go.mod")
major=${k8s_version#v}; major=${major%%.*}
minor=${k8s_version#v*.}; minor=${minor%%.*}
ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$k8s_version \
 -X k8s.io/component-base/version.gitMajor=$major -X k8s.io/component-base/version.gitMinor=$minor \
 -X k8s.io/component-base/version.gitTreeState=clean \
 -X k8s.io/client-go/pkg/version.gitVersion=$k8s_version"

build() { # module package binary
  local start=$SECONDS
  echo "cluster: building $3 (from tools/cluster/$1) ..." >&2
  (cd "$here/$1" && CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$out/bin/$3.tmp" "$2")
  mv "$out/bin/$3.tmp" "$out/bin/$3"
  echo "cluster: built $3 in $((SECONDS - start))s" >&2
}

[ -x "$out/bin/etcd" ] || build etcd go.etcd.io/etcd/server/v3 etcd
for c in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
  [ -x "$out/bin/$c" ] || build kubernetes "k8s.io/kubernetes/cmd/$c" "$c"
done
[ -x "$out/bin/kwok" ] || build kwok sigs.k8s.io/kwok/cmd/kwok kwok
echo "$out/bin"
