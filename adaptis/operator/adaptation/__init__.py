"""Re-planning a running job from its workers' measurements: the loop and its Prometheus
reader (the only HTTP client outside the Kubernetes client).
"""
