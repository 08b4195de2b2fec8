"""Parallelism along the tensor, pipeline and data axes."""
