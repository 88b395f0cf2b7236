#!/usr/bin/env bash
# Build the real node's images without a registry and import them into its containerd
# (hack/realnode/node.sh prepare must have started it):
#
#   hack/realnode/build-images.sh pause base operator worker   # any subset, in this order
#
#   pause     registry.k8s.io/pause:3.10: build/pause/linux/pause.c of the Kubernetes module the
#             control plane is built from, `gcc -static`, on an empty image
#   base      adaptis.local/python:3.11-bookworm: `debootstrap --variant=minbase` Debian bookworm
#             with Debian's python3 (3.11), python3-venv and ca-certificates; the PYTHON_IMAGE
#             the Dockerfile is built from here (a user with a registry uses the Dockerfile's
#             default, python:3.11.13-slim-bookworm)
#   operator  adaptis/operator:<chart appVersion>  } the Dockerfile's own targets, run by buildah
#   worker    adaptis/worker:<chart appVersion>    } (`buildah bud`, Debian's package)
#
# Each image is cached by a digest of its inputs (the stamp ${CACHE}/<name>.stamp): pause by
# pause.c and the compiler, base by the suite and package list, operator and worker by the
# Dockerfile, every file of the build context .dockerignore admits and the base's digest.  A
# matching stamp with the image in containerd costs nothing; with the image only in buildah's
# storage it is imported again.  buildah keeps its layers (`--layers`), so a change to adaptis/
# re-runs only the Dockerfile's steps after `COPY adaptis/`.
#
# Builds run under `nice`.  The build's RUN steps see the host's CA bundle and pip.conf
# read-only (-v), so pip reaches the package index the way the host does; nothing of them is
# left in the image.  Caches: ${ADAPTIS_REALNODE_HOME:-~/.cache/adaptis-k8s/realnode}/images
# (buildah's storage, stamps, the base rootfs), outside the repository.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
RN_HOME="${ADAPTIS_REALNODE_HOME:-${HOME}/.cache/adaptis-k8s/realnode}"
CACHE="${RN_HOME}/images"
NODE="${REPO_ROOT}/hack/realnode/node.sh"
BUILDAH=(buildah --root "${CACHE}/buildah/root" --runroot "${CACHE}/buildah/runroot" --storage-driver overlay)
DEBIAN_MIRROR="${ADAPTIS_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
BASE_PACKAGES=python3,python3-venv,ca-certificates
PAUSE_IMAGE=registry.k8s.io/pause:3.10
BASE_IMAGE=adaptis.local/python:3.11-bookworm
APP_VERSION="$(awk '$1 == "appVersion:" {gsub(/"/, "", $2); print $2}' "${REPO_ROOT}/charts/adaptis/Chart.yaml")"

log() { printf '[realnode images %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
mkdir -p "${CACHE}"
exec 8>"${CACHE}/.lock"
flock 8

# cri_ref IMAGE: the name the kubelet asks containerd for (Docker's normalization: a name
# without a registry host is docker.io's), e.g. adaptis/operator:0.1.0 -> docker.io/adaptis/...
cri_ref() {
  local first="${1%%/*}"
  if [[ "$1" == */* && ( "${first}" == *.* || "${first}" == *:* || "${first}" == localhost ) ]]; then
    echo "$1"
  else
    [[ "$1" == */* ]] && echo "docker.io/$1" || echo "docker.io/library/$1"
  fi
}
# (not `ctr | grep -q`: grep's early exit would fail the pipeline with SIGPIPE)
in_containerd() { grep -qx "$(cri_ref "$1")" <<<"$(bash "${NODE}" ctr images ls -q 2>/dev/null)"; }
in_buildah() { "${BUILDAH[@]}" images --quiet "$1" >/dev/null 2>&1; }
fresh() { [[ -f "${CACHE}/$1.stamp" && "$(cat "${CACHE}/$1.stamp")" == "$2" ]]; }

# image_id IMAGE: its ID, empty when buildah has none (buildah exits 125 then: under pipefail
# that would end the script on a cold cache, where no image exists yet)
image_id() { { "${BUILDAH[@]}" images --no-trunc --format '{{.ID}}' "$1" 2>/dev/null || true; } | head -1 | sed 's/^sha256://'; }

# import NAME IMAGE: buildah's copy of IMAGE into containerd (namespace k8s.io), through an
# archive; the image it replaces goes, with the ID reference the kubelet's CRI adds
# (sha256:<config>), so that containerd's garbage collector frees its layers.
import_image() {
  local name="$1" image="$2" ref archive start=${SECONDS} old
  ref="$(cri_ref "${image}")"
  old="$(cat "${CACHE}/${name}.imported" 2>/dev/null || true)"
  archive="$(mktemp -p "${CACHE}" import.XXXXXX.tar)"
  rm -f "${archive}"
  "${BUILDAH[@]}" push --quiet "${image}" "oci-archive:${archive}:${ref}" >/dev/null
  bash "${NODE}" ctr images rm "${ref}" >/dev/null 2>&1 || true
  if [[ -n "${old}" ]]; then bash "${NODE}" ctr images rm "sha256:${old}" >/dev/null 2>&1 || true; fi
  bash "${NODE}" ctr images import "${archive}" >/dev/null
  rm -f "${archive}"
  in_containerd "${image}" || die "${image} is not in containerd after the import"
  image_id "${image}" > "${CACHE}/${name}.imported"
  log "${image}: imported into containerd in $(( SECONDS - start ))s"
}

# ensure NAME IMAGE STAMP BUILD_FUNCTION: build when the stamp differs; import when containerd
# lacks this very build (${CACHE}/NAME.imported holds the ID last imported).
ensure() {
  local name="$1" image="$2" stamp="$3" build="$4" start=${SECONDS} old
  if fresh "${name}" "${stamp}" && in_buildah "${image}"; then
    log "${image}: up to date (${stamp})"
  else
    old="$(image_id "${image}")"
    log "${image}: building ..."
    "${build}"
    echo "${stamp}" > "${CACHE}/${name}.stamp"
    log "${image}: built in $(( SECONDS - start ))s, $("${BUILDAH[@]}" images --format '{{.Size}}' "${image}" | head -1)"
    # the build it replaces (its layers stay while a newer build's cache uses them)
    if [[ -n "${old}" && "${old}" != "$(image_id "${image}")" ]]; then
      "${BUILDAH[@]}" rmi "${old}" >/dev/null 2>&1 || true
    fi
  fi
  if ! in_containerd "${image}" \
      || [[ "$(cat "${CACHE}/${name}.imported" 2>/dev/null)" != "$(image_id "${image}")" ]]; then
    import_image "${name}" "${image}"
  fi
}

digest() { sha256sum | cut -c1-16; }

# ---------------------------------------------------------------- pause

pause_c() {
  local moddir
  moddir="$(cd "${REPO_ROOT}/hack/controlplane/kubernetes" && go list -m -f '{{.Dir}}' k8s.io/kubernetes)"
  echo "${moddir}/build/pause/linux/pause.c"
}
build_pause() {
  local work="${CACHE}/pause" ctr
  rm -rf "${work}" && mkdir -p "${work}"
  gcc -Os -static -DVERSION=v3.10-adaptis -o "${work}/pause" "$(pause_c)"
  strip "${work}/pause"
  ctr="$("${BUILDAH[@]}" from scratch)"
  "${BUILDAH[@]}" copy "${ctr}" "${work}/pause" /pause >/dev/null
  "${BUILDAH[@]}" config --entrypoint '["/pause"]' --user 65535:65535 "${ctr}"
  "${BUILDAH[@]}" commit --quiet --rm "${ctr}" "${PAUSE_IMAGE}" >/dev/null
}

# ---------------------------------------------------------------- base

build_base() {
  local rootfs="${CACHE}/base-rootfs" ctr
  rm -rf "${rootfs}" "${rootfs}.tar"
  nice -n 10 debootstrap --variant=minbase --include="${BASE_PACKAGES}" bookworm "${rootfs}" "${DEBIAN_MIRROR}" \
    > "${CACHE}/debootstrap.log" 2>&1 || die "debootstrap failed: $(tail -20 "${CACHE}/debootstrap.log")"
  rm -rf "${rootfs}"/var/cache/apt/archives/*.deb "${rootfs}"/var/lib/apt/lists/* "${rootfs}"/var/log/*.log
  tar -C "${rootfs}" --numeric-owner -cf "${rootfs}.tar" .
  ctr="$("${BUILDAH[@]}" from scratch)"
  "${BUILDAH[@]}" add "${ctr}" "${rootfs}.tar" / >/dev/null   # a local tar is extracted as is
  "${BUILDAH[@]}" config --env LANG=C.UTF-8 --cmd '["python3"]' "${ctr}"
  "${BUILDAH[@]}" commit --quiet --rm "${ctr}" "${BASE_IMAGE}" >/dev/null
  rm -rf "${rootfs}" "${rootfs}.tar"
}

# ---------------------------------------------------------------- Dockerfile targets

# The build context: exactly the files .dockerignore admits (its `!` lines), as docker sends.
context_digest() {
  local admitted
  admitted="$(sed -n 's/^!//p' "${REPO_ROOT}/.dockerignore")"
  {
    cat "${REPO_ROOT}/Dockerfile" "${REPO_ROOT}/.dockerignore"
    (cd "${REPO_ROOT}" && find ${admitted} -type f ! -name '*.pyc' ! -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha256sum)
    "${BUILDAH[@]}" images --no-trunc --format '{{.ID}}' "${BASE_IMAGE}"
  } | digest
}

build_target() {
  local target="$1"
  nice -n 10 "${BUILDAH[@]}" bud --layers --pull-never --isolation chroot --network host \
    -v /etc/ssl/certs:/etc/ssl/certs:ro -v /etc/pip.conf:/etc/pip.conf:ro \
    --build-arg "PYTHON_IMAGE=${BASE_IMAGE}" --build-arg "SOURCE_DIGEST=$(context_digest)" \
    --target "${target}" \
    -t "adaptis/${target}:${APP_VERSION}" -f "${REPO_ROOT}/Dockerfile" "${REPO_ROOT}" \
    > "${CACHE}/${target}-build.log" 2>&1 || die "buildah bud --target ${target} failed: $(tail -30 "${CACHE}/${target}-build.log")"
}
build_operator() { build_target operator; }
build_worker() { build_target worker; }

for name in "$@"; do
  case "${name}" in
    pause) ensure pause "${PAUSE_IMAGE}" "$( (cat "$(pause_c)"; gcc --version | head -1) | digest)" build_pause ;;
    base) ensure base "${BASE_IMAGE}" "$(echo "bookworm minbase ${BASE_PACKAGES} v1" | digest)" build_base ;;
    operator|worker)
      in_buildah "${BASE_IMAGE}" || die "build the base image first (build-images.sh base ${name})"
      ensure "${name}" "adaptis/${name}:${APP_VERSION}" "$(context_digest)" "build_${name}" ;;
    *) die "unknown image ${name} (pause, base, operator, worker)" ;;
  esac
done
