#!/usr/bin/env bash
# Builds the local control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# kubectl, kwok) from the pinned Go modules beside this script, into a cache directory that
# survives between runs and is keyed by the pins: a build happens only when a pin changes.
#
# Prints the directory holding the binaries on its last line of stdout; progress goes to stderr.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache_root=${WASMCTRL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/wasmctrl}
# The key covers what decides the binaries: the Go toolchain and the pins.
key=$( (go version; cat "$here"/*/go.mod "$here"/*/go.sum) | sha256sum | cut -c1-16)
out="$cache_root/cluster/$key"
bins=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok)

complete() {
  for b in "${bins[@]}"; do [ -x "$out/bin/$b" ] || return 1; done
  [ -s "$out/bin/kwok-stages.yaml" ]
}
if complete; then echo "$out/bin"; exit 0; fi

mkdir -p "$out/bin"
# Callers running side by side may all find the binaries missing: the first to take the lock
# builds them, the others wait and then find them built.
exec 9>"$out/.lock"
flock 9
if complete; then echo "$out/bin"; exit 0; fi
k8s_version=$(sed -n 's/^require k8s.io\/kubernetes \(v[0-9.]*\)$/\1/p' "$here/kubernetes/go.mod")
major=${k8s_version#v}; major=${major%%.*}
minor=${k8s_version#v*.}; minor=${minor%%.*}
ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$k8s_version \
 -X k8s.io/component-base/version.gitMajor=$major -X k8s.io/component-base/version.gitMinor=$minor \
 -X k8s.io/component-base/version.gitTreeState=clean \
 -X k8s.io/client-go/pkg/version.gitVersion=$k8s_version"

# What is missing, in build order: module, package, binary.
todo=()
[ -x "$out/bin/etcd" ] || todo+=("etcd go.etcd.io/etcd/server/v3 etcd")
for c in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
  [ -x "$out/bin/$c" ] || todo+=("kubernetes k8s.io/kubernetes/cmd/$c $c")
done
[ -x "$out/bin/kwok" ] || todo+=("kwok sigs.k8s.io/kwok/cmd/kwok kwok")

# Each step says what it builds and, when done, how long it took: the whole takes about 15
# minutes on 2 cores (kube-apiserver alone about half), once per machine.
if [ ${#todo[@]} -gt 0 ]; then
  echo "cluster: building the control plane from the Go modules pinned in tools/cluster, once per" >&2
  echo "cluster: machine, into $out/bin: ${#todo[@]} of ${#bins[@]} binaries (all of them take about 15 min on 2 cores)" >&2
fi
started=$SECONDS
step=0
for item in "${todo[@]}"; do
  read -r module package binary <<<"$item"
  step=$((step + 1))
  start=$SECONDS
  echo "cluster: [$step/${#todo[@]}] building $binary (from tools/cluster/$module) ..." >&2
  (cd "$here/$module" && CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$out/bin/$binary.tmp" "$package")
  mv "$out/bin/$binary.tmp" "$out/bin/$binary"
  echo "cluster: [$step/${#todo[@]}] built $binary in $((SECONDS - start))s ($((SECONDS - started))s so far)" >&2
done

# kwok needs "stages" saying how simulated nodes and pods progress: take the fast ones shipped
# in the pinned kwok module (nodes Ready at once with heartbeats, pods Running/Ready at once).
if [ ! -s "$out/bin/kwok-stages.yaml" ]; then
  stages=$(cd "$here/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)/kustomize/stage
  for f in "$stages"/node/fast/node-initialize.yaml "$stages"/node/heartbeat/node-heartbeat.yaml \
           "$stages"/pod/fast/pod-ready.yaml "$stages"/pod/fast/pod-complete.yaml "$stages"/pod/fast/pod-delete.yaml; do
    echo "---"; cat "$f"
  done > "$out/bin/kwok-stages.yaml.tmp"
  mv "$out/bin/kwok-stages.yaml.tmp" "$out/bin/kwok-stages.yaml"
fi
echo "$out/bin"
