"""The operator layer: kopf handlers, node profiling, manifests, status (needs ``[operator]``)."""
