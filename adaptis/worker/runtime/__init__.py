"""One rank's training step: the executor, the adapter over torch's pipelining runtime, the
action timers, data-parallel replicas, weight ownership and the learning-rate schedule.
"""
