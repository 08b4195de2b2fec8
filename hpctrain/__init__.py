"""hpctrain: Slurm-native distributed training of transformer language models."""

__version__ = "0.1.0"


def _register_resolvers() -> None:
    # conf/cluster/slurm.yaml uses ${hpctrain.nodes:...}; submitit jobs unpickle the config
    # and resolve it again, so the resolvers must exist wherever hpctrain is imported.
    try:
        from hpctrain.launch.resolvers import register
    except ImportError:  # omegaconf missing: no Hydra entry point either
        return
    register()


_register_resolvers()
