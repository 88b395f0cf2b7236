"""What the worker pods of an AdaPtisJob carry for Kueue's pod-group integration.

Sits under :mod:`adaptis.operator.manifests`, which merges these labels and annotations into
every worker pod it renders. Kueue admits the ranks of one job as one pod group: one Workload,
admitted whole or not at all, which is the gang semantics AdaPtis needs. Kueue's pod webhook
gates each pod (scheduling gate ``kueue.x-k8s.io/admission``) until the group fits the quota
of the ClusterQueue behind the LocalQueue ``spec.queueName``; see docs/kueue.md.

- ``kueue.x-k8s.io/queue-name`` (label): only when ``spec.queueName`` is set; without it Kueue
  leaves the pods alone (unless the admin manages jobs without a queue name).
- ``kueue.x-k8s.io/pod-group-name`` (label) and ``kueue.x-k8s.io/pod-group-total-count``
  (annotation): always, so that a default LocalQueue in the namespace also sees one group.
- ``kueue.x-k8s.io/role-hash`` (annotation): with a queue name. Kueue splits a group into one
  PodSet per distinct pod "shape", and the shape includes the node affinity; every AdaPtis rank
  is pinned to its planned node, so without this every node of the plan would be a PodSet of
  its own, and a Workload holds at most 8 PodSets: a job spread over 9 nodes could never be
  admitted. All ranks request the same resources, so they are one role. Kueue's webhook keeps
  a role hash it finds on the pod instead of computing one.
"""

from __future__ import annotations

__all__ = [
    "GROUP_LABEL",
    "QUEUE_LABEL",
    "ROLE_HASH_ANNOTATION",
    "TOTAL_COUNT_ANNOTATION",
    "WORKER_ROLE",
    "kueue_annotations",
    "kueue_labels",
]

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
TOTAL_COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
ROLE_HASH_ANNOTATION = "kueue.x-k8s.io/role-hash"
#: The one role (PodSet name in the Workload) of every rank; a DNS label, as Kueue requires.
WORKER_ROLE = "workers"


def kueue_labels(*, job_name: str, queue_name: str | None) -> dict[str, str]:
    """The Kueue labels of every worker pod of ``job_name``."""
    labels = {GROUP_LABEL: job_name}
    if queue_name:
        labels[QUEUE_LABEL] = queue_name
    return labels


def kueue_annotations(*, world: int, queue_name: str | None) -> dict[str, str]:
    """The Kueue annotations of every worker pod of a gang of ``world`` ranks."""
    annotations = {TOTAL_COUNT_ANNOTATION: str(world)}
    if queue_name:
        annotations[ROLE_HASH_ANNOTATION] = WORKER_ROLE
    return annotations
