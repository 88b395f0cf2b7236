"""AdaPtis: adaptive pipeline parallelism for heterogeneous models, as a Kubernetes operator.

Layers (dependencies point down only; checked by import-linter in tests/test_layers.py):

    adaptis.cli                      command line (configures logging once)
    adaptis.operator | adaptis.worker   kopf reconciler | torch executor
    adaptis.planner                  costs, performance model, baselines, joint search (pure)
    adaptis.api                      pydantic models: problem, plan, AdaPtisJob (pure)
"""

__version__ = "0.1.0"
