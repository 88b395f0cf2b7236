"""Training data: synthetic tokens, token files and local text corpora, by position."""
