#!/usr/bin/env bash
# Install the Debian packages a real node needs (tests/integration/realnode.py, hack/README.md):
# containerd and runc (the container runtime), containernetworking-plugins (bridge, host-local,
# portmap, loopback), iptables and conntrack (kube-proxy), debootstrap (the local base image),
# buildah (executes the Dockerfile itself; images never leave the machine) and gcc (the pause
# binary, built from the Kubernetes module's build/pause/linux/pause.c).
#
# Idempotent: installs only what is missing (about a second when all is there). apt does not
# start containerd on these machines (systemd is not PID 1); hack/realnode/node.sh runs it with
# its own configuration.
set -euo pipefail
PACKAGES=(containerd runc containernetworking-plugins iptables conntrack debootstrap buildah gcc libc6-dev)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if (( ${#missing[@]} == 0 )); then
  echo "[realnode packages] all installed: ${PACKAGES[*]}" >&2
  exit 0
fi
SUDO=""
[[ "$(id -u)" == "0" ]] || SUDO="sudo"
start=${SECONDS}
echo "[realnode packages] installing ${missing[*]} ..." >&2
export DEBIAN_FRONTEND=noninteractive
${SUDO} apt-get update -q >&2
${SUDO} apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
# Debian's package may start nothing here, but where systemd runs it starts containerd with the
# distribution's config; the node runs its own containerd with its own root and socket instead.
echo "[realnode packages] installed in $(( SECONDS - start ))s" >&2
