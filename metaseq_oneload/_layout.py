"""What is on disk: file-name grammar, discovery, and the :class:`CheckpointLayout`.

Nothing here reads tensor data. :func:`discover` turns any path a user might pass (a
folder, any file of a set, a ``checkpoint_last`` link, the un-suffixed name metaseq scripts
take, a glob) into one complete, validated description of a checkpoint set, using only the
file names and the pickled headers (:func:`~metaseq_oneload._reading.read_header`).

The grammar, as metaseq and fairseq write it::

    X.pt                              singleton (also X_consolidated.pt, restored.pt, ...)
    X-model_part-{m}.pt               model-parallel part m (OPT: reshard-model_part-{m}.pt)
    X-model_part-{m}-shard{d}.pt      FSDP shard d of part m (OPT-66B: ...-shard0.pt only)
    X-shard{d}.pt                     FSDP shard d, no model parallelism (fairseq style)
    X_part{k}.pt                      fairseq checkpoint_shard_count > 1 (FSDP shards)

When the files and their ``cfg`` disagree (a consolidated file keeps the cfg of the run it
came from), the files win and the disagreement becomes a warning.
"""

from __future__ import annotations

import concurrent.futures
import glob
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

from ._errors import CheckpointLayoutError, CheckpointNotFoundError
from ._reading import Extent, _file_kind, key_path, range_readable, read_header, storage_byte_offset

__all__ = ["FileName", "CheckpointLayout", "discover"]

_NAME_RE = re.compile(
    r"^(?P<prefix>.+?)"
    r"(?:-model_part-(?P<part>\d+))?"
    r"(?:-shard(?P<shard>\d+)|_part(?P<kpart>\d+))?"
    r"\.pt$"
)
_POINTER_MAX_BYTES = 4096
_MAX_POINTER_HOPS = 40
# Buffers that metaseq/fairseq models register; everything else in an unflattened state
# dict is a parameter as far as the parameter count is concerned.
_BUFFER_SUFFIXES = (".version", "._float_tensor")


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
    # What the files carry that does not describe their own tensors ("shard_metadata",
    # "cfg.common.model_parallel_size", ...): reported, never trusted.
    stale_metadata: tuple = field(default=())
    trust_pickle: bool = False  # how the headers were (and are again) unpickled

    @property
    def model_parallel_size(self) -> int:
        return len(self.files)

    @property
    def shards_per_part(self) -> int:
        # A Hugging Face set spreads one state dict over files; they are not FSDP shards.
        return 1 if self.flavor == "huggingface" else len(self.files[0])

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
        from ._plan import canonical_numels  # the model-parallel rules live with the planner

        return canonical_numels(self)

    @property
    def display_name(self) -> str:
        return os.path.join(self.directory, self.prefix)

    def model_args(self) -> dict:
        """The model's hyper-parameters (``cfg.model`` or old fairseq ``args``; a Hugging Face
        folder's config.json) as a dict."""
        if self.flavor == "huggingface":
            from ._hf_layout import hf_config

            return hf_config(self) or {}
        header = self.header()
        if not isinstance(header, Mapping):
            return {}
        for candidate in (_get(header.get("cfg"), "model"), header.get("args")):
            if candidate is None:
                continue
            if isinstance(candidate, Mapping):
                return dict(candidate)
            return dict(vars(candidate))
        return {}

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
            "warnings": list(self.warnings),
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


# --------------------------------------------------------------------------- pointers


def _read_pointer(path: str) -> Optional[str]:
    """The target name if ``path`` is a tiny text file holding a checkpoint file name (how
    a symlink looks after a copy that does not keep links, e.g. a git checkout)."""
    try:
        if os.path.getsize(path) > _POINTER_MAX_BYTES:
            return None
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    if not text or "\n" in text or not text.endswith(".pt") or "\x00" in text:
        return None
    return text


def _resolve(path: str) -> str:
    """Follow symlinks and text pointers to the real file; raise on loops and dangling
    links."""
    chain = [path]
    current = path
    for _ in range(_MAX_POINTER_HOPS):
        try:
            real = os.path.realpath(current, strict=True)
        except OSError as e:
            if os.path.islink(current) and ("loop" in str(e).lower() or getattr(e, "errno", None) == 40):
                raise CheckpointLayoutError(
                    f"{path}: symlink loop ({' -> '.join(chain)} -> ...); point the link at a real "
                    "checkpoint file."
                ) from None
            if os.path.lexists(current) or len(chain) > 1:
                raise CheckpointLayoutError(
                    f"{path}: dangling link: {' -> '.join(chain)} does not exist. Re-create the link "
                    "or pass the checkpoint's real file name."
                ) from None
            raise CheckpointNotFoundError(f"{path}: no such file.") from None
        if os.path.isdir(real):
            return real
        target = _read_pointer(real)
        if target is None:
            return real
        nxt = os.path.join(os.path.dirname(real), target)
        if os.path.realpath(nxt) in {os.path.realpath(c) for c in chain}:
            raise CheckpointLayoutError(
                f"{path}: link loop ({' -> '.join(chain + [nxt])}); point the link at a real "
                "checkpoint file."
            )
        chain.append(nxt)
        current = nxt
    raise CheckpointLayoutError(f"{path}: more than {_MAX_POINTER_HOPS} links deep ({' -> '.join(chain[:5])} ...).")


@dataclass(frozen=True)
class _Entry:
    """One *.pt entry of a folder: its own name, and the real file it resolves to."""

    name: str
    parsed: FileName
    real: str

    @property
    def real_name(self) -> Optional[FileName]:
        return FileName.parse(os.path.basename(self.real))

    @property
    def set_key(self) -> tuple:
        rn = self.real_name
        return (os.path.dirname(self.real), rn.prefix if rn else os.path.basename(self.real))


def _scan(directory: str) -> list:
    """The folder's *.pt entries, resolved. A broken link is skipped here: if it belonged
    to the set the user asked for, the grid check names the missing file instead."""
    try:
        names = sorted(os.listdir(directory))
    except OSError as e:
        raise CheckpointLayoutError(f"{directory}: cannot list the folder ({e.strerror or e}).") from e
    entries = []
    for n in names:
        parsed = FileName.parse(n)
        full = os.path.join(directory, n)
        if parsed is None or os.path.isdir(full):
            continue
        try:
            entries.append(_Entry(n, parsed, _resolve(full)))
        except CheckpointLayoutError:
            continue
    return entries


# --------------------------------------------------------------------------- sets


@dataclass(frozen=True)
class _FileSet:
    directory: str
    prefix: str
    members: tuple  # real paths
    aliases: tuple  # entry names pointing into the set that are not its real names


def _set_from(key: tuple, entries: Iterable) -> _FileSet:
    directory, prefix = key
    members, aliases = set(), set()
    for e in entries:
        if e.set_key != key:
            continue
        members.add(e.real)
        if os.path.join(directory, e.name) != e.real:
            aliases.add(e.name)
    # Real files of the set that no scanned entry named (e.g. the entry was a link from
    # another folder): take them from the target folder itself.
    if directory:
        for e in _scan(directory):
            if e.set_key == key:
                members.add(e.real)
                if os.path.join(directory, e.name) != e.real:
                    aliases.add(e.name)
    return _FileSet(directory, prefix, tuple(sorted(members)), tuple(sorted(aliases)))


def _looks_like_checkpoint(path: str) -> bool:
    try:
        obj = read_header(path)
    except CheckpointLayoutError:
        return False
    return _model_dict(obj) is not None


def _describe_sets(sets: Sequence[_FileSet]) -> str:
    return ", ".join(f"{s.prefix} ({len(s.members)} file{'s' * (len(s.members) != 1)})" for s in sets)


def _resolve_set(path: str) -> _FileSet:
    path = os.fspath(path)
    if glob.has_magic(path):
        matches = [m for m in sorted(glob.glob(path)) if not os.path.isdir(m)]
        if not matches:
            raise CheckpointNotFoundError(f"{path}: the pattern matches no files.")
        entries = [_Entry(os.path.basename(m), FileName.parse(os.path.basename(m)) or FileName(m), _resolve(m))
                   for m in matches]
        keys = sorted({e.set_key for e in entries})
        if len(keys) > 1:
            raise CheckpointLayoutError(
                f"{path}: the pattern matches files of {len(keys)} different checkpoints "
                f"({', '.join(os.path.join(*k) for k in keys)}); narrow it to one."
            )
        return _set_from(keys[0], entries)

    if os.path.isdir(path):
        entries = _scan(path)
        if not entries:
            # Not "damaged": an empty folder is what a rank sees where a mount is missing.
            raise CheckpointNotFoundError(
                f"{path}: the folder holds no *.pt files; expected a checkpoint such as "
                "checkpoint_last.pt or checkpoint_N-model_part-0-shard0.pt."
            )
        by_key: dict = {}
        for e in entries:
            by_key.setdefault(e.set_key, []).append(e)
        last = [e for e in entries if e.parsed.prefix == "checkpoint_last"]
        if last:
            keys = sorted({e.set_key for e in last})
            if len(keys) > 1:
                raise CheckpointLayoutError(
                    f"{path}: the checkpoint_last files point to {len(keys)} different checkpoints "
                    f"({', '.join(k[1] for k in keys)}); fix the links."
                )
            return _set_from(keys[0], entries)
        sets = [_set_from(k, v) for k, v in sorted(by_key.items())]
        if len(sets) > 1:
            sets = [s for s in sets if _looks_like_checkpoint(s.members[0])] or sets
        if len(sets) == 1:
            return sets[0]
        raise CheckpointLayoutError(
            f"{path}: the folder holds {len(sets)} checkpoints and no checkpoint_last: "
            f"{_describe_sets(sets)}. Choose one by passing its name, e.g. "
            f"{os.path.join(path, sets[-1].prefix + '.pt')}."
        )

    if os.path.lexists(path):
        real = _resolve(path)
        if os.path.isdir(real):
            return _resolve_set(real)
        entry = _Entry(os.path.basename(path), FileName.parse(os.path.basename(path)) or FileName(path), real)
        if entry.real_name is None:
            raise CheckpointLayoutError(
                f"{path}: not a checkpoint file name: expected a name ending in .pt "
                "(X.pt, X-model_part-M.pt, X-model_part-M-shardD.pt, X-shardD.pt, X_partK.pt)."
            )
        return _set_from(entry.set_key, [entry])

    # The un-suffixed name metaseq scripts take: X.pt where only X-model_part-*.pt,
    # X-shard*.pt or X_part*.pt exist (checkpoint_last.pt, reshard.pt, checkpoint_2.pt).
    directory, base = os.path.split(path)
    directory = directory or "."
    if not base.endswith(".pt") or not os.path.isdir(directory):
        raise CheckpointNotFoundError(f"{path}: no such file or folder.")
    stem = base[:-3]
    entries = [e for e in _scan(directory) if e.parsed.prefix == stem]
    if not entries:
        raise CheckpointNotFoundError(
            f"{path}: no such file, and no {stem}-model_part-*.pt, {stem}-shard*.pt or {stem}_part*.pt "
            f"beside it in {os.path.abspath(directory)}. Pass an existing file or the folder."
        )
    keys = sorted({e.set_key for e in entries})
    if len(keys) > 1:
        raise CheckpointLayoutError(
            f"{path}: the files named {stem}-* point to {len(keys)} different checkpoints "
            f"({', '.join(k[1] for k in keys)}); fix the links or pass one file."
        )
    return _set_from(keys[0], entries)


# --------------------------------------------------------------------------- headers


def _model_dict(obj: Any) -> Optional[Mapping]:
    """The model state dict inside a checkpoint object, or None if it has none."""
    if not isinstance(obj, Mapping):
        return None
    model = obj.get("model")
    if isinstance(model, Mapping) and model and all(torch.is_tensor(v) for v in model.values()):
        return model
    if obj and all(isinstance(k, str) for k in obj) and all(torch.is_tensor(v) for v in obj.values()):
        return obj  # a bare state dict (plain PyTorch)
    return None


def _model_key(obj: Mapping, name: str) -> str:
    return key_path("model", name) if isinstance(obj.get("model"), Mapping) else key_path(name)


def _get(container: Any, key: str) -> Any:
    """``container[key]`` for dicts and DictConfigs, ``container.key`` for Namespaces."""
    if container is None:
        return None
    if isinstance(container, Mapping):
        try:
            return container.get(key)
        except Exception:  # an interpolation that cannot resolve outside its app
            return None
    return getattr(container, key, None)


def _cfg_value(header: Any, section: str, key: str) -> Any:
    if not isinstance(header, Mapping):
        return None
    value = _get(_get(header.get("cfg"), section), key)
    if value is None:
        value = _get(_get(header.get("cfg"), "model"), key)
    if value is None:
        value = _get(header.get("args"), key)
    return value


def _settings(header: Any) -> CheckpointSettings:
    def as_int(v):
        return None if v is None else int(v)

    usv = _cfg_value(header, "distributed_training", "use_sharded_state")
    ddp = _cfg_value(header, "distributed_training", "ddp_backend")
    return CheckpointSettings(
        model_parallel_size=as_int(_cfg_value(header, "common", "model_parallel_size")),
        checkpoint_shard_count=as_int(_cfg_value(header, "checkpoint", "checkpoint_shard_count")),
        use_sharded_state=None if usv is None else bool(usv),
        ddp_backend=None if ddp is None else str(ddp),
        distributed_world_size=as_int(_cfg_value(header, "distributed_training", "distributed_world_size")),
    )


def _run_id(header: Any) -> tuple:
    """What every file of one save shares: the update count and training position."""
    if not isinstance(header, Mapping):
        return ()
    updates = None
    hist = header.get("optimizer_history")
    if isinstance(hist, (list, tuple)) and hist and isinstance(hist[-1], Mapping):
        updates = hist[-1].get("num_updates")
    it = _get(header.get("extra_state"), "train_iterator")
    return (updates, _get(it, "epoch"), _get(it, "iterations_in_epoch"))


def _flat_metadata(header: Mapping) -> tuple:
    for key in ("shard_metadata", "fsdp_metadata"):
        md = header.get(key)
        if isinstance(md, Mapping) and "param_metadata" in md:
            return key, md
    return None, None


def _contiguous(t: torch.Tensor) -> bool:
    expected, stride = 1, []
    for s in reversed(t.shape):
        stride.append(expected)
        expected *= s
    return t.dim() == 0 or all(st == ex or sz == 1 for st, ex, sz in zip(t.stride(), reversed(stride), t.shape))


def _direct_extent(path: str, fmt: str, obj: Mapping, name: str, t: torch.Tensor) -> Extent:
    offset = storage_byte_offset(t) if fmt == "zip" and _contiguous(t) else None
    return Extent(path, _model_key(obj, name), 0, t.numel(), offset)


def _format(path: str) -> str:
    """"zip" when tensors can be read in place, "zip-packed" for a zip whose records are
    compressed or big-endian, "legacy" for torch's pre-1.6 format (both read whole)."""
    kind = _file_kind(path)
    if kind == "zip" and not range_readable(path):
        return "zip-packed"
    return kind


def _fmt_list(xs: Iterable[int]) -> str:
    return ",".join(str(x) for x in xs)


def _check_grid(fs: _FileSet) -> tuple:
    """Parse member names into a [part][shard] grid; raise on mixed or missing files."""
    parsed = {p: FileName.parse(os.path.basename(p)) for p in fs.members}
    patterns = {n.pattern for n in parsed.values()}
    if len(patterns) > 1:
        raise CheckpointLayoutError(
            f"{os.path.join(fs.directory, fs.prefix)}: mixed naming in one set: "
            f"{', '.join(sorted(os.path.basename(p) for p in fs.members))}. Expected every file to "
            "carry the same suffixes (all -model_part-M, all -shardD, or none); move the odd ones out."
        )
    any_name = next(iter(parsed.values()))
    grid: dict = {}
    for path, n in parsed.items():
        grid.setdefault(n.part or 0, {})[n.shard or 0] = path
    parts = sorted(grid)
    n_parts = parts[-1] + 1
    if parts != list(range(n_parts)):
        missing = [m for m in range(n_parts) if m not in grid]
        raise CheckpointLayoutError(
            f"{os.path.join(fs.directory, any_name.format(part='{..}'))}: found model parts "
            f"{_fmt_list(parts)} of {n_parts} (missing {', '.join(any_name.format(part=m, shard=0 if any_name.shard is not None else None) for m in missing)}). "
            "Copy the missing part(s) next to the others."
        )
    n_shards = max(max(row) for row in grid.values()) + 1
    for m in parts:
        have = sorted(grid[m])
        if have != list(range(n_shards)):
            missing = [d for d in range(n_shards) if d not in grid[m]]
            label = any_name.format(part=m, shard="{..}") if any_name.part is not None else any_name.format(shard="{..}")
            raise CheckpointLayoutError(
                f"{os.path.join(fs.directory, label.replace('{..}', '{0..%d}' % (n_shards - 1)))}: "
                f"found shards {_fmt_list(have)} of {n_shards} "
                f"(missing {', '.join(any_name.format(part=m, shard=d) for d in missing)}). "
                "Copy the missing shard(s) next to the others."
            )
    return any_name, [[grid[m][d] for d in range(n_shards)] for m in range(n_parts)]


def _read_headers(paths: Sequence[str]) -> dict:
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, max(1, len(paths)))) as pool:
        return dict(zip(paths, pool.map(read_header, paths)))


_FLAT_NAME_RE = re.compile(r"(?:^|\.)flat_param(?:_\d+)?$")
# Lists in messages are capped: a folder or cfg that claims a million shards must not make
# a 100 MB error message.
_LIST_CAP = 5


def _cap(items: Sequence[Any], n: int = _LIST_CAP) -> str:
    items = list(items)
    head = ", ".join(str(x) for x in items[:n])
    return head + (f" ... and {len(items) - n} more" if len(items) > n else "")


def _metadata_structure(md: Mapping) -> list:
    """(fsdp_path, flat name, member names, shapes, numels) per flat parameter."""
    return [(pm.get("fsdp_path", "") or "", k, list(v["names"]), [tuple(s) for s in v["shapes"]], list(v["numels"]))
            for pm in md["param_metadata"] for k, v in pm["params"].items()]


def _joined(fsdp_path: str, name: str) -> str:
    return f"{fsdp_path}.{name}" if fsdp_path else name


def _flat_reading(index: int, files: Sequence[CheckpointFile], headers: Mapping) -> tuple:
    """Which reading of one model part's files the tensors support: ("flat", key) when the
    files hold the flat parameters their metadata lists, ("unflattened", key-or-None) when
    they hold ordinary tensors (any metadata beside them is stale), or raise when no
    reading is consistent."""
    label = lambda f: os.path.basename(f.path)  # noqa: E731
    models = [_model_dict(headers[f.path]) for f in files]
    metas = [_flat_metadata(headers[f.path]) for f in files]
    flat_like = [sorted(n for n in m if _FLAT_NAME_RE.search(n)) for m in models]
    declared = []
    for key, md in metas:
        declared.append(None if md is None else [_joined(p, k) for p, k, *_ in _metadata_structure(md)])
    holds_flat = []
    for f, model, names, flat in zip(files, models, declared, flat_like):
        present = [k for k in (names or ()) if k in model]
        if names and present and len(present) != len(names):
            missing = [k for k in names if k not in model]
            raise CheckpointLayoutError(
                f"{f.path}: its shard_metadata lists flat parameters {_cap(names)} but the file holds only "
                f"{_cap(present)} of them (missing {_cap(missing)}): neither a flat FSDP shard nor an "
                "unflattened file. The file was edited or damaged; copy it again from its source."
            )
        holds_flat.append(bool(present) or (bool(flat) and names is None))
    if any(holds_flat) and not all(holds_flat):
        flat_files = [label(f) for f, h in zip(files, holds_flat) if h]
        other = [label(f) for f, h in zip(files, holds_flat) if not h]
        raise CheckpointLayoutError(
            f"model part {index}: {_cap(flat_files)} hold flat FSDP parameters but {_cap(other)} hold "
            "unflattened weights: files of different saves or writers are mixed in one set. Keep only "
            "the files written by one save."
        )
    if all(holds_flat):
        no_md = [label(f) for f, (k, _) in zip(files, metas) if k is None]
        if no_md:
            raise CheckpointLayoutError(
                f"{files[0].path}: {_cap(no_md)} hold{'s' * (len(no_md) == 1)} flat FSDP parameters "
                f"({_cap(flat_like[0])}) but no shard_metadata or fsdp_metadata, so how they unflatten "
                "cannot be known. Expected FSDP local_state_dict shards saved with their shard_metadata "
                "(use_sharded_state); re-save them, or consolidate them with the tool that wrote them."
            )
        keys = {k for k, _ in metas}
        if len(keys) > 1:
            raise CheckpointLayoutError(
                f"model part {index}: some shards carry shard_metadata and some fsdp_metadata: files of "
                "different writers are mixed. Keep only the files written by one save."
            )
        return "flat", keys.pop()
    if len(files) > 1:
        raise CheckpointLayoutError(
            f"{files[0].path}: {len(files)} files are named as FSDP shards of model part {index} "
            f"({label(files[0])} .. {label(files[-1])}) but each holds unflattened weights, so how they "
            "split the model cannot be known (copies of one file?). Expected flat FSDP shards with "
            "shard_metadata; keep one file, or pass the one you mean."
        )
    return "unflattened", metas[0][0]


def _build_part(index: int, files: Sequence[CheckpointFile], headers: Mapping, stale: list) -> tuple:
    """One model part from its files' tensors; returns (part, metadata key or None).

    Appends ``(metadata key, warning)`` to ``stale`` for metadata that does not describe the
    tensors."""
    label = lambda f: os.path.basename(f.path)  # noqa: E731
    first = headers[files[0].path]
    model0 = _model_dict(first)
    reading, metadata_key = _flat_reading(index, files, headers)
    tensors: dict = {}
    if reading == "unflattened":
        for name, t in model0.items():
            tensors[name] = StoredTensor(name, index, t.dtype, tuple(t.shape),
                                         (_direct_extent(files[0].path, files[0].format, first, name, t),))
        buffers = tuple(n for n in tensors if n.endswith(_BUFFER_SUFFIXES))
        shared: list = []
        if metadata_key is not None:
            md = first[metadata_key]
            stale.append((metadata_key, _stale_metadata_note(files[0], metadata_key, md, model0)))
            # Ties the metadata records still hold where the tensors agree: the writer dropped
            # the alias (reshard_fsdp --unflatten-weights does) but the model expects it.
            for pm in md["param_metadata"]:
                fsdp_path = pm.get("fsdp_path", "") or ""
                for pair in pm.get("shared_param_info", ()) or ():
                    src, dst = _joined(fsdp_path, pair[0]), _joined(fsdp_path, pair[1])
                    if src in tensors and (dst not in tensors or tensors[dst].shape == tensors[src].shape):
                        shared.append((src, dst))
            buffers = tuple(dict.fromkeys(buffers + tuple(
                n for n in (md.get("buffer_names", ()) or ()) if n in tensors)))
        return ModelPart(index, tensors, (), buffers, tuple(shared)), None

    metas = [headers[f.path][metadata_key] for f in files]
    models = [_model_dict(headers[f.path]) for f in files]
    ref = _metadata_structure(metas[0])
    for f, md, model in zip(files, metas, models):
        if _metadata_structure(md) != ref:
            raise CheckpointLayoutError(
                f"{f.path}: its {metadata_key} differs from {label(files[0])}'s (other parameter "
                "names, shapes or grouping): shards of different checkpoints are mixed in one set. "
                "Keep only the shards written by one save."
            )
        if set(model) != set(models[0]):
            raise CheckpointLayoutError(
                f"{f.path}: holds tensors {_cap(sorted(set(model) ^ set(models[0])))} that "
                f"{label(files[0])} does not (or the reverse): shards of different checkpoints are mixed."
            )
        for name, t in model.items():
            t0 = models[0][name]
            if t.dtype != t0.dtype:
                raise CheckpointLayoutError(
                    f"{f.path}: {name} is stored as {str(t.dtype).replace('torch.', '')} but "
                    f"{label(files[0])} stores it as {str(t0.dtype).replace('torch.', '')}: every shard "
                    "of one save has one dtype per tensor, so shards of different saves (or a shard "
                    "converted on its own) are mixed. Keep only the files written by one save, or "
                    "convert all of them."
                )

    flat_params = []
    flat_keys = set()
    for pm in metas[0]["param_metadata"]:
        fsdp_path = pm.get("fsdp_path", "") or ""
        for flat_name, v in pm["params"].items():
            key = _joined(fsdp_path, flat_name)
            flat_keys.add(key)
            shard_numels, paddings = [], []
            for f, md, model in zip(files, metas, models):
                if model[key].dim() != 1:
                    raise CheckpointLayoutError(
                        f"{f.path}: flat parameter {key} has shape {tuple(model[key].shape)}; FSDP flat "
                        "parameters are 1-D. The file was edited or damaged."
                    )
                padding = next(p["params"][flat_name].get("padding", 0) for p in md["param_metadata"]
                               if (p.get("fsdp_path", "") or "") == fsdp_path)
                shard_numels.append(model[key].numel())
                paddings.append(int(padding or 0))
            names = tuple(_joined(fsdp_path, n) for n in v["names"])
            fp = FlatParam(key, fsdp_path, names, tuple(tuple(int(x) for x in s) for s in v["shapes"]),
                           tuple(int(x) for x in v["numels"]), tuple(shard_numels), tuple(paddings),
                           models[0][key].dtype)
            bad = [(n, s, k) for n, s, k in zip(fp.names, fp.shapes, fp.numels) if math.prod(s) != k]
            if bad or not len(fp.names) == len(fp.shapes) == len(fp.numels):
                raise CheckpointLayoutError(
                    f"{files[0].path}: {metadata_key} of {key} is inconsistent: "
                    + (f"{bad[0][0]} has shape {bad[0][1]} but numel {bad[0][2]}" if bad else
                       f"{len(fp.names)} names, {len(fp.shapes)} shapes, {len(fp.numels)} numels")
                    + ". The metadata was edited or damaged."
                )
            _check_flat(fp, files)
            flat_params.append(fp)
            tensors.update(_unflatten(fp, index, files, headers))
    buffer_names = tuple(metas[0].get("buffer_names", ()) or ())
    for name, t in model0.items():
        if name not in flat_keys:
            tensors[name] = StoredTensor(name, index, t.dtype, tuple(t.shape),
                                         (_direct_extent(files[0].path, files[0].format, first, name, t),))
    shared = []
    for pm in metas[0]["param_metadata"]:
        fsdp_path = pm.get("fsdp_path", "") or ""
        for pair in pm.get("shared_param_info", ()) or ():
            shared.append((_joined(fsdp_path, pair[0]), _joined(fsdp_path, pair[1])))
    return ModelPart(index, tensors, tuple(flat_params), buffer_names, tuple(shared)), metadata_key


def _stale_metadata_note(f: CheckpointFile, key: str, md: Mapping, model: Mapping) -> str:
    """The warning for FSDP metadata kept beside unflattened weights, saying whether it
    still describes them (same names and shapes) or another model."""
    listed = {}
    for fsdp_path, _, names, shapes, _ in _metadata_structure(md):
        for n, s in zip(names, shapes):
            listed[_joined(fsdp_path, n)] = tuple(int(x) for x in s)
    disagree = [n for n, s in listed.items() if n in model and tuple(model[n].shape) != s]
    absent = [n for n in listed if n not in model]
    note = (f"{os.path.basename(f.path)}: holds unflattened weights but keeps the {key} of the FSDP run it "
            "came from (as metaseq's reshard_fsdp --unflatten-weights writes it); the tensors are used and "
            "the metadata is ignored")
    if disagree or absent:
        note += (f"; it does not describe them: {len(disagree)} shape(s) differ ({_cap(disagree, 3)}), "
                 f"{len(absent)} listed tensor(s) absent ({_cap(absent, 3)})")
    return note + "."


def _check_flat(fp: FlatParam, files: Sequence[CheckpointFile]) -> None:
    where = f"{os.path.basename(files[0].path)}..{os.path.basename(files[-1].path)}"
    if len(set(fp.shard_numels)) > 1:
        sizes = ", ".join(f"{os.path.basename(f.path)}: {n}" for f, n in zip(files, fp.shard_numels))
        raise CheckpointLayoutError(
            f"{where}: {fp.key} has a different size in each shard ({sizes}); every shard of one save "
            "has the same size (the last one padded). Shards of different saves are mixed: keep only "
            "the files written by one save."
        )
    if any(p < 0 or p > n for n, p in zip(fp.shard_numels, fp.paddings)):
        raise CheckpointLayoutError(
            f"{where}: {fp.key}: padding {list(fp.paddings)} does not fit shard sizes "
            f"{list(fp.shard_numels)}: the shard_metadata is inconsistent with the tensors."
        )
    seen_padding = False
    for f, real in zip(files, fp.real_numels):
        if seen_padding and real > 0:
            raise CheckpointLayoutError(
                f"{f.path}: {fp.key}: holds {real} elements after an earlier shard ended in padding "
                f"(paddings {list(fp.paddings)}): inconsistent padding across shards; expected padding "
                "only at the end, as fairscale writes it. The shards come from different saves or were edited."
            )
        seen_padding = seen_padding or real < (fp.shard_numels[0] if fp.shard_numels else 0)
    held = sum(fp.real_numels)
    if held != fp.total_numel:
        raise CheckpointLayoutError(
            f"{where}: {fp.key}: the {len(files)} shard(s) hold {held} elements but its metadata "
            f"lists {fp.total_numel} ({len(fp.names)} tensors): "
            + ("a shard is missing (the set ends early) or " if held < fp.total_numel else "")
            + "the padding recorded in shard_metadata is wrong. Expected one complete set written by one save."
        )


def _unflatten(fp: FlatParam, part: int, files: Sequence[CheckpointFile], headers: Mapping) -> dict:
    """Member tensors of a flat parameter as runs of bytes across the shard files."""
    starts, pos = [], 0
    for real in fp.real_numels:
        starts.append(pos)
        pos += real
    out = {}
    offset = 0
    for name, shape, numel in zip(fp.names, fp.shapes, fp.numels):
        extents = []
        lo, hi = offset, offset + numel
        for f, start, real in zip(files, starts, fp.real_numels):
            a, b = max(lo, start), min(hi, start + real)
            if a >= b:
                continue
            obj = headers[f.path]
            t = _model_dict(obj)[fp.key]
            base = storage_byte_offset(t) if f.format == "zip" else None
            itemsize = t.element_size()
            extents.append(Extent(f.path, _model_key(obj, fp.key), a - start, b - a,
                                  None if base is None else base + (a - start) * itemsize))
        out[name] = StoredTensor(name, part, fp.dtype, shape, tuple(extents))
        offset = hi
    return out


def _cfg_warnings(files: Sequence[Sequence[CheckpointFile]], settings: CheckpointSettings, flat: bool,
                  name: FileName) -> list:
    out = []
    n_parts, n_shards = len(files), len(files[0])
    sharded = flat or n_shards > 1

    def warn(field_name: str, value: Any, files_say: Any) -> None:
        out.append((f"cfg.{field_name}",
                    f"cfg {field_name}={value} but the files hold {files_say}; using the files "
                    "(a consolidated or resharded checkpoint keeps the cfg of the run it came from)."))

    if settings.model_parallel_size is not None and settings.model_parallel_size != n_parts:
        warn("common.model_parallel_size", settings.model_parallel_size, f"{n_parts} model-parallel part(s)")
    if settings.use_sharded_state is not None and settings.use_sharded_state != sharded:
        warn("distributed_training.use_sharded_state", settings.use_sharded_state,
             "FSDP-sharded parts" if sharded else "unsharded weights")
    if settings.distributed_world_size is not None and sharded and settings.distributed_world_size != n_parts * n_shards:
        warn("distributed_training.distributed_world_size", settings.distributed_world_size,
             f"{n_parts} part(s) x {n_shards} shard(s) = {n_parts * n_shards} ranks")
    k_parts = n_shards if name.shard_style == "_part" and name.shard is not None else 1
    if settings.checkpoint_shard_count is not None and settings.checkpoint_shard_count != k_parts:
        warn("checkpoint.checkpoint_shard_count", settings.checkpoint_shard_count, f"{k_parts} _part file(s)")
    return out


def discover(path: "str | os.PathLike", *, trust_pickle: bool = False) -> CheckpointLayout:
    """(any rank, local) Describe the checkpoint set that ``path`` belongs to.

    ``path`` may be a folder, any file of the set (any part, any shard, a
    ``checkpoint_last-*`` link or text pointer), the un-suffixed name metaseq scripts take
    (``.../checkpoint_last.pt``, ``.../reshard.pt``), or a glob; or a Hugging Face folder or
    weight file (``model.safetensors``, a sharded ``*.index.json`` set, ``pytorch_model.bin``). Reads file names and
    pickled headers only, never tensor data, and modifies nothing on disk.

    Raises:
        CheckpointLayoutError: with the file(s), what was found, what was expected and what
            to do, for a missing shard or part, a truncated or non-checkpoint file, an empty
            or ambiguous folder, mixed checkpoints, inconsistent padding, a symlink loop.
        UnsafeCheckpointError: a header needs a class outside the allowlist.
    """
    from ._hf_layout import discover_hf, is_hf_path

    if is_hf_path(os.fspath(path)):
        return discover_hf(os.fspath(path), trust_pickle=trust_pickle)
    fs = _resolve_set(os.fspath(path))
    name, grid = _check_grid(fs)
    if trust_pickle:
        headers = dict(zip(
            [p for row in grid for p in row],
            [read_header(p, trust_pickle=True) for row in grid for p in row],
        ))
    else:
        headers = _read_headers([p for row in grid for p in row])
    for p, h in headers.items():
        if _model_dict(h) is None:
            keys = list(h.keys())[:8] if isinstance(h, Mapping) else type(h).__name__
            raise CheckpointLayoutError(
                f"{p}: not a model checkpoint: its top level is {keys}; expected a metaseq/fairseq "
                "checkpoint (a dict with a 'model' state dict) or a plain state dict of tensors."
            )

    files = tuple(
        tuple(CheckpointFile(p, m, d, os.path.getsize(p), _format(p)) for d, p in enumerate(row))
        for m, row in enumerate(grid)
    )
    # Mixed saves: every file of one save carries the same update count and position.
    run_ids = {f.path: _run_id(headers[f.path]) for row in files for f in row}
    if len({r for r in run_ids.values()}) > 1:
        groups: dict = {}
        for p, r in run_ids.items():
            groups.setdefault(r, []).append(os.path.basename(p))
        desc = "; ".join(f"num_updates={r[0]}, epoch={r[1]}, iterations_in_epoch={r[2]}: {', '.join(v)}"
                         for r, v in groups.items())
        raise CheckpointLayoutError(
            f"{os.path.join(fs.directory, fs.prefix)}: files of different saves are mixed in one set ({desc}). "
            "Keep only the files written by one save."
        )

    stale: list = []
    built = [_build_part(m, row, headers, stale) for m, row in enumerate(files)]
    parts = tuple(p for p, _ in built)
    readings = {bool(p.flat_params) for p in parts}
    if len(readings) > 1:
        flat = [str(p.index) for p in parts if p.flat_params]
        raise CheckpointLayoutError(
            f"{os.path.join(fs.directory, fs.prefix)}: model part(s) {_cap(flat)} hold flat FSDP shards but "
            f"the others hold unflattened weights: files of different saves are mixed. Keep only the files "
            "written by one save."
        )
    metadata_key = built[0][1]
    names0 = list(parts[0].tensors)
    for p in parts[1:]:
        if list(p.tensors) != names0 and set(p.tensors) != set(names0):
            diff = sorted(set(p.tensors) ^ set(names0))
            raise CheckpointLayoutError(
                f"{files[p.index][0].path}: model part {p.index} holds other tensors than part 0 "
                f"(e.g. {_cap(diff)}): parts of different models are mixed. Keep only one save's parts."
            )
        for n, t in p.tensors.items():
            t0 = parts[0].tensors[n]
            if t.dtype != t0.dtype:
                raise CheckpointLayoutError(
                    f"{files[p.index][0].path}: {n} is stored as {str(t.dtype).replace('torch.', '')} in model "
                    f"part {p.index} but as {str(t0.dtype).replace('torch.', '')} in part 0: parts of different "
                    "saves (or a part converted on its own) are mixed. Keep only one save's parts, or convert "
                    "all of them."
                )

    settings = _settings(headers[files[0][0].path])
    if name.part is not None and settings.model_parallel_size and settings.model_parallel_size > len(files):
        missing = [name.format(part=m, shard=0 if name.shard is not None else None)
                   for m in range(len(files), settings.model_parallel_size)]
        raise CheckpointLayoutError(
            f"{os.path.join(fs.directory, fs.prefix)}: found model parts 0..{len(files) - 1} but cfg "
            f"common.model_parallel_size={settings.model_parallel_size} (missing {_cap(missing)}). "
            "Copy the missing part(s) next to the others."
        )
    stale_cfg = _cfg_warnings(files, settings, bool(parts[0].flat_params), name)
    updates = run_ids[files[0][0].path][0] if run_ids else None
    first = headers[files[0][0].path]
    cfg = first.get("cfg") if isinstance(first.get("cfg"), Mapping) else None
    if (cfg is not None and "reshard" in cfg) or any(".qkv_proj." in n for n in names0):
        flavor = "metaseq"
    elif first.get("cfg") is not None or first.get("args") is not None:
        flavor = "fairseq"
    else:
        flavor = "pytorch"
    return CheckpointLayout(
        directory=fs.directory,
        prefix=fs.prefix,
        name=name,
        files=files,
        parts=parts,
        cfg=settings,
        metadata_key=metadata_key,
        aliases=fs.aliases,
        num_updates=updates,
        flavor=flavor,
        warnings=tuple(w for _, w in stale + stale_cfg),
        stale_metadata=tuple(dict.fromkeys(k for k, _ in stale + stale_cfg)),
        trust_pickle=trust_pickle,
    )
