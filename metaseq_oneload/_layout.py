"""What is on disk, as data: the :class:`CheckpointLayout` and the file-name grammar.

Nothing here reads files beyond a cached header. Discovery (any path -> one layout) lives in
:mod:`metaseq_oneload.formats`, one module per checkpoint family behind one registry; every
describer returns the frozen description defined here, and the planner and the engine read
nothing else.

The metaseq/fairseq file-name grammar::

    X.pt                              singleton (also X_consolidated.pt, restored.pt, ...)
    X-model_part-{m}.pt               model-parallel part m (OPT: reshard-model_part-{m}.pt)
    X-model_part-{m}-shard{d}.pt      FSDP shard d of part m (OPT-66B: ...-shard0.pt only)
    X-shard{d}.pt                     FSDP shard d, no model parallelism (fairseq style)
    X_part{k}.pt                      fairseq checkpoint_shard_count > 1 (FSDP shards)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

from ._errors import reading
from ._placement import canonical_numels
from ._reading import read_header

__all__ = ["FileName", "CheckpointFile", "FlatParam", "StoredTensor", "ModelPart", "CheckpointSettings",
           "CheckpointLayout", "ModelArgs", "model_args_of", "raw_get", "raw_keys", "known_get", "is_interpolation",
           "plain", "omegaconf_types"]

_NAME_RE = re.compile(
    r"^(?P<prefix>.+?)"
    r"(?:-model_part-(?P<part>\d+))?"
    r"(?:-shard(?P<shard>\d+)|_part(?P<kpart>\d+))?"
    r"\.pt$"
)


@dataclass(frozen=True)
class FileName:
    """One file name of a checkpoint set, parsed."""

    prefix: str
    part: Optional[int] = None
    shard: Optional[int] = None
    shard_style: str = "-shard"  # "-shard" (metaseq) or "_part" (fairseq checkpoint_shard_count)

    @classmethod
    def parse(cls, name: str) -> Optional["FileName"]:
        m = _NAME_RE.match(name)
        if m is None:
            return None
        part = m.group("part")
        shard, style = m.group("shard"), "-shard"
        if m.group("kpart") is not None:
            shard, style = m.group("kpart"), "_part"
        return cls(m.group("prefix"), None if part is None else int(part),
                   None if shard is None else int(shard), style)

    @property
    def pattern(self) -> tuple:
        """What must agree between members of one set (which suffixes are present)."""
        return (self.part is not None, self.shard is not None, self.shard_style)

    def format(self, part: Optional[int] = None, shard: Optional[int] = None) -> str:
        part = self.part if part is None else part
        shard = self.shard if shard is None else shard
        name = self.prefix
        if self.part is not None:
            name += f"-model_part-{part}"
        if self.shard is not None:
            name += f"{self.shard_style}{shard}"
        return name + ".pt"


@dataclass(frozen=True)
class CheckpointFile:
    """One file of the set, at grid position [part][shard]."""

    path: str
    part: int
    shard: int
    size: int
    format: str  # "zip", "safetensors" (read in place); "zip-packed", "legacy" (read whole)


@dataclass(frozen=True)
class FlatParam:
    """One FSDP flat parameter of one model part, as its shards store it.

    Shard ``d`` holds ``shard_numels[d]`` elements of which the last ``paddings[d]`` are
    padding; the real elements of all shards, concatenated in shard order, are the member
    tensors ``names`` flattened and concatenated.
    """

    key: str
    fsdp_path: str
    names: tuple
    shapes: tuple
    numels: tuple
    shard_numels: tuple
    paddings: tuple
    dtype: torch.dtype

    @property
    def total_numel(self) -> int:
        return sum(self.numels)

    @property
    def real_numels(self) -> tuple:
        return tuple(n - p for n, p in zip(self.shard_numels, self.paddings))

    @property
    def local_names(self) -> tuple:
        cut = len(self.fsdp_path) + 1 if self.fsdp_path else 0
        return tuple(n[cut:] for n in self.names)


@dataclass(frozen=True)
class StoredTensor:
    """One logical (unflattened) tensor of one model part, wherever its bytes live."""

    name: str
    part: int
    dtype: torch.dtype
    shape: tuple
    extents: tuple  # of Extent, covering the flattened tensor in order
    # The stored digest the set's index records for it (``_digest``): a claim, checked against
    # the bytes by a load with ``verify="digest"``, never used to skip a check.
    digest: Optional[str] = field(default=None, compare=False)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class ModelPart:
    """Everything one model-parallel part holds: its tensors (flat params unflattened),
    the flat-parameter structure when the part is FSDP-sharded, buffers and ties."""

    index: int
    tensors: Mapping[str, StoredTensor]
    flat_params: tuple  # of FlatParam; empty when not flattened
    buffer_names: tuple
    shared: tuple  # (source name, tied alias name) pairs


@dataclass(frozen=True)
class CheckpointSettings:
    """What the checkpoint's ``cfg`` (or old fairseq ``args``) says about its layout."""

    model_parallel_size: Optional[int] = None
    checkpoint_shard_count: Optional[int] = None
    use_sharded_state: Optional[bool] = None
    ddp_backend: Optional[str] = None
    distributed_world_size: Optional[int] = None


@dataclass(frozen=True)
class CheckpointLayout:
    """A complete, validated checkpoint set. Derived facts are properties, not fields."""

    directory: str
    prefix: str
    name: FileName
    files: tuple  # [part][shard] of CheckpointFile
    parts: tuple  # of ModelPart
    cfg: CheckpointSettings
    metadata_key: Optional[str]  # "shard_metadata" (metaseq/fairscale), "fsdp_metadata" (fairseq)
    aliases: tuple  # other names that point into this set (checkpoint_last-*.pt links)
    num_updates: Optional[int]
    flavor: str = "pytorch"  # "metaseq", "fairseq" or "pytorch" (a bare state dict)
    warnings: tuple = field(default=())
    # What is normal for the files and still worth knowing (a cfg or FSDP metadata their writer
    # kept from the run they came from, which the tensors override; what a folder held beside
    # the set and why it was skipped): inspect's report, never a warning.
    notes: tuple = field(default=(), compare=False)
    # What the files carry that does not describe their own tensors ("shard_metadata",
    # "cfg.common.model_parallel_size", ...): reported, never trusted.
    stale_metadata: tuple = field(default=())
    trust_pickle: bool = False  # how the headers were (and are again) unpickled
    # The model's hyper-parameters where the format keeps them outside the pickles (a Hugging
    # Face folder's config.json); None means "read them from the first file's header".
    config: Optional[Mapping] = field(default=None, compare=False, hash=False)
    # The index file this description was read from (None: read from the headers).
    index: Optional[str] = field(default=None, compare=False)

    @property
    def model_parallel_size(self) -> int:
        return len(self.files)

    @property
    def shards_per_part(self) -> int:
        # A Hugging Face set, or a DCP folder (one .distcp per writing rank), spreads one state
        # dict over files; they are not FSDP shards.
        return 1 if self.flavor in ("huggingface", "dcp") else len(self.files[0])

    @property
    def flat(self) -> bool:
        return bool(self.parts[0].flat_params)

    @property
    def kind(self) -> str:
        if self.flat or self.shards_per_part > 1:
            return "fsdp_sharded"
        return "model_parallel" if self.model_parallel_size > 1 else "singleton"

    @property
    def use_sharded_state(self) -> bool:
        return self.kind == "fsdp_sharded"

    @property
    def saved_world_size(self) -> int:
        return self.model_parallel_size * self.shards_per_part

    @property
    def all_files(self) -> tuple:
        return tuple(f for row in self.files for f in row)

    @property
    def file_bytes(self) -> int:
        return sum(f.size for f in self.all_files)

    @property
    def total_bytes(self) -> int:
        """Bytes of model tensors stored across all files (what a full load reads)."""
        return sum(t.nbytes for p in self.parts for t in p.tensors.values())

    @property
    def dtypes(self) -> tuple:
        return tuple(sorted({str(t.dtype).replace("torch.", "") for p in self.parts for t in p.tensors.values()}))

    @property
    def num_params(self) -> int:
        """Elements of the model's parameters as the full model holds them: model-parallel
        replicas counted once, buffers and tied aliases not counted."""
        tied = bool(self.model_args().get("share_decoder_input_output_embed"))
        return canonical_numels(self.parts, tied_embeddings=tied)

    @property
    def display_name(self) -> str:
        return os.path.join(self.directory, self.prefix)

    def model_args(self) -> "ModelArgs":
        """The model's hyper-parameters (``cfg.model`` or old fairseq ``args``; a Hugging Face
        folder's config.json) as plain data, read raw: an interpolation is never resolved
        (see :func:`model_args_of`)."""
        if self.config is not None:
            return ModelArgs(self.config)
        with reading(self.files[0][0].path):  # a header field of the wrong type is the file's fault
            return model_args_of(self.header())

    def header(self, part: int = 0, shard: int = 0) -> Any:
        """(local) The pickled object of one file, tensors on ``meta`` (cached)."""
        return read_header(self.files[part][shard].path, trust_pickle=self.trust_pickle)

    def to_dict(self) -> dict:
        """JSON-ready summary; the fields are documented in docs/inspect.md."""
        return {
            "path": self.display_name,
            "kind": self.kind,
            "model_parallel_size": self.model_parallel_size,
            "shards_per_part": self.shards_per_part,
            "flat": self.flat,
            "use_sharded_state": self.use_sharded_state,
            "saved_world_size": self.saved_world_size,
            "files": [[f.path for f in row] for row in self.files],
            "aliases": list(self.aliases),
            "num_params": self.num_params,
            "total_bytes": self.total_bytes,
            "file_bytes": self.file_bytes,
            "dtypes": list(self.dtypes),
            "num_updates": self.num_updates,
            "flavor": self.flavor,
            "metadata_key": self.metadata_key,
            "flat_params": [
                {
                    "part": p.index,
                    "key": fp.key,
                    "names": list(fp.names),
                    "shapes": [list(s) for s in fp.shapes],
                    "numels": list(fp.numels),
                    "shard_numels": list(fp.shard_numels),
                    "paddings": list(fp.paddings),
                }
                for p in self.parts for fp in p.flat_params
            ],
            "buffers": list(self.parts[0].buffer_names),
            "cfg": {
                "common.model_parallel_size": self.cfg.model_parallel_size,
                "checkpoint.checkpoint_shard_count": self.cfg.checkpoint_shard_count,
                "distributed_training.use_sharded_state": self.cfg.use_sharded_state,
                "distributed_training.ddp_backend": self.cfg.ddp_backend,
                "distributed_training.distributed_world_size": self.cfg.distributed_world_size,
            },
            "stale_metadata": list(self.stale_metadata),
            "index": self.index,
            "warnings": list(self.warnings),
            "notes": list(self.notes),
        }

    def fingerprint(self) -> str:
        """A digest of everything that decides which bytes go where: ranks compare it
        before reading, so a rank that sees other files makes every rank stop."""
        # File names, not paths: ranks may mount the same files at different places.
        desc = {
            "num_updates": self.num_updates,  # two saves can have the same names and sizes
            "files": [[(os.path.basename(f.path), f.size) for f in row] for row in self.files],
            "tensors": [
                [(t.name, str(t.dtype), list(t.shape),
                  [(os.path.basename(e.path), e.byte_offset, e.numel) for e in t.extents])
                 for t in p.tensors.values()]
                for p in self.parts
            ],
        }
        return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------- a file's cfg, as data
# A checkpoint's cfg may be a pickled OmegaConf DictConfig whose values are interpolations
# (``${...}``). Resolving one runs whatever resolver the process registered (an ``eval``
# resolver is a common Hydra idiom) and copies the caller's environment (``oc.env``) into
# what we report and write: a file's values are data, so every read below takes the node's
# own stored value and never resolves. An interpolation is an unknown value.

# What one cfg value may expand to: a shared-list DAG of 60 levels pickles in a few hundred
# bytes and has 2**60 paths; real model arguments are scalars and short lists.
_MAX_VALUES = 10_000
_MAX_DEPTH = 32


def omegaconf_types() -> tuple:
    """(DictConfig, ListConfig), or what of them omegaconf has defined so far: () where it is
    not imported. No object is one of theirs before their module is (a pickle naming them
    imports it), and importing it costs a fresh process 130-190 ms, more than a plain
    256 MiB load; so a check of a plain checkpoint does not import it."""
    mod = sys.modules.get("omegaconf")
    return tuple(t for t in (getattr(mod, "DictConfig", None), getattr(mod, "ListConfig", None)) if t is not None)


def is_interpolation(value: Any) -> bool:
    """Whether a raw cfg value is OmegaConf interpolation text: in a DictConfig it would be
    resolved on access, and a plain-dict cfg becomes a DictConfig in metaseq, fairseq and
    Hydra code downstream, where it would be resolved too."""
    return isinstance(value, str) and "${" in value


def raw_get(container: Any, key: Any) -> Any:
    """``container[key]`` as the file stores it: dicts, Namespaces and OmegaConf containers,
    an OmegaConf value node's own stored value (an interpolation comes back as its ``${...}``
    text, never resolved); None where absent, missing (``???``) or unreadable."""
    if container is None:
        return None
    oc = omegaconf_types()
    if oc and isinstance(container, oc):
        try:
            if container._is_interpolation() or container._is_missing() or container._is_none():
                return None
            node = container._get_node(key, validate_access=False, throw_on_missing_value=False,
                                       throw_on_missing_key=False)
        except Exception:  # a key of the wrong type, a node that is not what its class says
            return None
        if node is None:
            return None
        if isinstance(node, oc) and not node._is_interpolation():
            return None if node._is_missing() or node._is_none() else node
        try:
            value = node._value()
        except Exception:
            return None
        return None if value == "???" else value
    if isinstance(container, Mapping):
        try:
            return container.get(key)
        except Exception:  # a Mapping that is not a dict
            return None
    if isinstance(key, str) and hasattr(container, "__dict__"):
        return vars(container).get(key)  # a Namespace's own attributes, never a property
    return None


def raw_keys(container: Any) -> list:
    """The keys of a cfg section without touching its values (a DictConfig's ``in`` and
    iteration resolve them)."""
    oc = omegaconf_types()
    if oc and isinstance(container, oc[:1]):
        try:
            return list(container.keys())
        except Exception:
            return []
    if isinstance(container, Mapping):
        return list(container.keys())
    if hasattr(container, "__dict__") and not isinstance(container, type):
        return list(vars(container))
    return []


def known_get(container: Any, key: str) -> Any:
    """``container[key]`` for dicts, DictConfigs and Namespaces where it is known: raw
    (:func:`raw_get`), None where absent or an interpolation."""
    value = raw_get(container, key)
    return None if is_interpolation(value) else value


class _Unknown(Exception):
    """A cfg value that cannot be taken as data: why, for :attr:`ModelArgs.unresolved`."""


def plain(value: Any, *, max_values: int = _MAX_VALUES, max_depth: int = _MAX_DEPTH) -> Any:
    """(local) A cfg value as plain data (dicts, lists, scalars), read raw; raises
    :class:`_Unknown` where it holds an interpolation or is larger than ``max_values``
    values or deeper than ``max_depth``. Every visit counts, so a structure shared along
    many paths (a DAG) costs at most ``max_values`` steps, not one per path."""
    budget = [max_values]
    oc = omegaconf_types()

    def walk(x: Any, depth: int) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise _Unknown(f"more than {max_values} values (a structure shared along many paths?)")
        if depth > max_depth:
            raise _Unknown(f"nested more than {max_depth} deep")
        if is_interpolation(x):
            raise _Unknown(f"an interpolation ({_short(x)}), never resolved from a file")
        if x is None or isinstance(x, (bool, int, float, str, bytes)):
            return x
        if oc and isinstance(x, oc[1]):
            if x._is_interpolation():
                raise _Unknown(f"an interpolation ({_short(x._value())}), never resolved from a file")
            return [walk(raw_get(x, i), depth + 1) for i in range(len(x._content or ()))]
        if (oc and isinstance(x, oc[0])) or isinstance(x, Mapping) or (
                isinstance(x, argparse.Namespace)):
            return {k: walk(raw_get(x, k), depth + 1) for k in raw_keys(x)}
        if isinstance(x, (list, tuple)):
            return [walk(v, depth + 1) for v in x]
        return x  # tensors, enums, numpy scalars: the consumer decides (the index keeps only JSON)

    return walk(value, 0)


def _short(text: Any, n: int = 80) -> str:
    text = str(text)
    return text if len(text) <= n else text[:n] + "..."


class ModelArgs(dict):
    """A checkpoint's model hyper-parameters as plain data; :attr:`unresolved` maps each
    argument left out to why (its interpolation text, or its size), so a message about a
    needed argument can say it is there but unknown."""

    def __init__(self, *args: Any, unresolved: Optional[Mapping] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.unresolved: dict = dict(unresolved or {})

    def why_missing(self, key: str, where: str = "cfg.model") -> str:
        """'not in cfg.model' or, for an argument left out, what it was and why."""
        if key in self.unresolved:
            return f"{where}.{key} is {self.unresolved[key]}, so its value is unknown"
        return f"not in {where}"


def model_args_of(header: Any) -> ModelArgs:
    """A checkpoint header's model hyper-parameters (``cfg.model``, or old fairseq/metaseq
    ``args``) as plain data, read raw (see :func:`raw_get`); an argument that is or holds an
    interpolation, or is too large to be one (:func:`plain`), is left out and named in
    ``unresolved``. Empty where there are none."""
    if not isinstance(header, Mapping):
        return ModelArgs()
    for candidate in (known_get(known_get(header, "cfg"), "model"), known_get(header, "args")):
        if candidate is None:
            continue
        out, unknown = {}, {}
        for k in raw_keys(candidate):
            if not isinstance(k, str):
                continue
            try:
                out[k] = plain(raw_get(candidate, k))
            except _Unknown as e:
                unknown[k] = str(e)
        return ModelArgs(out, unresolved=unknown)
    return ModelArgs()
