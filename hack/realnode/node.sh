#!/usr/bin/env bash
# One real Kubernetes node on this machine, joined to the test control plane: containerd (its
# own root, state and socket), the kubelet, kube-proxy and CoreDNS as host processes, pods on
# a bridge of their own.  Used by tests/integration/realnode.py; see hack/README.md
# ("A real node") for the recipe and the decisions.
#
#   hack/realnode/node.sh prepare          # clean up leftovers, make the bridge, start containerd
#   hack/realnode/node.sh start CONFIG_DIR # start kubelet, kube-proxy and CoreDNS (see below)
#   hack/realnode/node.sh stop             # stop everything and undo every host change
#   hack/realnode/node.sh ctr ARGS...      # ctr against the node's containerd (namespace k8s.io)
#
# Addresses (documentation blocks only; nothing is routed or masqueraded off the machine):
#   node IP 198.51.100.1 on bridge adaptis0 (the pods' gateway); pods 198.51.100.0/25;
#   Services 198.51.100.128/25 (the apiserver's range); cluster DNS 198.51.100.138.
#   Pod traffic that would leave through another interface is dropped (chain ADAPTIS-REALNODE).
#
# CONFIG_DIR holds what the control plane issued for this node: ca.crt, kubelet.kubeconfig
# (CN system:node:<name>, group system:nodes), kubelet-serving.crt/.key (the node IP),
# kube-proxy.kubeconfig, coredns.kubeconfig, and node-name (one line).
#
# Host changes and how they are undone (`stop`, also run first by `prepare`, so a crashed run's
# leftovers go too): sysctls the kubelet, kube-proxy and the bridge plugin set are restored
# from a baseline taken before the first change (kept until restored); processes are signalled
# only after their /proc/PID/cmdline is checked to be ours (pid_max is small, PIDs wrap);
# containers are killed through containerd, the bridge, the kubelet's mounts, the pods'
# network namespaces, the KUBE-* and ADAPTIS-REALNODE iptables chains and the kubepods cgroups
# are removed.  Only one node runs per machine: `prepare` takes ${RN_HOME}/node.lock for the
# caller's lifetime when RN_LOCK_FD is set (tests/integration/realnode.py holds it).
#
# Environment: ADAPTIS_REALNODE_HOME (default ~/.cache/adaptis-k8s/realnode: containerd's
# root with the imported images, the baseline; the run state is ${RN_HOME}/run),
# RN_BIN_DIR (kubelet, kube-proxy, coredns; default: hack/build-control-plane.sh --print-bin-dir).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
RN_HOME="${ADAPTIS_REALNODE_HOME:-${HOME}/.cache/adaptis-k8s/realnode}"
RUN="${RN_HOME}/run"
LOGS="${RUN}/logs"
PIDS="${RUN}/pids"
CTRD_ROOT="${RN_HOME}/containerd"
CTRD_STATE="${RUN}/containerd-state"
SOCK="${RUN}/containerd.sock"
BASELINE="${RN_HOME}/baseline.sysctl"

BRIDGE=adaptis0
NODE_IP=198.51.100.1
POD_CIDR=198.51.100.0/25
SERVICE_CIDR=198.51.100.128/25
CLUSTER_DNS=198.51.100.138
KUBELET_PORT=${RN_KUBELET_PORT:-30250}
KUBELET_HEALTHZ_PORT=${RN_KUBELET_HEALTHZ_PORT:-30248}
PROXY_METRICS_PORT=${RN_PROXY_METRICS_PORT:-30249}
PROXY_HEALTHZ_PORT=${RN_PROXY_HEALTHZ_PORT:-30256}
DNS_PORT=${RN_DNS_PORT:-30053}
DNS_HEALTH_PORT=${RN_DNS_HEALTH_PORT:-30054}
DNS_READY_PORT=${RN_DNS_READY_PORT:-30055}
PAUSE_IMAGE=registry.k8s.io/pause:3.10
GUARD_CHAIN=ADAPTIS-REALNODE
# The sysctls that the kubelet (kernel.panic*, vm.overcommit_memory), the bridge plugin
# (ip_forward) and kube-proxy (route_localnet, bridge-nf-call-iptables) may change.
SYSCTLS=(kernel.panic kernel.panic_on_oops vm.overcommit_memory net.ipv4.ip_forward
  net.ipv4.conf.all.route_localnet net.bridge.bridge-nf-call-iptables)

log() { printf '[realnode %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
bin_dir() {
  if [[ -n "${RN_BIN_DIR:-}" ]]; then echo "${RN_BIN_DIR}"; else bash "${REPO_ROOT}/hack/build-control-plane.sh" --print-bin-dir; fi
}
ctr_() { ctr --address "${SOCK}" --namespace k8s.io "$@"; }

# wait_for SECONDS WHAT COMMAND...: poll COMMAND until it succeeds, or fail with WHAT.
wait_for() {
  local deadline=$(( SECONDS + $1 )) what="$2"
  shift 2
  until "$@" >/dev/null 2>&1; do
    (( SECONDS < deadline )) || return 1
    sleep 0.3
  done
  log "${what}: ready"
}

# ---------------------------------------------------------------- processes

# ours PID: the process is one this script started (its command line names our run dir or
# socket), so a recycled PID is never signalled.
ours() {
  local pid="$1" cmdline
  [[ -r "/proc/${pid}/cmdline" ]] || return 1
  cmdline="$(tr '\0' ' ' < "/proc/${pid}/cmdline")"
  [[ "${cmdline}" == *"${RUN}"* ]]
}

# launch NAME BINARY ARGS...: run a daemon in the background with its log and PID file.
launch() {
  local name="$1"
  shift
  mkdir -p "${LOGS}" "${PIDS}"
  echo "\$ $*" >> "${LOGS}/${name}.log"
  "$@" >> "${LOGS}/${name}.log" 2>&1 < /dev/null &
  echo $! > "${PIDS}/${name}.pid"
  log "${name}: pid $! (log ${LOGS}/${name}.log)"
}

# kill_named NAME: SIGTERM the daemon of PID file NAME (if it is ours), SIGKILL after 10 s.
kill_named() {
  local file="${PIDS}/$1.pid" pid i
  [[ -f "${file}" ]] || return 0
  pid="$(cat "${file}")"
  if ours "${pid}"; then
    kill -TERM "${pid}" 2>/dev/null || true
    for i in $(seq 1 50); do ours "${pid}" || break; sleep 0.2; done
    if ours "${pid}"; then log "$1 (pid ${pid}) ignored SIGTERM; SIGKILL"; kill -KILL "${pid}" 2>/dev/null || true; fi
  fi
  rm -f "${file}"
}

# kill_strays: any process left whose command line names our run dir (a crashed run's daemons
# whose PID files are gone, containerd's shims), checked one by one.
kill_strays() {
  local pid
  for pid in $(pgrep -f -- "${RUN}" || true); do
    [[ "${pid}" == "$$" || "${pid}" == "${BASHPID}" ]] && continue
    if ours "${pid}"; then
      log "stray process ${pid}: $(tr '\0' ' ' < "/proc/${pid}/cmdline" | cut -c1-120)"
      kill -KILL "${pid}" 2>/dev/null || true
    fi
  done
}

# ---------------------------------------------------------------- host state

save_baseline() {
  [[ -f "${BASELINE}" ]] && return 0   # a crashed run's baseline: still the original values
  local key
  mkdir -p "${RN_HOME}"
  for key in "${SYSCTLS[@]}"; do
    [[ -e "/proc/sys/${key//.//}" ]] && echo "${key}=$(cat "/proc/sys/${key//.//}")"
  done > "${BASELINE}.tmp"
  mv "${BASELINE}.tmp" "${BASELINE}"
}

restore_baseline() {
  [[ -f "${BASELINE}" ]] || return 0
  local line
  while IFS= read -r line; do
    [[ -n "${line}" ]] && sysctl -q -w "${line}" >/dev/null 2>&1 || true
  done < "${BASELINE}"
  rm -f "${BASELINE}"
}

remove_iptables() {
  local ipt table chain
  for ipt in iptables ip6tables; do
    command -v "${ipt}" >/dev/null || continue
    "${ipt}" -w -D FORWARD -j "${GUARD_CHAIN}" 2>/dev/null || true
    "${ipt}" -w -F "${GUARD_CHAIN}" 2>/dev/null && "${ipt}" -w -X "${GUARD_CHAIN}" 2>/dev/null || true
    for table in filter nat mangle; do
      # jumps into KUBE-* chains first, then the chains themselves (kube-proxy --cleanup does
      # most of it; the kubelet's canary and hint chains are left to us)
      { "${ipt}" -w -t "${table}" -S 2>/dev/null || true; } | { grep -E '^-A [A-Z]+ .*-j KUBE-' || true; } \
        | { grep -vE '^-A KUBE-' || true; } | sed 's/^-A/-D/' \
        | while read -r rule; do eval "${ipt} -w -t ${table} ${rule}" 2>/dev/null || true; done
      for chain in $("${ipt}" -w -t "${table}" -S 2>/dev/null | awk '$1 == "-N" && $2 ~ /^KUBE-/ {print $2}'); do
        "${ipt}" -w -t "${table}" -F "${chain}" 2>/dev/null || true
      done
      for chain in $("${ipt}" -w -t "${table}" -S 2>/dev/null | awk '$1 == "-N" && $2 ~ /^KUBE-/ {print $2}'); do
        "${ipt}" -w -t "${table}" -X "${chain}" 2>/dev/null || true
      done
    done
  done
}

unmount_under() {
  local dir="$1" target
  [[ -d "${dir}" ]] || return 0
  # deepest first
  for target in $(awk -v d="${dir}" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r); do
    umount -l "${target}" 2>/dev/null || true
  done
}

remove_cgroups() {
  local root
  for root in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/unified/kubepods /sys/fs/cgroup/*/k8s.io; do
    [[ -d "${root}" ]] || continue
    find "${root}" -depth -type d -exec rmdir {} \; 2>/dev/null || true
  done
}

kill_containers() {
  [[ -S "${SOCK}" ]] || return 0
  ctr_ version >/dev/null 2>&1 || return 0
  local id
  for id in $(ctr_ tasks ls -q 2>/dev/null || true); do
    ctr_ tasks kill -a -s SIGKILL "${id}" >/dev/null 2>&1 || true
  done
  for id in $(ctr_ tasks ls -q 2>/dev/null || true); do
    ctr_ tasks delete -f "${id}" >/dev/null 2>&1 || true
  done
  for id in $(ctr_ containers ls -q 2>/dev/null || true); do
    ctr_ containers delete "${id}" >/dev/null 2>&1 || true
  done
}

# ---------------------------------------------------------------- commands

cmd_stop() {
  local name ns
  for name in coredns kube-proxy kubelet; do kill_named "${name}"; done
  if [[ -x "$(bin_dir)/kube-proxy" ]] && [[ -f "${RUN}/kube-proxy.yaml" ]]; then
    "$(bin_dir)/kube-proxy" --cleanup --config "${RUN}/kube-proxy.yaml" >> "${LOGS}/kube-proxy-cleanup.log" 2>&1 || true
  fi
  kill_containers
  kill_named containerd
  kill_strays
  # the pods' network namespaces (containerd names them cni-<uuid>; nothing else here uses CNI)
  for ns in /run/netns/cni-*; do
    [[ -e "${ns}" ]] || continue
    umount "${ns}" 2>/dev/null || true
    rm -f "${ns}"
  done
  unmount_under "${RUN}"
  unmount_under "${CTRD_ROOT}"
  ip link delete "${BRIDGE}" 2>/dev/null || true
  remove_iptables
  remove_cgroups
  restore_baseline
  if [[ -d "${RUN}" ]]; then
    rm -rf "${RUN}.last" && mv "${RUN}" "${RUN}.last"   # keep the last run's logs
  fi
  log "stopped; host state restored"
}

cmd_prepare() {
  [[ "$(id -u)" == 0 ]] || die "a node needs root (cgroups, network namespaces, iptables)"
  local p
  for p in containerd runc ctr iptables /usr/lib/cni/bridge /usr/lib/cni/host-local; do
    command -v "${p}" >/dev/null || [[ -x "${p}" ]] || die "${p} is missing: run hack/realnode/install-packages.sh"
  done
  cmd_stop
  save_baseline
  mkdir -p "${RUN}" "${LOGS}" "${PIDS}" "${CTRD_ROOT}" "${CTRD_STATE}" "${RUN}/cni/net.d"

  # The bridge exists before the control plane starts: the apiserver listens on the node IP.
  ip link add "${BRIDGE}" type bridge
  ip addr add "${NODE_IP}/25" dev "${BRIDGE}"
  ip link set "${BRIDGE}" up
  # Nothing from the pods leaves the machine: forwarded traffic in or out of the bridge through
  # another interface is dropped (pod-to-pod and pod-to-host traffic is not forwarded there).
  iptables -w -N "${GUARD_CHAIN}"
  iptables -w -A "${GUARD_CHAIN}" -i "${BRIDGE}" ! -o "${BRIDGE}" -j DROP
  iptables -w -A "${GUARD_CHAIN}" -o "${BRIDGE}" ! -i "${BRIDGE}" -j DROP
  iptables -w -I FORWARD 1 -j "${GUARD_CHAIN}"

  cat > "${RUN}/cni/net.d/10-adaptis.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "adaptis-realnode",
  "plugins": [
    {"type": "bridge", "bridge": "${BRIDGE}", "isGateway": true, "ipMasq": false,
     "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": "${RUN}/cni/ipam",
              "ranges": [[{"subnet": "${POD_CIDR}", "rangeStart": "198.51.100.10",
                           "gateway": "${NODE_IP}"}]],
              "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
  cat > "${RUN}/containerd.toml" <<EOF
version = 2
root = "${CTRD_ROOT}"
state = "${CTRD_STATE}"
[grpc]
  address = "${SOCK}"
[ttrpc]
  address = "${SOCK}.ttrpc"
[debug]
  address = "${SOCK}.debug"
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "${PAUSE_IMAGE}"
  # this VM's bounding set lacks CAP_SYS_RESOURCE: runc cannot lower oom_score_adj
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "${RUN}/cni/net.d"
EOF
  launch containerd containerd --config "${RUN}/containerd.toml"
  wait_for 60 containerd ctr_ version || die "containerd did not answer on ${SOCK}: $(tail -20 "${LOGS}/containerd.log")"
}

cmd_start() {
  local cfg="${1:?usage: node.sh start CONFIG_DIR}" bin name
  bin="$(bin_dir)"
  for name in kubelet kube-proxy coredns; do [[ -x "${bin}/${name}" ]] || die "${bin}/${name} is missing: run hack/build-control-plane.sh --real-node"; done
  [[ -S "${SOCK}" ]] || die "containerd is not running: run node.sh prepare first"
  # (not `ctr | grep -q`: grep's early exit would fail the pipeline with SIGPIPE)
  grep -qx "${PAUSE_IMAGE}" <<<"$(ctr_ images ls -q)" || die "${PAUSE_IMAGE} is not imported: run hack/realnode/build-images.sh pause"
  name="$(cat "${cfg}/node-name")"
  echo "" > "${RUN}/resolv.conf"   # pods get only the cluster DNS, never the host's resolvers
  cat > "${RUN}/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://${SOCK}
address: ${NODE_IP}
port: ${KUBELET_PORT}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: ${KUBELET_HEALTHZ_PORT}
tlsCertFile: ${cfg}/kubelet-serving.crt
tlsPrivateKeyFile: ${cfg}/kubelet-serving.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: ${cfg}/ca.crt}
authorization: {mode: Webhook}
clusterDomain: cluster.local
clusterDNS: [${CLUSTER_DNS}]
resolvConf: ${RUN}/resolv.conf
podLogsDir: ${RUN}/pod-logs
podCIDR: ${POD_CIDR}
maxPods: 60
failSwapOn: false
serializeImagePulls: false
# images are imported, never pulled: the kubelet must not garbage-collect them
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "2%", imagefs.available: "2%"}
evictionPressureTransitionPeriod: 10s
syncFrequency: 10s
fileCheckFrequency: 0s
registerNode: true
EOF
  launch kubelet "${bin}/kubelet" --config "${RUN}/kubelet.yaml" \
    --kubeconfig "${cfg}/kubelet.kubeconfig" --root-dir "${RUN}/kubelet" \
    --node-ip "${NODE_IP}" --hostname-override "${name}" --v=1
  cat > "${RUN}/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: ${cfg}/kube-proxy.kubeconfig}
hostnameOverride: ${name}
mode: iptables
clusterCIDR: ${POD_CIDR}
bindAddress: ${NODE_IP}
healthzBindAddress: 127.0.0.1:${PROXY_HEALTHZ_PORT}
metricsBindAddress: 127.0.0.1:${PROXY_METRICS_PORT}
nodePortAddresses: ["${NODE_IP}/32"]
# leave the machine's conntrack settings alone
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
  launch kube-proxy "${bin}/kube-proxy" --config "${RUN}/kube-proxy.yaml" --v=1
  cat > "${RUN}/Corefile" <<EOF
.:${DNS_PORT} {
  bind ${NODE_IP}
  errors
  health 127.0.0.1:${DNS_HEALTH_PORT}
  ready 127.0.0.1:${DNS_READY_PORT}
  kubernetes cluster.local in-addr.arpa ip6.arpa {
    kubeconfig ${cfg}/coredns.kubeconfig
    pods insecure
    fallthrough in-addr.arpa ip6.arpa
  }
  cache 5
}
EOF
  launch coredns "${bin}/coredns" -conf "${RUN}/Corefile"
  wait_for 120 kubelet curl -sf "http://127.0.0.1:${KUBELET_HEALTHZ_PORT}/healthz" \
    || die "the kubelet is not healthy: $(tail -30 "${LOGS}/kubelet.log")"
  wait_for 60 kube-proxy curl -sf "http://127.0.0.1:${PROXY_HEALTHZ_PORT}/healthz" \
    || die "kube-proxy is not healthy: $(tail -30 "${LOGS}/kube-proxy.log")"
  wait_for 60 coredns curl -sf "http://127.0.0.1:${DNS_HEALTH_PORT}/health" \
    || die "CoreDNS is not healthy: $(tail -30 "${LOGS}/coredns.log")"
}

case "${1:-}" in
  prepare) cmd_prepare ;;
  start) shift; cmd_start "$@" ;;
  stop) cmd_stop ;;
  ctr) shift; ctr_ "$@" ;;
  *) echo "usage: $0 prepare | start CONFIG_DIR | stop | ctr ARGS..." >&2; exit 2 ;;
esac
