"""Data pipelines: corpora, tokenization, padding, length-bucketed sampling, packing, images."""
