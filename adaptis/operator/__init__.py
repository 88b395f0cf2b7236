"""The operator layer: kopf handlers, node profiling, scheduling, manifests, status (needs
``[operator]``).

Rooms, top to bottom (docs/architecture.md; the import contracts in pyproject.toml hold it):
``control`` -> ``adaptation`` -> ``scheduling`` -> ``profiling`` -> ``resources`` | ``kube``
-> ``core``.
"""
