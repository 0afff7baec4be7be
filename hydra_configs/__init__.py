"""The ``oneload`` Hydra config group, installed as ``metaseq_oneload.hydra_configs``."""
