"""What the nodes are: GPU labels read into node profiles, the profiler pods, the measuring
step of a pass and the stored measurements.
"""
