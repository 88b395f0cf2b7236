"""The planner layer: pure Python. Costs, performance model, baseline schedules, joint search."""
