"""The worker layer: torch models, stages, executor, profiler, metrics (needs ``[worker]``).

Rooms, top to bottom (docs/architecture.md; the import contracts in pyproject.toml hold it):
``run`` | ``testing`` -> ``state`` | ``profiling`` -> ``runtime`` -> ``models`` | ``data``
-> ``errors``.
"""
