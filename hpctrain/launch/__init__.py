"""Starting rank processes: locally (spawn) or on Slurm (submitit, sbatch)."""
