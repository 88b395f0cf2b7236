"""The operator's settings: what ``adaptis operator`` is started with, and their defaults.

Sits at the bottom of the operator layer (:mod:`adaptis.operator.core`). :class:`OperatorSettings`
is the one list of the operator's flags: each field is a flag ``--<field-name>`` and carries its
default and help, from which :mod:`adaptis.cli.operator` derives the command line (so ``adaptis
operator --help`` and the defaults are written only here). The rooms read the slices built from
it (:class:`ReconcileSettings`, :class:`ManifestSettings`, :class:`AdaptationSettings`, the
scheduler's ``PlannerLimits``, the control loop's ``OperatorOptions``), whose defaults are
:data:`OPERATOR_DEFAULTS`' values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from adaptis.api.problem import Link

__all__ = ["DEFAULT_INTER_NODE", "DEFAULT_TOPOLOGY_KEYS", "OPERATOR_DEFAULTS", "PROFILE_NAMESPACE",
           "WORKER_IMAGE", "AdaptationSettings", "ManifestSettings", "OperatorSettings",
           "ReconcileSettings", "flag_help"]


#: Widest domain first; the host is always the last level.
DEFAULT_TOPOLOGY_KEYS: tuple[str, ...] = (
    "topology.kubernetes.io/region",
    "topology.kubernetes.io/zone",
    "cloud.google.com/gce-topology-block",
    "topology.kubernetes.io/block",
    "topology.kubernetes.io/rack",
    "topology.adaptis.io/rack",
    "nvidia.com/gpu.clique",
)

#: Default link between nodes: 200 Gb/s InfiniBand/RoCE per GPU, 10 us.
DEFAULT_INTER_NODE = Link(bandwidth_bytes_per_s=25e9, latency_s=10e-6)

#: The worker pods' image unless ``--worker-image`` (or a job's spec.worker.image) says otherwise.
WORKER_IMAGE = "ghcr.io/adaptis/adaptis:0.1.0"
#: The operator's own namespace outside a pod (in one: its service account's).
PROFILE_NAMESPACE = "adaptis-system"


def _about(text: str, *, metavar: str | None = None, parse: Callable[[str], Any] | None = None,
           unset: str | None = None, note: str = "", short: str | None = None,
           exclusive: str | None = None) -> dict[str, Any]:
    """The metadata of a field of :class:`OperatorSettings`: what ``--help`` says of its flag.

    ``parse``: the flag's type (default: the default's); ``unset``: what a None default means;
    ``note``: said after the default; ``short``: a one-letter alias; fields of one ``exclusive``
    group may not be given together."""
    return {"help": text, "metavar": metavar, "parse": parse, "unset": unset, "note": note,
            "short": short, "exclusive": exclusive}


def flag_help(default: Any, meta: Mapping[str, Any]) -> str:
    """The ``--help`` line of a flag: its help, then its default (``30.0`` shows as 30)."""
    if isinstance(default, bool) or default == ():
        return str(meta["help"])
    if default is None:
        return f"{meta['help']} (default: {meta['unset']})" if meta["unset"] else str(meta["help"])
    shown = f"{default:g}" if isinstance(default, float) else str(default)
    return f"{meta['help']} (default {shown}{meta['note']})"


@dataclass(frozen=True)
class OperatorSettings:
    """Every flag of ``adaptis operator`` (``--<field-name>``), with its default and help."""

    namespace: tuple[str, ...] = field(default=(), metadata=_about(
        "watch this namespace (repeatable; glob patterns allowed)", metavar="NS", short="-n",
        exclusive="scope"))
    all_namespaces: bool = field(default=False, metadata=_about(
        "watch every namespace", short="-A", exclusive="scope"))
    liveness: str | None = field(default=None, metadata=_about(
        "serve a liveness probe, e.g. http://0.0.0.0:8080/healthz", metavar="URL"))
    metrics_port: int | None = field(default=None, metadata=_about(
        "serve the operator's Prometheus metrics on this port, path /metrics", metavar="PORT",
        parse=int, unset="off"))
    kubeconfig: Path | None = field(default=None, metadata=_about(
        "kubeconfig file", parse=Path, unset="$KUBECONFIG"))
    worker_image: str | None = field(default=None, metadata=_about(
        "image of the worker pods of a job without spec.worker.image", unset=WORKER_IMAGE))
    worker_run_as_user: int = field(default=10001, metadata=_about(
        "numeric user of the worker image, which worker and profiler pods run as; "
        "runAsNonRoot needs a number", metavar="UID", note=", the image's"))
    worker_run_as_group: int = field(default=10001, metadata=_about(
        "numeric group of the worker and profiler pods", metavar="GID"))
    profiler_image: str | None = field(default=None, metadata=_about(
        "image of the profiler pods (spec.planner.profile: measure); never a job's own "
        "image: a profile changes every tenant's plans", metavar="IMAGE", unset="the worker image"))
    profile_namespace: str | None = field(default=None, metadata=_about(
        "the operator's own namespace, where profiler pods run and measured profiles are "
        "stored; no tenant may write there", metavar="NS",
        unset=f"the service account's namespace in a pod, else {PROFILE_NAMESPACE}"))
    topology_keys: str | None = field(default=None, metadata=_about(
        "node label keys from the widest topology domain to the narrowest",
        metavar="K1,K2,..."))
    inter_node_bandwidth: float = field(
        default=DEFAULT_INTER_NODE.bandwidth_bytes_per_s,
        metadata=_about("bandwidth between nodes assumed by the planner", metavar="BYTES_PER_S"))
    reconcile_workers: int = field(default=2, metadata=_about("jobs reconciled in parallel", metavar="N"))
    resync_seconds: float = field(default=30.0, metadata=_about("look at every job at least this often", metavar="S"))
    profile_timeout_seconds: float = field(default=600.0, metadata=_about(
        "how long a profiler pod (spec.planner.profile: measure) may take, scheduling and "
        "image pull included, before its node is planned from its labels", metavar="S"))
    queue_strict_after_seconds: float = field(default=120.0, metadata=_about(
        "a job waiting for free GPUs this long holds back every job queued behind it "
        "(priority, then creation time), so that large jobs are never starved by small ones",
        metavar="S"))
    unschedulable_replan_seconds: float = field(default=120.0, metadata=_about(
        "re-plan a job whose ranks stay unschedulable on their planned nodes this long, on "
        "the GPUs free then", metavar="S"))
    max_concurrent_plans: int = field(default=1, metadata=_about(
        "plans made at once, each in a process of its own; others wait their turn", metavar="N"))
    planner_memory_mib: int = field(default=1536, metadata=_about(
        "address-space cap of one planner process, mapped libraries included; 0: none",
        metavar="MIB", note="; fits the chart's memory limit with the operator itself, see "
        "docs/planning-budget.md"))
    planner_kill_grace_seconds: float = field(default=20.0, metadata=_about(
        "how long a planner may run past the job's spec.planner.timeLimitSeconds before it "
        "is killed", metavar="S"))
    prometheus_url: str | None = field(default=None, metadata=_about(
        "Prometheus that scrapes the workers (the chart's PodMonitor), e.g. "
        "http://prometheus.monitoring:9090: where spec.adaptation reads the measured compute of "
        "running jobs", metavar="URL",
        unset="none; jobs asking for adaptation are told so in their status"))
    adaptation_poll_seconds: float = field(default=30.0, metadata=_about(
        "read a running job's measurements this often", metavar="S"))
    restart_cost_seconds: float = field(default=120.0, metadata=_about(
        "a restart's cost assumed until one is measured on the job, pod creation to first "
        "step", metavar="S"))


#: The flags' defaults: the defaults of the settings built from them.
OPERATOR_DEFAULTS: Final = OperatorSettings()


@dataclass(frozen=True, slots=True)
class ManifestSettings:
    """Operator-wide defaults of the worker pods.

    ``run_as_user``/``run_as_group``: the numeric user of the worker image (the Dockerfile's
    ``USER 10001:10001``); the pods run as it, since runAsNonRoot can only be checked against
    a number.
    """

    image: str = WORKER_IMAGE
    image_pull_policy: str = "IfNotPresent"
    run_as_user: int = OPERATOR_DEFAULTS.worker_run_as_user
    run_as_group: int = OPERATOR_DEFAULTS.worker_run_as_group


@dataclass(frozen=True)
class AdaptationSettings:
    """Operator-wide choices of the adaptation loop, from the ``adaptis operator`` command line."""

    # Prometheus's base URL (``--prometheus-url``); None: no measurement source, and jobs
    # asking for adaptation are told so in their status.
    prometheus_url: str | None = None
    poll_s: float = OPERATOR_DEFAULTS.adaptation_poll_seconds  # how often a running job's counters are read
    # A restart's cost (checkpoint, new pods, rendezvous, restore, first step) assumed until
    # one is measured on the job: pod creation to the first step seen. Two minutes: an image
    # already on the node, a checkpoint of a few GB; a re-plan must save more than this.
    default_restart_s: float = OPERATOR_DEFAULTS.restart_cost_seconds
    # The re-plan's search runs in the reconcile pass: at most this long (and never past the
    # job's spec.planner.timeLimitSeconds), returning the best plan found by then.
    decide_time_limit_s: float = 5.0
    query_timeout_s: float = 5.0


@dataclass(frozen=True)
class ReconcileSettings:
    """Operator-wide choices, from the ``adaptis operator`` command line."""

    topology_keys: tuple[str, ...] = DEFAULT_TOPOLOGY_KEYS
    manifests: ManifestSettings = field(default_factory=ManifestSettings)
    inter_node: Link = DEFAULT_INTER_NODE
    # How long a profiler pod (spec.planner.profile: measure) may take, scheduling and image
    # pull included, before its node is planned from the label-based estimate instead.
    profile_timeout_s: float = OPERATOR_DEFAULTS.profile_timeout_seconds
    # Where profiler pods run and measured profiles are stored: a namespace no tenant may
    # write (the chart's release namespace), since a profile changes every tenant's plans.
    profile_namespace: str = PROFILE_NAMESPACE
    # The image of the profiler pods, chosen by the admin (None: manifests.image); never a
    # job's spec.worker.image, whose code could write any profile it liked.
    profiler_image: str | None = None
    # How long a rank may stay unschedulable on its planned node before the job is re-planned
    # on the capacity free then, without that node for a while (another scheduler's pod took
    # the GPUs, or a taint or quota the plan could not see).
    unschedulable_replan_s: float = OPERATOR_DEFAULTS.unschedulable_replan_seconds
    # Where the workers' measurements are read, how often, and the restart cost assumed until
    # one is measured (spec.adaptation; adaptis.operator.adaptation.loop).
    adaptation: AdaptationSettings = field(default_factory=AdaptationSettings)
