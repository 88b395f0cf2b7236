"""One rank's whole run and the local launcher: the run loop, its metrics server and the
graceful stop.
"""
