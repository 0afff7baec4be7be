"""Helpers for building and sharding Hugging Face models around a load (docs/huggingface.md).

    empty_model(model_cls, path=None, ...)   the model on ``meta``, config read once (collective)
    fully_shard_blocks(**fully_shard_kw)     an ``fsdp=`` for from_pretrained: FSDP2 per block, then the root
    fsdp1_param_init_fn(model, device)       FSDP1's ``param_init_fn`` that keeps tied weights tied

The verb itself, :func:`metaseq_oneload.from_pretrained`, and the OPT export,
:func:`metaseq_oneload.export_hf`, are top-level names. Importing this module imports torch
(transformers only when a model is built).
"""

from ._hf import empty_model, fsdp1_param_init_fn, fully_shard_blocks
from ._signature import plain_signature

__all__ = ["empty_model", "fully_shard_blocks", "fsdp1_param_init_fn"]

# _hf's annotations are postponed (strings): help() shows them as the source writes them.
for _name in __all__:
    plain_signature(globals()[_name])
del _name
