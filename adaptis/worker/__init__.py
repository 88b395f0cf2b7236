"""The worker layer: torch models, stages, executor, profiler, metrics (needs ``[worker]``)."""
