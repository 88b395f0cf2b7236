"""The names the operator writes on Kubernetes objects and selects them by.

Sits at the bottom of the operator layer (:mod:`adaptis.operator.core`): the manifests write
these labels and annotations, the client and the capacity ledger select by them, and node
profiling and the profiler pods read the node's names. One place, so that what one room writes
is what another looks for.
"""

from __future__ import annotations

__all__ = [
    "GPU_RESOURCE",
    "HOSTNAME_LABEL",
    "LABEL_ATTEMPT",
    "LABEL_JOB",
    "LABEL_MANAGED_BY",
    "LABEL_PLAN",
    "LABEL_RANK",
    "MANAGED_BY",
    "NODE_ANNOTATION",
]


LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_JOB = "adaptis.io/job"
LABEL_RANK = "adaptis.io/rank"
LABEL_PLAN = "adaptis.io/plan-hash"
LABEL_ATTEMPT = "adaptis.io/attempt"
MANAGED_BY = "adaptis"
NODE_ANNOTATION = "adaptis.io/node"  # the node the plan pins the rank to (counted before binding)

GPU_RESOURCE = "nvidia.com/gpu"
HOSTNAME_LABEL = "kubernetes.io/hostname"
