"""metaseq-oneload: point at any file of a checkpoint; every rank gets its part.

Public API (everything else is private; docs/api.md describes each name's arguments)::

    inspect(path) -> CheckpointLayout            what a checkpoint is, from metadata only
    load_state_dict(path, ...) -> state dict     this rank's part of the weights (collective)
    load_checkpoint(path, ...)                   the same, with shard_metadata, layout, report
    load_into(module, path, ...)                 fill a plain, meta or FSDP2 module in place
    plan_load(path, world=W, ...) -> LoadPlan    what a load onto W ranks would do (metadata only)
    from_pretrained(model_cls, path, ...)        a Hugging Face model read once, sharded or not
    convert(path, dst, ...)                      rewrite a checkpoint in any layout, streaming
    consolidate(path, dst)                       one unflattened file
    verify(path, other)                          compare two checkpoints of any layouts (or one with a digest)
    digest(path) -> DigestReport                 the content digest of a checkpoint, any layout
    export_hf(path, dst)                         a metaseq checkpoint as a Hugging Face OPT folder
    install() / uninstall() / installed()        route metaseq's and fairseq's loading through the engine

Two public submodules hold the rest: :mod:`metaseq_oneload.hydra` (the ``oneload``
resolver, config group and settings filling) and :mod:`metaseq_oneload.hf` (building and
sharding Hugging Face models around a load).

Names load lazily: Hydra imports this package whenever its search-path plugin is
discovered, and that must not cost a torch import. Type checkers read the same names from
the ``typing.TYPE_CHECKING`` block below (tests/unit/test_packaging.py keeps it equal to
``_LAZY``).
"""

import importlib
import typing

from ._errors import (
    CheckpointLayoutError,
    CheckpointNotFoundError,
    ConversionError,
    DigestError,
    DistributedLoadError,
    MalformedCheckpointError,
    MissingRemoteExtraError,
    OneloadError,
    OptionError,
    OutOfResourcesError,
    OutputExistsError,
    RemoteObjectChangedError,
    RemoteStoreError,
    StateDictMismatchError,
    UnsafeCheckpointError,
    UnsupportedArchitectureError,
)

_LAZY = {
    "inspect": (".formats", "discover"),
    "CheckpointLayout": ("._layout", "CheckpointLayout"),
    "load_state_dict": ("._loading", "load_state_dict"),
    "load_checkpoint": ("._loading", "load_checkpoint"),
    "load_into": ("._loading", "load_into"),
    "LoadedCheckpoint": ("._loading", "LoadedCheckpoint"),
    "LoadReport": ("._loading", "LoadReport"),
    "plan_load": ("._loadplan", "plan_load"),
    "LoadPlan": ("._loadplan", "LoadPlan"),
    "from_pretrained": ("._hf", "from_pretrained"),
    "export_hf": ("._hf_export", "export_hf"),
    "HFExport": ("._hf_export", "HFExport"),
    "convert": ("._convert", "convert"),
    "consolidate": ("._convert", "consolidate"),
    "ConvertReport": ("._convert", "ConvertReport"),
    "verify": ("._verify", "verify"),
    "VerifyReport": ("._verify", "VerifyReport"),
    "TensorDiff": ("._verify", "TensorDiff"),
    "digest": ("._digest_verb", "digest"),
    "DigestReport": ("._digest_verb", "DigestReport"),
    "install": (".integrations", "install"),
    "uninstall": (".integrations", "uninstall"),
    "installed": (".integrations", "installed"),
}
# The public submodules, imported on first use (``metaseq_oneload.hydra.register_resolver``).
_SUBMODULES = ("hydra", "hf")

__all__ = sorted(_LAZY) + [
    "OneloadError",
    "CheckpointLayoutError",
    "CheckpointNotFoundError",
    "UnsafeCheckpointError",
    "StateDictMismatchError",
    "DistributedLoadError",
    "ConversionError",
    "OutputExistsError",
    "UnsupportedArchitectureError",
    "MalformedCheckpointError",
    "OptionError",
    "MissingRemoteExtraError",
    "RemoteStoreError",
    "RemoteObjectChangedError",
    "OutOfResourcesError",
    "DigestError",
]

# A literal: setup.cfg reads it (version = attr:) without importing the package.
__version__ = "0.1.0"

if typing.TYPE_CHECKING:  # what _LAZY loads at run time, spelled out for mypy and pyright
    from ._convert import ConvertReport, consolidate, convert
    from ._hf import from_pretrained
    from ._hf_export import HFExport, export_hf
    from ._layout import CheckpointLayout
    from .formats import discover as inspect
    from ._loading import LoadedCheckpoint, LoadReport, load_checkpoint, load_into, load_state_dict
    from ._loadplan import LoadPlan, plan_load
    from ._verify import TensorDiff, VerifyReport, verify
    from ._digest_verb import DigestReport, digest
    from .integrations import install, installed, uninstall

# Imported from a source checkout (the repository root first on sys.path), the package has
# no ``hydra_configs`` subpackage yet (an install maps the top-level folder there): register
# it, so Hydra's pkg:// search path finds the ``oneload`` group. Cheap: no torch, no Hydra.
from ._source_tree import source_tree_configs as _source_tree_configs  # noqa: E402
from ._signature import plain_signature as _plain_signature  # noqa: E402

_source_tree_configs()


def __getattr__(name: str) -> typing.Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)  # the import binds it here too
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'metaseq_oneload' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module, __name__), attr)
    _plain_signature(value)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))
