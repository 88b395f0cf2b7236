"""What every room of the operator shares: errors, label names, records, settings, the
state of one pass and its conditions. Imports nothing of the operator's.
"""
