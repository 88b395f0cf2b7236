"""The operator process and its control loop: kopf handlers, the work queue, the reconciler,
the operator's metrics. The top room: the only one that imports kopf.
"""
