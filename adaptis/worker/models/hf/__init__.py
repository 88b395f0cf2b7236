"""Hugging Face transformers models as pipeline stages, and their local weights."""
