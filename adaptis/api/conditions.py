"""The words of an AdaPtisJob's status conditions and Events: condition types and reasons.

Sits in the api layer under :mod:`adaptis.api.job` (whose ``Condition`` describes its types
from :class:`ConditionType`) and the operator, which writes every condition and Event through
these enums (:meth:`adaptis.operator.core.passes.PassState.condition`), so that what ``kubectl
describe`` shows, what the tests wait for and what docs/shared-cluster.md names are one list.
Both are ``StrEnum``: a member is its string in the status, in an Event and in a comparison.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["ConditionType", "Reason"]


class ConditionType(StrEnum):
    """``status.conditions[].type``: what the operator observes of a job."""

    QUEUED = "Queued"
    PROFILING = "Profiling"
    PLANNED = "Planned"
    RUNNING = "Running"
    CONTAINERS_CREATED = "ContainersCreated"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    REPLANNED = "Replanned"
    REPLAN_SUGGESTED = "ReplanSuggested"


class Reason(StrEnum):
    """A condition's ``reason`` (CamelCase, as Kubernetes writes them), and an Event's."""

    # the spec and the job's lifecycle
    INVALID_SPEC = "InvalidSpec"
    SPEC_CHANGED = "SpecChanged"
    SUSPENDED = "Suspended"
    RESUMED = "Resumed"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
    COMPLETED = "Completed"
    # admission and the queue
    WAITING_FOR_CAPACITY = "WaitingForCapacity"
    BEHIND_STARVED_JOB = "BehindStarvedJob"
    ADMITTED = "Admitted"
    # profiling the nodes
    PROFILING_NODES = "ProfilingNodes"
    MEASURING_NODES = "MeasuringNodes"
    PROFILED = "Profiled"
    NODE_PROFILED = "NodeProfiled"
    PROFILING_FAILED = "ProfilingFailed"
    CREATED_PROFILER_PODS = "CreatedProfilerPods"
    # planning
    PLANNING = "Planning"
    PLANNED = "Planned"
    NODES_CHANGED = "NodesChanged"
    CAPACITY_LOST = "CapacityLost"
    UNSATISFIABLE = "Unsatisfiable"
    PLANNING_BUDGET_EXCEEDED = "PlanningBudgetExceeded"
    TIME_LIMIT_REACHED = "TimeLimitReached"
    BASELINE_FALLBACK = "BaselineFallback"
    PLAN_TOO_LARGE = "PlanTooLarge"
    PLANNER_ERROR = "PlannerError"
    CONFIG_MAP_NOT_FOUND = "ConfigMapNotFound"
    PLAN_RECORD_REJECTED = "PlanRecordRejected"
    CONFIG_MAP_RESTORED = "ConfigMapRestored"
    # the children and the gang
    CREATED_PODS = "CreatedPods"
    PODS_REJECTED = "PodsRejected"
    SERVICE_REJECTED = "ServiceRejected"
    CONFIG_MAP_REJECTED = "ConfigMapRejected"
    WAITING_FOR_ADMISSION = "WaitingForAdmission"
    STARTING = "Starting"
    CONTAINER_CREATING = "ContainerCreating"
    CONTAINER_CONFIG_ERROR = "ContainerConfigError"  # a Secret or ConfigMap (key) missing
    CREATE_CONTAINER_ERROR = "CreateContainerError"
    IMAGE_PULL_BACK_OFF = "ImagePullBackOff"
    INVALID_IMAGE_NAME = "InvalidImageName"
    CONTAINERS_STARTED = "ContainersStarted"
    ALL_RANKS_RUNNING = "AllRanksRunning"
    UNSCHEDULABLE = "Unschedulable"
    POD_FAILED = "PodFailed"
    POD_LOST = "PodLost"
    RESTARTING = "Restarting"
    RECOVERED = "Recovered"
    # adaptation
    NO_MEASUREMENT_SOURCE = "NoMeasurementSource"
    MEASUREMENT_UNAVAILABLE = "MeasurementUnavailable"
    NOT_WORTH_IT = "NotWorthIt"
    BETTER_PLAN = "BetterPlan"
    MAX_REPLANS_REACHED = "MaxReplansReached"
    REPLAN_FAILED = "ReplanFailed"
    DRIFT = "Drift"
    APPLIED = "Applied"
    REPLANNED = "Replanned"
