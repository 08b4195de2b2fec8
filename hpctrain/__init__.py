"""hpctrain: Slurm-native distributed training of transformer language models."""

__version__ = "0.1.0"
