"""The operator's settings: what ``adaptis operator`` is started with, and their defaults.

Sits at the bottom of the operator layer (:mod:`adaptis.operator.core`): the reconciler and the
rooms under it read a :class:`ReconcileSettings`; the command line (:mod:`adaptis.cli.operator`)
builds one from its flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from adaptis.api.problem import Link

__all__ = ["DEFAULT_INTER_NODE", "DEFAULT_TOPOLOGY_KEYS", "AdaptationSettings", "ManifestSettings",
           "ReconcileSettings"]


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


@dataclass(frozen=True, slots=True)
class ManifestSettings:
    """Operator-wide defaults of the worker pods.

    ``run_as_user``/``run_as_group``: the numeric user of the worker image (the Dockerfile's
    ``USER 10001:10001``); the pods run as it, since runAsNonRoot can only be checked against
    a number.
    """

    image: str = "ghcr.io/adaptis/adaptis:0.1.0"
    image_pull_policy: str = "IfNotPresent"
    run_as_user: int = 10001
    run_as_group: int = 10001


@dataclass(frozen=True)
class AdaptationSettings:
    """Operator-wide choices of the adaptation loop, from the ``adaptis operator`` command line."""

    # Prometheus's base URL (``--prometheus-url``); None: no measurement source, and jobs
    # asking for adaptation are told so in their status.
    prometheus_url: str | None = None
    poll_s: float = 30.0  # how often a running job's counters are read
    # A restart's cost (checkpoint, new pods, rendezvous, restore, first step) assumed until
    # one is measured on the job: pod creation to the first step seen. Two minutes: an image
    # already on the node, a checkpoint of a few GB; a re-plan must save more than this.
    default_restart_s: float = 120.0
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
    profile_timeout_s: float = 600.0
    # Where profiler pods run and measured profiles are stored: a namespace no tenant may
    # write (the chart's release namespace), since a profile changes every tenant's plans.
    profile_namespace: str = "adaptis-system"
    # The image of the profiler pods, chosen by the admin (None: manifests.image); never a
    # job's spec.worker.image, whose code could write any profile it liked.
    profiler_image: str | None = None
    # How long a rank may stay unschedulable on its planned node before the job is re-planned
    # on the capacity free then, without that node for a while (another scheduler's pod took
    # the GPUs, or a taint or quota the plan could not see).
    unschedulable_replan_s: float = 120.0
    # Where the workers' measurements are read, how often, and the restart cost assumed until
    # one is measured (spec.adaptation; adaptis.operator.adaptation.loop).
    adaptation: AdaptationSettings = field(default_factory=AdaptationSettings)
