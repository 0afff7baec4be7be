"""The tests import metaseq_oneload from the source tree (the repository root is first on
sys.path under pytest), where the ``oneload`` group is the top-level ``hydra_configs/``
folder, not yet ``metaseq_oneload.hydra_configs`` as an install (wheel or strict editable)
provides it. Make it importable under that name, as Hydra's ``pkg://`` search path needs."""

from metaseq_oneload._hydra import source_tree_configs

source_tree_configs()
