"""The objects the operator writes, as pure functions of plain data: manifests, pod security,
Kueue's labels, a Hugging Face config's volume, status arithmetic and job validation.
"""
