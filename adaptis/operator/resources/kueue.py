"""What the worker pods of an AdaPtisJob carry for Kueue's pod-group integration.

Sits under :mod:`adaptis.operator.resources.manifests`, which merges these labels and annotations
into every worker pod it renders. Kueue admits the ranks of one job as one pod group: one Workload,
admitted whole or not at all, which is the gang semantics AdaPtis needs. Kueue's pod webhook gates
each pod (scheduling gate ``kueue.x-k8s.io/admission``) until the group fits the quota of the
ClusterQueue behind the LocalQueue ``spec.queueName``; see docs/kueue.md.

- ``kueue.x-k8s.io/queue-name`` (label): only when ``spec.queueName`` is set; without it Kueue
  leaves the pods alone (unless the admin manages jobs without a queue name).
- ``kueue.x-k8s.io/pod-group-name`` (label) and ``kueue.x-k8s.io/pod-group-total-count``
  (annotation): always, so that a default LocalQueue in the namespace also sees one group.
- ``kueue.x-k8s.io/retriable-in-group: "false"`` (annotation): with a queue name. Kueue keeps
  its finalizer on a group's pods until the group has finished, and by default a group with a
  failed pod is unfinished until a *replacement* pod appears. AdaPtis replaces ranks under the
  same pod names, which only free up once the finalizer is gone: a gang restart waited for
  ever, holding the quota, and so did the pods of a deleted job. Unretriable, the group is
  finished as soon as all its pods have terminated (failed, deleted, or never admitted and
  deleted), Kueue releases the quota and the finalizers, and each attempt of the gang is a
  group (and Workload) of its own, ``<job>`` then ``<job>-a<n>``, queued afresh.
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
    "RETRIABLE_ANNOTATION",
    "QUEUE_LABEL",
    "ROLE_HASH_ANNOTATION",
    "TOTAL_COUNT_ANNOTATION",
    "WORKER_ROLE",
    "group_name",
    "kueue_annotations",
    "kueue_labels",
]

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
TOTAL_COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
ROLE_HASH_ANNOTATION = "kueue.x-k8s.io/role-hash"
RETRIABLE_ANNOTATION = "kueue.x-k8s.io/retriable-in-group"
#: The one role (PodSet name in the Workload) of every rank; a DNS label, as Kueue requires.
WORKER_ROLE = "workers"


def group_name(*, job_name: str, attempt: int) -> str:
    """The pod group (and Kueue Workload) of one attempt of the gang."""
    # "-a<n>": 6 characters at most (backoffLimit <= 1000), and a job name leaves at least 9
    # of the 63 a label value may have (its pods are "<job>-worker-<rank>").
    return job_name if attempt == 0 else f"{job_name}-a{attempt}"


def kueue_labels(*, job_name: str, queue_name: str | None, attempt: int) -> dict[str, str]:
    """The Kueue labels of every worker pod of attempt ``attempt`` of ``job_name``."""
    labels = {GROUP_LABEL: group_name(job_name=job_name, attempt=attempt)}
    if queue_name:
        labels[QUEUE_LABEL] = queue_name
    return labels


def kueue_annotations(*, world: int, queue_name: str | None) -> dict[str, str]:
    """The Kueue annotations of every worker pod of a gang of ``world`` ranks."""
    annotations = {TOTAL_COUNT_ANNOTATION: str(world)}
    if queue_name:
        annotations[ROLE_HASH_ANNOTATION] = WORKER_ROLE
        annotations[RETRIABLE_ANNOTATION] = "false"
    return annotations
