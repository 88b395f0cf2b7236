#!/usr/bin/env bash
# Build the binaries of the integration-test control plane from Go modules.
#
# Builds etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kwok, helm and
# the Kueue manager from the consumer modules under hack/controlplane/ into
#   ${ADAPTIS_K8S_CACHE:-$HOME/.cache/adaptis-k8s}/<k8s-version>/bin
# (Kueue's CRDs and webhook configurations, from the same module's source, go to
# bin/kueue-config/)
# and installs Debian's `prometheus` package (prometheus, promtool) when prometheus is missing.
#
# Idempotent: a binary whose stamp (tool version + go.sum digest + Go version) matches is skipped,
# so a warm run takes about a second.  Go's own caches (GOCACHE, GOMODCACHE) stay at their
# defaults outside the repository.
#
# Usage:
#   hack/build-control-plane.sh                # build what is missing, print the bin dir last
#   hack/build-control-plane.sh --print-bin-dir  # only print the bin dir (builds nothing)
#   hack/build-control-plane.sh --real-node    # also kubelet, kube-proxy and CoreDNS (the
#                                              # real-node tier, hack/realnode/)
#
# Environment:
#   ADAPTIS_K8S_CACHE        cache root (default: $HOME/.cache/adaptis-k8s)
#   ADAPTIS_BUILD_JOBS       go build -p (default 2, at most 2 is advised on 2-core machines)
#   ADAPTIS_SKIP_PROMETHEUS  set to 1 to skip the prometheus package check
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODS="${REPO_ROOT}/hack/controlplane"

# modver DIR MODULE: the version of MODULE required by DIR/go.mod (no network, no go command).
modver() {
  awk -v m="$2" '
    $1 == m && $2 ~ /^v/ { print $2; exit }
    $1 == "require" && $2 == m { print $3; exit }
  ' "$1/go.mod"
}

K8S_VERSION="$(modver "${MODS}/kubernetes" k8s.io/kubernetes)"
[[ -n "${K8S_VERSION}" ]] || { echo "cannot read the k8s.io/kubernetes version from ${MODS}/kubernetes/go.mod" >&2; exit 1; }
CACHE_ROOT="${ADAPTIS_K8S_CACHE:-${HOME}/.cache/adaptis-k8s}"
BIN_DIR="${CACHE_ROOT}/${K8S_VERSION}/bin"

REAL_NODE=0
case "${1:-}" in
  --print-bin-dir) echo "${BIN_DIR}"; exit 0 ;;
  --real-node) REAL_NODE=1 ;;
  "") ;;
  *) echo "usage: $0 [--print-bin-dir | --real-node]" >&2; exit 2 ;;
esac

ETCD_VERSION="$(modver "${MODS}/etcd" go.etcd.io/etcd/server/v3)"
KWOK_VERSION="$(modver "${MODS}/kwok" sigs.k8s.io/kwok)"
HELM_VERSION="$(modver "${MODS}/helm" helm.sh/helm/v3)"
HELM_CLIENT_GO="$(modver "${MODS}/helm" k8s.io/client-go)"   # v0.<minor>.<patch>
KUEUE_VERSION="$(modver "${MODS}/kueue" sigs.k8s.io/kueue)"
COREDNS_VERSION="$(modver "${MODS}/coredns" github.com/coredns/coredns)"

JOBS="${ADAPTIS_BUILD_JOBS:-2}"
GO_VERSION="$(go env GOVERSION)"
export CGO_ENABLED=0

mkdir -p "${BIN_DIR}"
# Concurrent runs (two test sessions, pytest-xdist workers) wait for each other instead of
# compiling the same packages twice; the second then finds everything up to date.
exec 9>"${BIN_DIR}/.lock"
if ! flock -n 9; then
  echo "[build-control-plane] another build holds ${BIN_DIR}/.lock; waiting for it ..."
  flock 9
fi
log() { printf '[build-control-plane %(%H:%M:%S)T] %s\n' -1 "$*"; }

GO_BUILD_FLAGS=(-trimpath)

# stamp_value NAME VERSION MODDIR LDFLAGS: what a built binary's stamp must contain to be
# reused: the tool version, the Go version and a digest of go.mod, go.sum and the build flags.
stamp_value() {
  local recipe
  recipe="$(cat "$3/go.mod" "$3/go.sum"; echo "CGO_ENABLED=${CGO_ENABLED} ${GO_BUILD_FLAGS[*]} $4")"
  echo "$1 $2 ${GO_VERSION} recipe:$(sha256sum <<<"${recipe}" | cut -c1-16)"
}

# is_current NAME VERSION MODDIR LDFLAGS: the binary exists and was built from the same inputs.
is_current() {
  local stamp="${BIN_DIR}/.$1.stamp"
  [[ -x "${BIN_DIR}/$1" && -f "${stamp}" \
    && "$(cat "${stamp}")" == "$(stamp_value "$1" "$2" "$3" "$4")" ]]
}

# build_group GROUP VERSION LDFLAGS NAME=PACKAGE...: one `go build` for all missing binaries of
# a module, so their shared packages are compiled once and linking overlaps compiling.
build_group() {
  local group="$1" version="$2" ldflags="$3"
  shift 3
  local moddir="${MODS}/${group}" names=() pkgs=() entry name pkg
  for entry in "$@"; do
    name="${entry%%=*}"
    pkg="${entry#*=}"
    if is_current "${name}" "${version}" "${moddir}" "${ldflags}"; then
      log "${name} ${version}: up to date, skipped"
    else
      names+=("${name}")
      pkgs+=("${pkg}")
    fi
  done
  (( ${#names[@]} > 0 )) || return 0

  log "building ${names[*]} (${group} ${version}) with -p ${JOBS} ..."
  local start=${SECONDS} tmp
  tmp="$(mktemp -d "${BIN_DIR}/.build.XXXXXX")"
  if ! (cd "${moddir}" && nice -n 10 go build -p "${JOBS}" "${GO_BUILD_FLAGS[@]}" -ldflags "-s -w ${ldflags}" -o "${tmp}/" "${pkgs[@]}"); then
    rm -rf "${tmp}"
    log "FAILED to build ${names[*]}"
    return 1
  fi
  for name in "${names[@]}"; do
    mv -f "${tmp}/${name}" "${BIN_DIR}/${name}"
    stamp_value "${name}" "${version}" "${moddir}" "${ldflags}" > "${BIN_DIR}/.${name}.stamp"
    log "  ${name}: $(du -h "${BIN_DIR}/${name}" | cut -f1)"
  done
  rm -rf "${tmp}"
  log "built ${names[*]} in $(( SECONDS - start ))s"
}

total_start=${SECONDS}
log "Go ${GO_VERSION}; cache ${BIN_DIR}"

k8s_minor="${K8S_VERSION#v1.}"
k8s_minor="${k8s_minor%%.*}"
k8s_ldflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ldflags+=" -X ${pkg}.gitVersion=${K8S_VERSION} -X ${pkg}.gitMajor=1 -X ${pkg}.gitMinor=${k8s_minor}"
  k8s_ldflags+=" -X ${pkg}.gitTreeState=clean"
done

build_group etcd "${ETCD_VERSION}" "" \
  etcd=adaptis.local/hack/controlplane/etcd

k8s_binaries=(
  kube-apiserver=k8s.io/kubernetes/cmd/kube-apiserver
  kube-controller-manager=k8s.io/kubernetes/cmd/kube-controller-manager
  kube-scheduler=k8s.io/kubernetes/cmd/kube-scheduler
  kubectl=k8s.io/kubernetes/cmd/kubectl
)
# The real node's kubelet and kube-proxy come from the same module and the same `go build`
# (their packages are mostly the control plane's, compiled once).
if (( REAL_NODE )); then k8s_binaries+=(
  kubelet=k8s.io/kubernetes/cmd/kubelet
  kube-proxy=k8s.io/kubernetes/cmd/kube-proxy
); fi
build_group kubernetes "${K8S_VERSION}" "${k8s_ldflags}" "${k8s_binaries[@]}"

build_group kwok "${KWOK_VERSION}" "" \
  kwok=sigs.k8s.io/kwok/cmd/kwok

helm_k8s_minor="${HELM_CLIENT_GO#v0.}"
helm_k8s_minor="${helm_k8s_minor%%.*}"
helm_ldflags="-X helm.sh/helm/v3/internal/version.version=${HELM_VERSION} -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
  helm_ldflags+=" -X ${pkg}.k8sVersionMajor=1 -X ${pkg}.k8sVersionMinor=${helm_k8s_minor}"
done
build_group helm "${HELM_VERSION}" "${helm_ldflags}" \
  helm=helm.sh/helm/v3/cmd/helm

kueue_ldflags="-X sigs.k8s.io/kueue/pkg/version.GitVersion=${KUEUE_VERSION}"
build_group kueue "${KUEUE_VERSION}" "${kueue_ldflags}" \
  kueue=sigs.k8s.io/kueue/cmd/kueue

# CoreDNS with only the plugins the real node's Corefile uses (hack/controlplane/coredns/main.go).
if (( REAL_NODE )); then
  build_group coredns "${COREDNS_VERSION}" "" \
    coredns=adaptis.local/hack/controlplane/coredns
fi

# Kueue's CRDs and webhook configurations come from the source of the very module version the
# manager was built from (the module zip carries config/components/), so binary and manifests
# never drift apart.  They are copied next to the binary, into bin/kueue-config/ (crd/*.yaml,
# webhook/manifests.yaml), with a stamp like the binaries', so the tests need no Go command.
kueue_config="${BIN_DIR}/kueue-config"
kueue_config_stamp="$(stamp_value kueue-config "${KUEUE_VERSION}" "${MODS}/kueue" "")"
if [[ -f "${kueue_config}/.stamp" && "$(cat "${kueue_config}/.stamp")" == "${kueue_config_stamp}" ]]; then
  log "kueue-config ${KUEUE_VERSION}: up to date, skipped"
else
  (cd "${MODS}/kueue" && go mod download sigs.k8s.io/kueue)
  kueue_src="$(cd "${MODS}/kueue" && go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)"
  [[ -d "${kueue_src}/config/components/crd/bases" ]] \
    || { log "no config/components/crd/bases in the Kueue module (${kueue_src})"; exit 1; }
  rm -rf "${kueue_config}"
  mkdir -p "${kueue_config}/crd" "${kueue_config}/webhook"
  cp "${kueue_src}"/config/components/crd/bases/*.yaml "${kueue_config}/crd/"
  cp "${kueue_src}/config/components/webhook/manifests.yaml" "${kueue_config}/webhook/"
  chmod -R u+w "${kueue_config}"   # the module cache is read-only; a later rm -rf must work
  echo "${kueue_config_stamp}" > "${kueue_config}/.stamp"
  log "kueue-config ${KUEUE_VERSION}: $(ls "${kueue_config}"/crd/*.yaml | wc -l) CRDs and the webhooks from ${kueue_src}"
fi

if [[ "${ADAPTIS_SKIP_PROMETHEUS:-0}" != "1" ]]; then
  if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
    log "prometheus: $(command -v prometheus), already installed"
  else
    start=${SECONDS}
    log "installing Debian package prometheus ..."
    SUDO=""
    [[ "$(id -u)" == "0" ]] || SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    ${SUDO} apt-get update -q
    ${SUDO} apt-get install -y -q --no-install-recommends prometheus
    log "installed prometheus in $(( SECONDS - start ))s"
  fi
fi

log "done in $(( SECONDS - total_start ))s"
echo "${BIN_DIR}"
