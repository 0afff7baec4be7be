"""The ``oneload`` Hydra config group, installed as ``metaseq_oneload.hydra_configs``.

Every option starts from the schema ``oneload_schema`` in Hydra's ConfigStore. The
search-path plugin stores it whenever a Hydra app starts; this import stores it too, for a
search path set up without the plugin. Only where Hydra is loaded already: a source
checkout imports this package with ``metaseq_oneload`` itself, which must stay cheap.
"""

import sys

if "hydra" in sys.modules:
    from metaseq_oneload._hydra import register_schema

    register_schema()
