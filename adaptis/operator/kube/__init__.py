"""The Kubernetes API: the :class:`~adaptis.operator.kube.cluster.Cluster` protocol every room
talks to, its HTTP client, and what a refused create means for a job.
"""
