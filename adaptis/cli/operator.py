"""``adaptis operator``: run the AdaPtisJob operator against the current cluster.

Credentials come from the pod's service account in a cluster, else from ``$KUBECONFIG`` (or
``--kubeconfig``). The Helm chart runs ``adaptis operator --all-namespaces --liveness
http://0.0.0.0:8080/healthz``. The flags, their defaults and help are the fields of
:class:`adaptis.operator.core.settings.OperatorSettings`; this module turns them into the
settings of the rooms (clamping the intervals as it always did) and starts the operator.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from adaptis.operator.core.settings import OperatorSettings

__all__ = ["register"]

_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _own_namespace() -> str:
    from adaptis.operator.core.settings import PROFILE_NAMESPACE

    try:
        return _SA_NAMESPACE.read_text().strip() or PROFILE_NAMESPACE
    except OSError:
        return PROFILE_NAMESPACE


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``adaptis operator``: one flag per field of OperatorSettings, its default and help from
    there (only the kopf/core settings module is imported here, not the operator)."""
    from adaptis.operator.core.settings import OperatorSettings, flag_help

    parser = subparsers.add_parser(
        "operator",
        help="run the operator (kopf) against the current cluster",
        description="Reconcile AdaPtisJobs: profile nodes, plan, run one worker pod per rank.",
    )
    groups: dict[str, Any] = {}
    for f in fields(OperatorSettings):
        meta = f.metadata
        if meta["exclusive"] and meta["exclusive"] not in groups:
            groups[meta["exclusive"]] = parser.add_mutually_exclusive_group()
        where = groups[meta["exclusive"]] if meta["exclusive"] else parser
        names = [n for n in (meta["short"], "--" + f.name.replace("_", "-")) if n]
        kwargs: dict[str, Any] = {"help": flag_help(f.default, meta)}
        if isinstance(f.default, bool):
            kwargs["action"] = "store_true"
        elif isinstance(f.default, tuple):  # repeatable
            kwargs.update(action="append", default=[])
        else:
            kwargs.update(default=f.default,
                          type=meta["parse"] or (str if f.default is None else type(f.default)))
        if meta["metavar"]:
            kwargs["metavar"] = meta["metavar"]
        where.add_argument(*names, **kwargs)
    parser.set_defaults(func=_run)


def _settings(args: argparse.Namespace) -> OperatorSettings:
    from adaptis.operator.core.settings import OperatorSettings

    given = {f.name: getattr(args, f.name) for f in fields(OperatorSettings)}
    return OperatorSettings(**{**given, "namespace": tuple(given["namespace"])})


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

    s = _settings(args)
    if s.worker_run_as_user < 1 or s.worker_run_as_group < 0:
        print("adaptis operator: --worker-run-as-user must be a non-root UID (>= 1) and "
              "--worker-run-as-group >= 0", file=sys.stderr)
        return 2
    if s.max_concurrent_plans < 1 or s.planner_memory_mib < 0 \
            or not s.planner_kill_grace_seconds > 0:
        print("adaptis operator: --max-concurrent-plans must be >= 1, --planner-memory-mib "
              ">= 0 (0: no cap) and --planner-kill-grace-seconds > 0", file=sys.stderr)
        return 2
    # A long-running service logs its decisions (plans, restarts, failures) by default; kopf
    # logs every handled watch event at INFO, which only -v shows.
    if not args.verbose:
        logging.getLogger("adaptis").setLevel(logging.INFO)
    logging.getLogger("kopf.objects").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    if s.kubeconfig is not None:
        # kopf's login and the reconciler's client both read it from the environment.
        os.environ["KUBECONFIG"] = str(s.kubeconfig)
    manifests = ManifestSettings(run_as_user=s.worker_run_as_user,
                                 run_as_group=s.worker_run_as_group,
                                 **({"image": s.worker_image} if s.worker_image else {}))
    topology = (tuple(k.strip() for k in s.topology_keys.split(",") if k.strip())
                if s.topology_keys else DEFAULT_TOPOLOGY_KEYS)
    inter = (Link(bandwidth_bytes_per_s=s.inter_node_bandwidth,
                  latency_s=DEFAULT_INTER_NODE.latency_s)
             if s.inter_node_bandwidth else DEFAULT_INTER_NODE)
    if s.prometheus_url and not s.prometheus_url.startswith(("http://", "https://")):
        print("adaptis operator: --prometheus-url must be an http:// or https:// URL, got "
              f"{s.prometheus_url!r}", file=sys.stderr)
        return 2
    adaptation = AdaptationSettings(prometheus_url=s.prometheus_url or None,
                                    poll_s=max(1.0, s.adaptation_poll_seconds),
                                    default_restart_s=max(0.0, s.restart_cost_seconds))
    options = OperatorOptions(
        namespaces=tuple(s.namespace),
        all_namespaces=s.all_namespaces,
        liveness_endpoint=s.liveness,
        metrics_port=s.metrics_port or None,
        reconcile_workers=max(1, s.reconcile_workers),
        resync_seconds=max(1.0, s.resync_seconds),
        reconcile=ReconcileSettings(topology_keys=topology, manifests=manifests,
                                    inter_node=inter, profile_timeout_s=max(1.0, s.profile_timeout_seconds),
                                    profile_namespace=s.profile_namespace or _own_namespace(),
                                    profiler_image=s.profiler_image or None,
                                    unschedulable_replan_s=max(
                                        1.0, s.unschedulable_replan_seconds),
                                    adaptation=adaptation),
        queue_strict_after_s=max(0.0, s.queue_strict_after_seconds),
        planner=PlannerLimits(max_concurrent=s.max_concurrent_plans,
                              memory_bytes=s.planner_memory_mib * (1 << 20) or None,
                              kill_grace_s=s.planner_kill_grace_seconds),
    )
    try:
        run_operator(options)
    except OperatorError as err:
        print(f"adaptis operator: {err}", file=sys.stderr)
        return 2
    return 0
