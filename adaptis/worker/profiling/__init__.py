"""Measuring layers and devices into a planning problem: the layer profilers, module and
optimizer timing, co-runners, the hardware profiler and a job's problem.
"""
