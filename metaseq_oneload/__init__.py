"""metaseq-oneload: point at any file of a checkpoint; every rank gets its part.

Public API (everything else is private)::

    inspect(path) -> CheckpointLayout          what a checkpoint is, from metadata only
    load_state_dict(path, ...) -> state dict   this rank's part of the weights (collective)
    load_checkpoint(path, ...)                 the same, with shard_metadata, layout, report
    load_into(module, path, ...)               fill a plain, meta or FSDP2 module in place
    plan_load(path, world=W, ...) -> LoadPlan  what a load onto W ranks would do (metadata only)
    from_pretrained(model_cls, path, ...)      a Hugging Face model read once, sharded or not
    convert(src, dst_prefix, ...)              rewrite a checkpoint in any layout, streaming
    consolidate(src, dst) / verify(a, b)       one unflattened file / compare any two layouts
    install() / uninstall()                    route metaseq's loading through the engine
    register_resolver() / register_configs()   the ``oneload`` resolver and Hydra config group

Names load lazily: Hydra imports this package whenever its search-path plugin is
discovered, and that must not cost a torch import. Type checkers read the same names from
the ``typing.TYPE_CHECKING`` block below (tests/unit/test_packaging.py keeps it equal to
``_LAZY``).
"""

import importlib
import re
import sys
import typing

from ._errors import (
    CheckpointLayoutError,
    CheckpointNotFoundError,
    ConversionError,
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
    "empty_model": ("._hf", "empty_model"),
    "fully_shard_blocks": ("._hf", "fully_shard_blocks"),
    "fsdp1_param_init_fn": ("._hf", "fsdp1_param_init_fn"),
    "export_hf": ("._hf_export", "export_hf"),
    "HFExport": ("._hf_export", "HFExport"),
    "convert": ("._convert", "convert"),
    "consolidate": ("._convert", "consolidate"),
    "ConvertReport": ("._convert", "ConvertReport"),
    "verify": ("._verify", "verify"),
    "VerifyReport": ("._verify", "VerifyReport"),
    "TensorDiff": ("._verify", "TensorDiff"),
    "install": (".integrations", "install"),
    "uninstall": (".integrations", "uninstall"),
    "installed": (".integrations", "installed"),
    "activate": ("._startup", "activate"),
    "register_resolver": ("._hydra", "register_resolver"),
    "register_configs": ("._hydra", "register_configs"),
    "extend_schema": ("._hydra", "extend_schema"),
    "compose_oneload": ("._hydra", "compose_oneload"),
    "fill_settings": ("._hydra", "fill_settings"),
    "checkpoint_settings": ("._hydra", "checkpoint_settings"),
    "OneloadConfig": ("._hydra", "OneloadConfig"),
    "CheckpointSettingsError": ("._hydra", "CheckpointSettingsError"),
}

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
]

# A literal: setup.cfg reads it (version = attr:) without importing the package.
__version__ = "0.1.0"

if typing.TYPE_CHECKING:  # what _LAZY loads at run time, spelled out for mypy and pyright
    from ._convert import ConvertReport, consolidate, convert
    from ._hf import empty_model, fsdp1_param_init_fn, from_pretrained, fully_shard_blocks
    from ._hf_export import HFExport, export_hf
    from ._hydra import (CheckpointSettingsError, OneloadConfig, checkpoint_settings, compose_oneload,
                         extend_schema, fill_settings, register_configs, register_resolver)
    from ._layout import CheckpointLayout
    from .formats import discover as inspect
    from ._loading import LoadedCheckpoint, LoadReport, load_checkpoint, load_into, load_state_dict
    from ._loadplan import LoadPlan, plan_load
    from ._startup import activate
    from ._verify import TensorDiff, VerifyReport, verify
    from .integrations import install, installed, uninstall

# Imported from a source checkout (the repository root first on sys.path), the package has
# no ``hydra_configs`` subpackage yet (an install maps the top-level folder there): register
# it, so Hydra's pkg:// search path finds the ``oneload`` group. Cheap: no torch, no Hydra.
from ._hydra import source_tree_configs as _source_tree_configs  # noqa: E402

_source_tree_configs()


class _Text(str):
    """An annotation's source text, shown as written (``path: str | os.PathLike``)."""

    def __repr__(self) -> str:
        return str(self)


def _plain(annotation):
    if not isinstance(annotation, str):
        return annotation
    # Quotes inside a postponed annotation ("'str | os.PathLike'", Optional['dist.X']) are
    # for the interpreter only; help() would show them twice. Literal['x'] keeps its quotes.
    text = annotation.strip()
    if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    if "Literal[" not in text:
        text = _QUOTED_NAME.sub(r"\2", text)
    return _Text(text)


_QUOTED_NAME = re.compile(r"(['\"])([A-Za-z_][\w.]*)\1")


def _plain_signature(obj) -> None:
    """Give ``obj`` a ``__signature__`` whose annotations read as the source writes them:
    the modules use postponed annotations, which help() otherwise shows as quoted strings."""
    import inspect as _inspect
    import types

    if isinstance(obj, type):  # a class shows its own __init__'s (subclasses keep theirs)
        obj = obj.__dict__.get("__init__")
    if not isinstance(obj, types.FunctionType) or "__signature__" in obj.__dict__:
        return
    try:
        sig = _inspect.signature(obj)
    except (TypeError, ValueError):
        return
    params = [p.replace(annotation=_plain(p.annotation)) for p in sig.parameters.values()]
    obj.__signature__ = sig.replace(parameters=params, return_annotation=_plain(sig.return_annotation))


def __getattr__(name: str) -> typing.Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'metaseq_oneload' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module, __name__), attr)
    _plain_signature(value)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))
