"""The training loop: set-up of a rank, the step's feed, optimizer and LR schedules, the pipeline
and tensor-parallel steps, eval during training, what a run leaves behind (layer: above data,
metrics and checkpoint, below bench and plan)."""
