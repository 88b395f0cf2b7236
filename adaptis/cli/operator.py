"""``adaptis operator``: run the AdaPtisJob operator against the current cluster.

Credentials come from the pod's service account in a cluster, else from ``$KUBECONFIG`` (or
``--kubeconfig``). The Helm chart runs ``adaptis operator --all-namespaces --liveness
http://0.0.0.0:8080/healthz``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

__all__ = ["register"]

_PROFILE_NS = "adaptis-system"
_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _own_namespace() -> str:
    try:
        return _SA_NAMESPACE.read_text().strip() or _PROFILE_NS
    except OSError:
        return _PROFILE_NS


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "operator",
        help="run the operator (kopf) against the current cluster",
        description="Reconcile AdaPtisJobs: profile nodes, plan, run one worker pod per rank.",
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable; glob patterns allowed)")
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="watch every namespace")
    parser.add_argument("--liveness", metavar="URL",
                        help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="serve the operator's Prometheus metrics on this port, path /metrics (default: off)")
    parser.add_argument("--kubeconfig", type=Path, help="kubeconfig file (default: $KUBECONFIG)")
    parser.add_argument("--worker-image", help="default image of the worker pods")
    parser.add_argument("--worker-run-as-user", type=int, default=10001, metavar="UID",
                        help="numeric user of the worker image, which worker and profiler pods "
                             "run as (runAsNonRoot needs a number; default 10001, the image's)")
    parser.add_argument("--worker-run-as-group", type=int, default=10001, metavar="GID",
                        help="numeric group of the worker and profiler pods (default 10001)")
    parser.add_argument("--profiler-image", metavar="IMAGE",
                        help="image of the profiler pods (spec.planner.profile: measure); default: "
                             "the worker image. Never a job's own image: a profile changes every "
                             "tenant's plans")
    parser.add_argument("--profile-namespace", metavar="NS",
                        help="the operator's own namespace, where profiler pods run and measured "
                             "profiles are stored; no tenant may write there (default: the "
                             f"service account's namespace in a pod, else {_PROFILE_NS})")
    parser.add_argument("--topology-keys", metavar="K1,K2,...",
                        help="node label keys from the widest topology domain to the narrowest")
    parser.add_argument("--inter-node-bandwidth", type=float, metavar="BYTES_PER_S",
                        help="bandwidth between nodes assumed by the planner (default 25e9)")
    parser.add_argument("--reconcile-workers", type=int, default=2, metavar="N",
                        help="jobs reconciled in parallel (default 2)")
    parser.add_argument("--resync-seconds", type=float, default=30.0, metavar="S",
                        help="look at every job at least this often (default 30)")
    parser.add_argument("--profile-timeout-seconds", type=float, default=600.0, metavar="S",
                        help="how long a profiler pod (spec.planner.profile: measure) may take, scheduling and "
                             "image pull included, before its node is planned from its labels (default 600)")
    parser.add_argument("--queue-strict-after-seconds", type=float, default=120.0, metavar="S",
                        help="a job waiting for free GPUs this long holds back every job queued "
                             "behind it (priority, then creation time), so that large jobs are "
                             "never starved by small ones (default 120)")
    parser.add_argument("--unschedulable-replan-seconds", type=float, default=120.0, metavar="S",
                        help="re-plan a job whose ranks stay unschedulable on their planned "
                             "nodes this long, on the GPUs free then (default 120)")
    parser.add_argument("--max-concurrent-plans", type=int, default=1, metavar="N",
                        help="plans made at once, each in a process of its own; others wait "
                             "their turn (default 1)")
    parser.add_argument("--planner-memory-mib", type=int, default=1536, metavar="MIB",
                        help="address-space cap of one planner process, mapped libraries "
                             "included; 0: none (default 1536; fits the chart's memory limit "
                             "with the operator itself, see docs/planning-budget.md)")
    parser.add_argument("--planner-kill-grace-seconds", type=float, default=20.0, metavar="S",
                        help="how long a planner may run past the job's "
                             "spec.planner.timeLimitSeconds before it is killed (default 20)")
    parser.add_argument("--prometheus-url", metavar="URL",
                        help="Prometheus that scrapes the workers (the chart's PodMonitor), e.g. "
                             "http://prometheus.monitoring:9090: where spec.adaptation reads the "
                             "measured compute of running jobs (default: none; jobs asking for "
                             "adaptation are told so in their status)")
    parser.add_argument("--adaptation-poll-seconds", type=float, default=30.0, metavar="S",
                        help="read a running job's measurements this often (default 30)")
    parser.add_argument("--restart-cost-seconds", type=float, default=120.0, metavar="S",
                        help="a restart's cost assumed until one is measured on the job, pod "
                             "creation to first step (default 120)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from adaptis.api.problem import Link
    from adaptis.operator.control.app import OperatorOptions, run_operator
    from adaptis.operator.control.reconcile import ReconcileSettings
    from adaptis.operator.core.errors import OperatorError
    from adaptis.operator.core.settings import (
        DEFAULT_INTER_NODE,
        DEFAULT_TOPOLOGY_KEYS,
        AdaptationSettings,
        ManifestSettings,
    )
    from adaptis.operator.scheduling.plan_runner import PlannerLimits

    if args.worker_run_as_user < 1 or args.worker_run_as_group < 0:
        print("adaptis operator: --worker-run-as-user must be a non-root UID (>= 1) and "
              "--worker-run-as-group >= 0", file=sys.stderr)
        return 2
    if args.max_concurrent_plans < 1 or args.planner_memory_mib < 0 \
            or not args.planner_kill_grace_seconds > 0:
        print("adaptis operator: --max-concurrent-plans must be >= 1, --planner-memory-mib "
              ">= 0 (0: no cap) and --planner-kill-grace-seconds > 0", file=sys.stderr)
        return 2
    # A long-running service logs its decisions (plans, restarts, failures) by default; kopf
    # logs every handled watch event at INFO, which only -v shows.
    if not args.verbose:
        logging.getLogger("adaptis").setLevel(logging.INFO)
    logging.getLogger("kopf.objects").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    if args.kubeconfig is not None:
        # kopf's login and the reconciler's client both read it from the environment.
        os.environ["KUBECONFIG"] = str(args.kubeconfig)
    manifests = ManifestSettings(run_as_user=args.worker_run_as_user,
                                 run_as_group=args.worker_run_as_group,
                                 **({"image": args.worker_image} if args.worker_image else {}))
    topology = (tuple(k.strip() for k in args.topology_keys.split(",") if k.strip())
                if args.topology_keys else DEFAULT_TOPOLOGY_KEYS)
    inter = (Link(bandwidth_bytes_per_s=args.inter_node_bandwidth,
                  latency_s=DEFAULT_INTER_NODE.latency_s)
             if args.inter_node_bandwidth else DEFAULT_INTER_NODE)
    if args.prometheus_url and not args.prometheus_url.startswith(("http://", "https://")):
        print("adaptis operator: --prometheus-url must be an http:// or https:// URL, got "
              f"{args.prometheus_url!r}", file=sys.stderr)
        return 2
    adaptation = AdaptationSettings(prometheus_url=args.prometheus_url or None,
                                    poll_s=max(1.0, args.adaptation_poll_seconds),
                                    default_restart_s=max(0.0, args.restart_cost_seconds))
    options = OperatorOptions(
        namespaces=tuple(args.namespace),
        all_namespaces=args.all_namespaces,
        liveness_endpoint=args.liveness,
        metrics_port=args.metrics_port or None,
        reconcile_workers=max(1, args.reconcile_workers),
        resync_seconds=max(1.0, args.resync_seconds),
        reconcile=ReconcileSettings(topology_keys=topology, manifests=manifests,
                                    inter_node=inter, profile_timeout_s=max(1.0, args.profile_timeout_seconds),
                                    profile_namespace=args.profile_namespace or _own_namespace(),
                                    profiler_image=args.profiler_image or None,
                                    unschedulable_replan_s=max(
                                        1.0, args.unschedulable_replan_seconds),
                                    adaptation=adaptation),
        queue_strict_after_s=max(0.0, args.queue_strict_after_seconds),
        planner=PlannerLimits(max_concurrent=args.max_concurrent_plans,
                              memory_bytes=args.planner_memory_mib * (1 << 20) or None,
                              kill_grace_s=args.planner_kill_grace_seconds),
    )
    try:
        run_operator(options)
    except OperatorError as err:
        print(f"adaptis operator: {err}", file=sys.stderr)
        return 2
    return 0
