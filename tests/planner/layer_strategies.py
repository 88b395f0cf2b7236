"""Hypothesis strategies for the planner's property tests: one layer's costs and sizes.

Shared by the memory-bound and memory-first tests, which draw problems short of memory from
the same layers (each test file sizes the devices its own way).
"""

from __future__ import annotations

from hypothesis import strategies as st

LAYER = st.fixed_dictionaries({
    "forward": st.floats(min_value=0.05, max_value=5.0),
    "backward": st.floats(min_value=0.0, max_value=5.0),
    "weight": st.floats(min_value=0.0, max_value=3.0),
    "activation_bytes": st.floats(min_value=1e6, max_value=2e9),
    "param_bytes": st.one_of(st.just(0.0), st.floats(min_value=1e6, max_value=1e9)),
    "output_bytes": st.floats(min_value=1e6, max_value=5e8),
})
