"""hpctrain: Slurm-native distributed training of transformer language models.

Importing it has no side effects: the Hydra entry points (`python -m hpctrain`,
`hpctrain.launch.sbatch`) register the config schemas and OmegaConf resolvers themselves.
"""

__version__ = "0.1.0"
