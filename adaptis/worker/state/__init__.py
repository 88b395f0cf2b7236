"""What survives a rank: checkpoints by parameter name, named optimizer state, and a Hugging
Face job's export.
"""
