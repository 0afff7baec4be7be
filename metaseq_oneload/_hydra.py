"""The Hydra/OmegaConf side: the ``oneload`` resolver, the ``oneload`` config group's
schema, and metaseq's loading settings filled from the files.

Three things live here, none of which needs metaseq:

* :func:`register_resolver` registers ``${oneload:KEY,PATH}``, so any config can say
  ``model_parallel_size: ${oneload:model_parallel_size,${checkpoint.restore_file}}``. It
  reads the checkpoint through layout discovery (file names and pickled headers, never
  tensor data), cached per path.
* :class:`OneloadConfig` is the schema of the ``oneload`` group (``hydra_configs/oneload``);
  :func:`extend_schema` adds an optional ``oneload`` node to a structured config such as
  metaseq's ``MetaseqConfig``, so ``+oneload=auto`` composes onto it in struct mode, and
  :func:`compose_oneload` composes the group on its own (what the start-up hook does).
* :func:`fill_settings` writes ``common.model_parallel_size``,
  ``checkpoint.checkpoint_shard_count``, ``distributed_training.use_sharded_state`` and
  ``distributed_training.ddp_backend`` from the files into a metaseq-shaped config where
  the user left them; what the user gave is kept where it is the run's choice (its
  model-parallel size, its backend, how it saves: the engine reshards on load), and is a
  :class:`CheckpointSettingsError` where it contradicts how the files must be read.

The public ones among these names are :mod:`metaseq_oneload.hydra`'s; the rest serve the
start-up hook (argv handling), the integrations and the plugin. Config dataclasses use
``typing.Optional``, not ``X | None``: omegaconf 2.1 (metaseq's pin) rejects PEP 604 unions. Nothing here imports torch at module level; the layout discovery it
calls does, when a checkpoint is actually read.
"""

import contextlib
import dataclasses
import enum
import functools
import os
import re
import shlex
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from ._errors import CheckpointNotFoundError, OneloadError
from ._source_tree import CONFIG_MODULE, source_tree_configs

__all__ = [
    "RESOLVER",
    "STRATEGIES",
    "OneloadSchema",
    "OneloadStrategy",
    "register_schema",
    "SETTINGS",
    "OneloadConfig",
    "CheckpointSettingsError",
    "register_resolver",
    "resolve",
    "checkpoint_settings",
    "checkpoint_path",
    "fill_settings",
    "extend_schema",
    "register_configs",
    "compose_oneload",
    "to_config",
    "split_argv",
    "explicit_settings",
    "activation_overrides",
]

RESOLVER = "oneload"
# "off" composes but leaves metaseq's own loading untouched (install() is not called).
STRATEGIES = ("auto", "own_shard", "reshard", "broadcast", "parallel", "off")
ENV = "METASEQ_ONELOAD"


class CheckpointSettingsError(OneloadError, ValueError):
    """A loading setting the user gave (flag, override or config value) contradicts what the
    checkpoint's files hold, or what the run itself needs."""


@dataclass
class OneloadConfig:
    """The ``oneload`` config group: how metaseq/fairseq checkpoints are loaded once
    :func:`metaseq_oneload.install` has patched the loading path."""

    # auto: each rank reads its own file when the saved layout matches the world, else the
    # byte ranges it needs, and bytes several ranks need are read once and exchanged
    # (parallel); own_shard / reshard / broadcast / parallel force one (own_shard also refuses
    # a given model-parallel size or backend the files do not have, reshard lets a given
    # checkpoint_shard_count win over the files'); off: leave metaseq's loading alone.
    strategy: str = "auto"
    # The checkpoint the settings are read from (and ${oneload:KEY}'s default path); the
    # weights still come from where the app loads them. None: that same checkpoint
    # (common_eval.path, else checkpoint.restore_file in checkpoint.save_dir, else
    # checkpoint.finetune_from_model). A folder, any file of the set or the un-suffixed name.
    path: Optional[str] = None
    # true: also compare what was loaded with torch's own reading of the files (one more
    # read); "digest": check the bytes read against the content digests the set's index
    # records (docs/digest.md); false: neither.
    verify: Union[bool, str] = False
    # Broadcast bucket size in MiB: the peak extra memory on every rank when broadcasting.
    bucket_mb: float = 256.0
    # Fill model_parallel_size, checkpoint_shard_count, use_sharded_state and ddp_backend
    # from the files when the user left them at metaseq's defaults (values the user gave
    # are the run's choices, loaded onto; see fill_settings). False: leave the config as given.
    fill_cfg: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.strategy, enum.Enum):  # as composed through OneloadSchema
            self.strategy = self.strategy.value
        if self.strategy not in STRATEGIES:
            hint = ""
            if str(self.strategy).lower() in ("false", "true"):
                hint = ' (unquoted off/on in YAML is a boolean: write strategy: "off")'
            raise ValueError(f"oneload.strategy={self.strategy!r}: expected one of {', '.join(STRATEGIES)}{hint}.")
        if self.path is not None and (not isinstance(self.path, str) or not self.path.strip()):
            raise ValueError(f"oneload.path={self.path!r}: expected a checkpoint path or null.")
        if isinstance(self.bucket_mb, bool) or not isinstance(self.bucket_mb, (int, float)) or not self.bucket_mb > 0:
            raise ValueError(f"oneload.bucket_mb={self.bucket_mb!r}: expected a positive number of MiB.")
        if not isinstance(self.verify, bool) and self.verify != "digest":
            raise ValueError(f"oneload.verify={self.verify!r}: expected true, false or digest.")
        if not isinstance(self.fill_cfg, bool):
            raise ValueError(f"oneload.fill_cfg={self.fill_cfg!r}: expected true or false.")

    @property
    def enabled(self) -> bool:
        return self.strategy != "off"


# The values of oneload.strategy as an Enum, for OmegaConf: a composed value outside them is
# refused by Hydra at compose time, naming the allowed ones. A str Enum, so that an app
# reading cfg.oneload.strategy can still compare it with "broadcast".
OneloadStrategy = enum.Enum("OneloadStrategy", [(s, s) for s in STRATEGIES], type=str, module=__name__)
OneloadStrategy.__str__ = lambda self: self.value  # f"{strategy}" reads "auto", as in the YAML


def _schema_field(f: "dataclasses.Field") -> tuple:
    if f.name == "strategy":
        return f.name, OneloadStrategy, field(default=OneloadStrategy(f.default))
    if f.name == "verify":
        # true, false or "digest": OmegaConf has no bool-or-str node, so the value composes
        # untyped and OneloadConfig's __post_init__ refuses anything else in to_config.
        return f.name, Any, field(default=f.default)
    return f.name, f.type, field(default=f.default)


# The group's schema as Hydra sees it: OneloadConfig's fields, types and defaults (derived,
# so the two cannot drift), with strategy an Enum. OmegaConf checks types and allowed values
# wherever the group is composed (the group's YAML pulls it in, see register_schema);
# OneloadConfig's __post_init__ checks the rest (bucket_mb > 0) in to_config.
OneloadSchema = dataclasses.make_dataclass(
    "OneloadSchema", [_schema_field(f) for f in dataclasses.fields(OneloadConfig)])
OneloadSchema.__module__ = __name__  # make_dataclass(module=) is Python 3.12+
OneloadSchema.__doc__ = "The typed node of the ``oneload`` group (fields as in :class:`OneloadConfig`)."
# The ConfigStore name the group's YAML files list first in their defaults.
SCHEMA_NAME = "oneload_schema"


def register_schema() -> None:
    """(any rank, local) Store :data:`OneloadSchema` in Hydra's ConfigStore as
    ``oneload_schema``, which every option of the ``oneload`` group starts from, so that its
    values are type-checked in any app, YAML or structured. Idempotent. Called when Hydra
    imports the group's package (``metaseq_oneload.hydra_configs``), and by
    :func:`register_configs`."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    if cs.repo.get(f"{SCHEMA_NAME}.yaml") is None:
        cs.store(name=SCHEMA_NAME, node=OneloadSchema)


def to_config(node: Any) -> OneloadConfig:
    """(local) A checked :class:`OneloadConfig` from a composed ``oneload`` node, a mapping,
    an existing config or None (the defaults)."""
    if node is None:
        return OneloadConfig()
    if isinstance(node, OneloadConfig):
        return node
    from omegaconf import DictConfig, OmegaConf

    data = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    data = {k: v.value if isinstance(v, enum.Enum) else v for k, v in data.items()}
    known = {f.name for f in dataclasses.fields(OneloadConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"oneload: unknown key(s) {', '.join(unknown)}; expected {', '.join(sorted(known))}.")
    return OneloadConfig(**data)


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Setting:
    """One metaseq loading setting: where it lives in the config and on the command line."""

    name: str  # the key in checkpoint_settings() and the resolver
    key: str  # dotted key in a metaseq config
    flag: str  # metaseq's command-line flag
    default: Any  # metaseq's default (a value equal to it counts as not given)


# ddp_backend before use_sharded_state: sharded state is only filled in where the backend
# ends up fully_sharded.
SETTINGS = (
    Setting("model_parallel_size", "common.model_parallel_size", "--model-parallel-size", 1),
    Setting("checkpoint_shard_count", "checkpoint.checkpoint_shard_count", "--checkpoint-shard-count", 1),
    Setting("ddp_backend", "distributed_training.ddp_backend", "--ddp-backend", "pytorch_ddp"),
    Setting("use_sharded_state", "distributed_training.use_sharded_state", "--use-sharded-state", False),
)


def checkpoint_settings(layout) -> Dict[str, Any]:
    """(local) What the files of ``layout`` say, under the resolver's keys.

    ``ddp_backend`` is ``"fully_sharded"`` for FSDP-sharded files (nothing else loads them
    natively) and None otherwise (any backend loads unflattened weights). fairseq's
    ``X_partK.pt`` sets are consolidated while loading, so they give
    ``checkpoint_shard_count=K`` and ``use_sharded_state=False``.
    """
    fairseq_parts = layout.name.shard_style == "_part" and layout.name.shard is not None
    sharded = layout.use_sharded_state and not fairseq_parts
    return {
        "model_parallel_size": layout.model_parallel_size,
        "checkpoint_shard_count": layout.shards_per_part if fairseq_parts else 1,
        "use_sharded_state": sharded,
        "ddp_backend": "fully_sharded" if sharded else None,
        "world_size": layout.saved_world_size,
        "kind": layout.kind,
        "shards_per_part": layout.shards_per_part,
        "flat": layout.flat,
        "num_updates": layout.num_updates,
        "path": layout.all_files[0].path,
    }


def _describe(layout) -> str:
    """What the files are, for error messages: 'checkpoint_2-model_part-{0,1}-shard{0,1}.pt (2 x 2, flat)'."""
    name = layout.name
    label = name.prefix
    if name.part is not None:
        label += "-model_part-" + ("{0..%d}" % (layout.model_parallel_size - 1) if layout.model_parallel_size > 1 else "0")
    if name.shard is not None:
        label += name.shard_style + ("{0..%d}" % (layout.shards_per_part - 1) if layout.shards_per_part > 1 else "0")
    return os.path.join(layout.directory, label + ".pt")


def _get(cfg: Any, dotted: str) -> Tuple[Any, str, bool]:
    """(section node, leaf name, present) for a dotted key of a DictConfig, dict or Namespace."""
    *path, leaf = dotted.split(".")
    node = cfg
    for p in path:
        node = node.get(p) if isinstance(node, Mapping) else getattr(node, p, None)
        if node is None:
            return None, leaf, False
    present = leaf in node if isinstance(node, Mapping) else hasattr(node, leaf)
    return node, leaf, present


def _value(node: Any, leaf: str) -> Any:
    return node[leaf] if isinstance(node, Mapping) else getattr(node, leaf)


# What a run chooses rather than needs for loading: a value the user gave is honoured (the
# engine reshards onto it), a default takes the files'. checkpoint_shard_count only says how
# to read fairseq's _partK files, so a given value must match them.
_CHOICES = frozenset({"model_parallel_size", "ddp_backend", "use_sharded_state"})


def fill_settings(
    cfg: Any,
    layout,
    *,
    explicit: Iterable[str] = (),
    strategy: str = "auto",
    requires: Optional[Mapping[str, Tuple[Any, str]]] = None,
    kept: Optional[List[Tuple[str, Any, Any]]] = None,
) -> List[Tuple[str, Any, Any]]:
    """(local) Write the files' loading settings into a metaseq-shaped config, in place.

    A setting still at metaseq's default, and not named in ``explicit`` (dotted keys or
    flags the user typed), takes the files' value. A value the user gave is the run's
    choice where the engine can load onto it (``model_parallel_size``, ``ddp_backend``,
    ``use_sharded_state``: the weights and optimizer state are resharded on load) and is
    kept, except with ``strategy="own_shard"``, which reads the files as they are; a given
    ``checkpoint_shard_count`` must match the files unless ``strategy="reshard"``.
    ``use_sharded_state`` of unflattened weights is left alone (it only decides how the
    run saves), as are sections the config does not have. ``requires`` (what the run's
    model needs to be built, as (value, why)) comes first: metaseq's model-parallel
    transformer asserts ``use_sharded_state``.

    Args:
        cfg: a metaseq config (DictConfig, dict or argparse.Namespace sections).
        layout: the checkpoint the run loads (:func:`metaseq_oneload.inspect`).
        explicit: the settings the user gave, as dotted keys or flags.
        strategy: the ``oneload.strategy`` in effect.
        requires: setting name -> (value, why) that the run itself needs.
        kept: if given, receives each given value kept against the files, as (dotted key,
            the run's value, the files' value).

    Returns:
        The changes made, as (dotted key, old value, new value).

    Raises:
        CheckpointSettingsError: naming the setting, what the files hold and what the run
            asked for.
    """
    files = checkpoint_settings(layout)
    # Unflattened weights load under any backend and either use_sharded_state (which then
    # only decides how the run saves): the files constrain those two only when FSDP-sharded.
    files["use_sharded_state"] = True if files["use_sharded_state"] else None
    requires = dict(requires or {})
    explicit = set(explicit)
    changes = []
    for s in SETTINGS:
        node, leaf, present = _get(cfg, s.key)
        if not present:
            continue
        have = _value(node, leaf)
        given = s.key in explicit or s.flag in explicit or have != s.default
        if s.name in requires:
            want, why = requires[s.name]
            if have == want:
                continue
            if given:
                raise CheckpointSettingsError(
                    f"{s.key}={have} ({s.flag}): {why}, so this run needs {s.name}={want}; the files "
                    f"({_describe(layout)}) hold {_files_hold(s.name, files[s.name], layout)}. Drop the "
                    f"setting (metaseq-oneload sets it) or give {s.flag}."
                )
        else:
            want = files[s.name]
            if want is None or have == want:
                continue
            if given:
                if (s.name in _CHOICES and strategy != "own_shard") or strategy == "reshard":
                    if kept is not None:
                        kept.append((s.key, have, want))
                    continue
                if strategy == "own_shard":
                    raise CheckpointSettingsError(
                        f"{s.flag} {have} ({s.key}): oneload.strategy=own_shard reads the files as they are, and "
                        f"{_describe(layout)} hold {s.name}={want}{_why(s.name, layout)}. Drop {s.flag} to take "
                        f"the files' value, or use oneload.strategy=auto to load onto {s.name}={have}."
                    )
                raise CheckpointSettingsError(
                    f"{s.flag} {have} ({s.key}) contradicts {_describe(layout)}: the files hold "
                    f"{s.name}={want}{_why(s.name, layout)}. Drop {s.flag} to take the files' value, or "
                    f"pass oneload.strategy=reshard to load onto {s.name}={have} anyway."
                )
            if s.name == "use_sharded_state" and want:
                backend_node, backend_leaf, backend_present = _get(cfg, "distributed_training.ddp_backend")
                if backend_present and _value(backend_node, backend_leaf) != "fully_sharded":
                    continue  # the run's own backend (not FSDP) cannot save sharded state
        if isinstance(node, Mapping):
            node[leaf] = want
        else:
            setattr(node, leaf, want)
        _set_mirrors(cfg, leaf, have, want)
        changes.append((s.key, have, want))
    return changes


def _files_hold(name: str, value: Any, layout) -> str:
    if value is None:
        return "unflattened weights, which load either way"
    return f"{name}={value}{_why(name, layout)}"


def _set_mirrors(cfg: Any, leaf: str, old: Any, new: Any) -> None:
    """metaseq keeps a flat argparse.Namespace of every option in cfg.model, cfg.criterion,
    ... (the model reads use_sharded_state there): update those copies too."""
    import argparse

    sections = cfg.values() if isinstance(cfg, Mapping) else vars(cfg).values()
    for node in sections:
        if isinstance(node, argparse.Namespace) and getattr(node, leaf, _NO_DEFAULT) == old:
            setattr(node, leaf, new)


def _why(name: str, layout) -> str:
    if name == "model_parallel_size":
        return f" ({layout.model_parallel_size} model-parallel part(s))"
    if name in ("use_sharded_state", "ddp_backend"):
        return (f" (FSDP shards, {layout.shards_per_part} per part)" if layout.use_sharded_state
                else " (unflattened weights)")
    if name == "checkpoint_shard_count":
        return f" ({layout.shards_per_part} _part file(s))" if layout.name.shard_style == "_part" else " (no _part files)"
    return ""


def _split_paths(paths: str) -> List[str]:
    # metaseq.utils.split_paths: os.pathsep separates an ensemble, except in URLs.
    return [p for p in (paths.split("|") if "://" in paths else paths.split(os.pathsep)) if p]


def checkpoint_path(cfg: Any, path: Optional[str] = None) -> Optional[str]:
    """(local) The checkpoint a metaseq run would load, as metaseq picks it: ``path`` if
    given, else ``common_eval.path`` (evaluation; the first of an ensemble), else
    ``checkpoint.restore_file`` (the default ``checkpoint_last.pt`` is looked for in
    ``checkpoint.save_dir``), else ``checkpoint.finetune_from_model`` when there is nothing
    to restore. None when there is no checkpoint yet (a first launch)."""
    from .formats import discover

    def exists(p: str) -> bool:
        try:
            discover(p)
        except CheckpointNotFoundError:
            return False
        return True

    if path:
        return path
    node, leaf, present = _get(cfg, "common_eval.path")
    if present and _value(node, leaf):
        return _split_paths(str(_value(node, leaf)))[0]
    node, _, present = _get(cfg, "checkpoint.restore_file")
    if not present:
        return None
    restore = node.get("restore_file") if isinstance(node, Mapping) else getattr(node, "restore_file", None)
    save_dir = (node.get("save_dir") if isinstance(node, Mapping) else getattr(node, "save_dir", None)) or "."
    finetune = node.get("finetune_from_model") if isinstance(node, Mapping) else getattr(node, "finetune_from_model", None)
    if restore and restore != "checkpoint_last.pt":
        return restore
    last = os.path.join(save_dir, restore or "checkpoint_last.pt")
    if exists(last):
        return last
    return finetune or None


# --------------------------------------------------------------------------- resolver

_CACHE: Dict[tuple, Any] = {}
_CACHE_LOCK = threading.Lock()
_NO_DEFAULT = object()


def _dir_stamp(path: str) -> int:
    """Changes whenever a file is added, removed or re-linked in the checkpoint's folder."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    try:
        return os.stat(folder).st_mtime_ns
    except OSError:
        return -1


def _settings_for(path: str) -> Dict[str, Any]:
    from .formats import discover

    key = (os.path.abspath(path), _dir_stamp(path))
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
    if hit is None:
        hit = checkpoint_settings(discover(path))
        with _CACHE_LOCK:
            _CACHE[key] = hit
    return hit


_RESOLVER_KEYS = ("model_parallel_size", "checkpoint_shard_count", "use_sharded_state", "ddp_backend",
                  "world_size", "kind", "shards_per_part", "flat", "num_updates", "path")


def resolve(key: str, path: Optional[str] = None, default: Any = _NO_DEFAULT) -> Any:
    """(local) The value of ``${oneload:KEY,PATH[,DEFAULT]}``.

    Args:
        key: one of model_parallel_size, checkpoint_shard_count, use_sharded_state,
            ddp_backend, world_size, kind, shards_per_part, flat, num_updates, path.
        path: any file of the checkpoint, its folder, or its un-suffixed name.
        default: returned when nothing is at ``path`` (a first launch), and for a key the
            files leave open (``ddp_backend`` of unflattened weights is None: any backend
            loads them); without it a missing checkpoint is an error. A damaged checkpoint
            is an error either way.

    Raises:
        KeyError: an unknown key. CheckpointNotFoundError, CheckpointLayoutError: see inspect.
    """
    if key not in _RESOLVER_KEYS:
        raise KeyError(f"${{{RESOLVER}:{key},...}}: unknown key {key!r}; expected one of {', '.join(_RESOLVER_KEYS)}.")
    if path is None or str(path).strip() == "":
        raise ValueError(
            f"${{{RESOLVER}:{key}}}: no checkpoint path: write ${{{RESOLVER}:{key},PATH}} or set oneload.path."
        )
    try:
        value = _settings_for(str(path))[key]
    except CheckpointNotFoundError:
        if default is _NO_DEFAULT:
            raise
        return default
    # None means "the files do not constrain it": a typed field (ddp_backend: str) takes the
    # default the config gave rather than failing validation on null.
    return default if value is None and default is not _NO_DEFAULT else value


def _resolver(key: str, path: Optional[str] = None, default: Any = _NO_DEFAULT, *, _root_: Any = None) -> Any:
    if path is None and _root_ is not None:
        node, leaf, present = _get(_root_, "oneload.path")
        path = _value(node, leaf) if present else None
    return resolve(key, path, default)


def register_resolver() -> bool:
    """(any rank, local) Register ``${oneload:...}`` with OmegaConf; a no-op when a resolver
    of that name exists already. Returns whether this call registered it."""
    from omegaconf import OmegaConf

    if OmegaConf.has_resolver(RESOLVER):
        return False
    OmegaConf.register_new_resolver(RESOLVER, _resolver)
    return True


def clear_cache() -> None:
    """(local) Forget every checkpoint the resolver has read."""
    with _CACHE_LOCK:
        _CACHE.clear()


# --------------------------------------------------------------------------- schema


@functools.lru_cache(maxsize=None)
def extend_schema(base: type) -> type:
    """(local) ``base`` (a structured-config dataclass such as metaseq's ``MetaseqConfig``)
    plus an optional ``oneload: OneloadSchema`` node, so that ``+oneload=...`` composes onto
    it in struct mode and ``oneload.*`` overrides are type-checked (``strategy`` against its
    allowed values). Cached: the same base always gives the same class."""
    if dataclasses.is_dataclass(base) and "oneload" in {f.name for f in dataclasses.fields(base)}:
        return base
    return dataclasses.make_dataclass(
        f"{base.__name__}WithOneload",
        [("oneload", Optional[OneloadSchema], field(default=None))],
        bases=(base,),
    )


@dataclass
class _Root:
    """The primary config :func:`compose_oneload` uses: nothing but the ``oneload`` node."""


_ROOT_NAME = "_metaseq_oneload_root"


def register_configs(base: Optional[type] = None, name: str = "base_config") -> None:
    """(any rank, local) Store ``base`` + ``oneload`` in Hydra's ConfigStore under ``name``
    (metaseq stores its ``MetaseqConfig`` as ``base_config``), replacing what is there, and
    register the resolver. Idempotent."""
    from hydra.core.config_store import ConfigStore

    register_resolver()
    register_schema()
    cs = ConfigStore.instance()
    cs.store(name=_ROOT_NAME, node=extend_schema(_Root))
    if base is not None:
        cs.store(name=name, node=extend_schema(base))


@contextlib.contextmanager
def _initialize(config_module: str):
    """hydra.initialize_config_module, with version_base=None (this Hydra's own defaults,
    no upgrade warnings) where Hydra has the argument (>= 1.2). Hydra keeps version_base
    process-wide after the block; it is put back, because fairseq 0.12.2
    (``convert_namespace_to_omegaconf``) calls ``hydra.experimental.initialize``, which
    raises once it is >= 1.2."""
    import inspect as _inspect

    from hydra import initialize_config_module

    try:
        from hydra.version import VersionBase
    except ImportError:  # Hydra < 1.2: no version_base
        VersionBase = None
    instance = VersionBase.instance() if VersionBase is not None else None
    saved = instance.version_base if instance is not None else None
    try:
        if "version_base" in _inspect.signature(initialize_config_module).parameters:
            context = initialize_config_module(config_module=config_module, version_base=None)
        else:
            context = initialize_config_module(config_module=config_module)
        with context:
            yield
    finally:
        if instance is not None:
            instance.version_base = saved


def compose_oneload(overrides: Sequence[str]) -> OneloadConfig:
    """(any rank, local) Compose the ``oneload`` group with Hydra, exactly as a Hydra app
    would, and return the checked config.

    Args:
        overrides: Hydra overrides, e.g. ``["+oneload=auto", "oneload.strategy=broadcast"]``.

    Raises:
        hydra.errors.ConfigCompositionException (or another Hydra error): an unknown option,
            a typo such as ``oneload.bogus=1``, a value of the wrong type
            (``oneload.bucket_mb=abc``) or outside the allowed ones (``oneload.strategy=fast``).
        ValueError: a value the schema's checks refuse (e.g. ``oneload.bucket_mb=0``).
    """
    from hydra import compose as hydra_compose

    source_tree_configs()
    register_configs()
    overrides = list(overrides)
    if not any(_GROUP_TOKEN.match(o) for o in overrides):
        overrides.insert(0, "+oneload=auto")
    from hydra.errors import ConfigCompositionException

    with _initialize(CONFIG_MODULE):
        try:
            cfg = hydra_compose(config_name=_ROOT_NAME, overrides=overrides)
        except ConfigCompositionException as e:
            # Hydra says which override failed and keeps why in the cause; callers print
            # str(e) (the start-up hook's warning), so carry both in one message.
            if type(e) is not ConfigCompositionException or e.__cause__ is None:
                raise
            raise ConfigCompositionException(f"{e}: {e.__cause__}") from e.__cause__
    return to_config(cfg.oneload)


# --------------------------------------------------------------------------- argv

# Hydra override syntax for the group (+oneload=NAME) and its fields (oneload.KEY=VALUE,
# +oneload.KEY=..., ++oneload.KEY=..., ~oneload.KEY, ~oneload.KEY=VALUE). Only overrides: a
# bare "oneload" or "oneload.bin" is an argument of the program (a --save-dir value, a file).
_GROUP_TOKEN = re.compile(r"^\+{1,2}oneload=")
_KEY = r"(?:\.[A-Za-z_][\w.]*)?"
_TOKEN = re.compile(rf"^(?:\+{{0,2}}oneload{_KEY}=|~oneload{_KEY}(?:=|$))")
_FLAGS = {s.flag: s.key for s in SETTINGS}
_KEYS = {s.key for s in SETTINGS}


def split_argv(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(local) ``argv`` without its ``oneload`` overrides, and those overrides in order."""
    kept, tokens = [], []
    for a in argv:
        (tokens if isinstance(a, str) and _TOKEN.match(a) else kept).append(a)
    return kept, tokens


def _flag_key(option: str, options: Optional[Iterable[str]]) -> Optional[str]:
    """The setting an option string names, as argparse (``allow_abbrev``) resolves it: the
    exact flag, or a prefix of exactly one of our flags that is not itself another option.
    ``options``: every option string of the real parser, when known; without it, an
    abbreviation that argparse would find ambiguous makes the program stop there anyway."""
    if option in _FLAGS:
        return _FLAGS[option]
    if not option.startswith("--") or len(option) < 3:
        return None
    if options is not None and option in options:
        return None  # another option's exact name
    matches = [f for f in _FLAGS if f.startswith(option)]
    if len(matches) != 1:
        return None
    if options is not None and sum(1 for o in options if o.startswith(option)) > 1:
        return None  # ambiguous in the real parser: argparse refuses it
    return _FLAGS[matches[0]]


def explicit_settings(argv: Sequence[str], options: Optional[Iterable[str]] = None) -> FrozenSet[str]:
    """(local) The dotted keys of the loading settings that ``argv`` sets, as metaseq flags
    (``--model-parallel-size 2``, ``--use-sharded-state``, ``--ddp-backend=fully_sharded``,
    also abbreviated as argparse allows: ``--model-parallel 2``) or Hydra overrides
    (``common.model_parallel_size=2``). ``options``: the parser's option strings, if known."""
    options = frozenset(options) if options is not None else None
    found = set()
    for a in argv:
        if a == "--":
            break  # the rest is positional
        flag = a.split("=", 1)[0]
        key = _flag_key(flag, options)
        if key is not None:
            found.add(key)
        key = flag.lstrip("+")
        if "=" in a and key in _KEYS:
            found.add(key)
    return frozenset(found)


# METASEQ_ONELOAD values that read as a switch rather than an option name.
_ENV_ON = ("1", "true", "yes", "on")
_ENV_OFF = ("0", "false", "no")


def activation_overrides(argv: Sequence[str], environ: Mapping[str, str]) -> Optional[List[str]]:
    """(local) The Hydra overrides that turn metaseq-oneload on, or None when neither a
    ``+oneload=NAME`` token in ``argv`` nor ``METASEQ_ONELOAD`` asks for it.

    ``METASEQ_ONELOAD="NAME [oneload.KEY=VALUE ...]"`` selects the option (and overrides)
    when the command line does not; ``oneload.*`` tokens on the command line come last, so
    they win. ``1``/``true``/``yes``/``on`` mean ``auto``, ``0``/``false``/``no`` mean
    ``off``, and a value that starts with an override (``oneload.verify=true``) means
    ``auto`` plus that override.

    Raises:
        ValueError: ``METASEQ_ONELOAD`` does not split into words (unbalanced quotes).
    """
    _, tokens = split_argv(argv)
    env = environ.get(ENV, "").strip()
    has_group = any(_GROUP_TOKEN.match(t) for t in tokens)
    if not has_group and not env:
        return None
    overrides: List[str] = []
    if env and not has_group:
        try:
            words = shlex.split(env)
        except ValueError as e:
            raise ValueError(f"{ENV}={env!r}: {e}; expected e.g. {ENV}=\"broadcast oneload.bucket_mb=64\".") from None
        first = words[0]
        if _GROUP_TOKEN.match(first):
            overrides.append(first)
            words = words[1:]
        elif _TOKEN.match(first):
            overrides.append("+oneload=auto")  # only overrides: they apply to auto
        else:
            name = "auto" if first.lower() in _ENV_ON else "off" if first.lower() in _ENV_OFF else first
            overrides.append(f"+oneload={name}")
            words = words[1:]
        overrides += words
    return overrides + tokens


def environment_value(overrides: Sequence[str]) -> str:
    """The ``METASEQ_ONELOAD`` value that re-creates ``overrides`` in a child process."""
    group = "auto"
    rest = []
    for o in overrides:
        if _GROUP_TOKEN.match(o):
            group = o.split("=", 1)[1]
        else:
            rest.append(o)
    return " ".join(shlex.quote(w) for w in [group, *rest])
