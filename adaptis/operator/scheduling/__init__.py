"""Deciding where a job runs: placement, admission onto free GPUs, the capacity ledger,
planning, the planner processes and the operator's copy of each plan.
"""
