"""task=dryrun: chosen ranks of a job set up for real on meta tensors in this process (`rank`),
their collectives counted per group (`comm`), and every term compared with the planner's (`run`).
Its settings: hpctrain.config.dryrun."""
