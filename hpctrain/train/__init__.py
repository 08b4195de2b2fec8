"""Training loop, step, optimizer, checkpointing (layer: above data/metrics, below plan/bench)."""
