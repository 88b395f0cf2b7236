"""From a job's model to torch modules: the block zoo (layers, MoE, SSM), stages, precision,
and Hugging Face models (``hf``). No ``torch.distributed``: a model is one process's.
"""
