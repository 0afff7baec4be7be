"""The machinery every ``torch.save`` family shares: the ``.pt`` file-name grammar's sets,
pointers and links, and the pickled headers. Model parts are built from those headers in
:mod:`._parts`.

The family modules (:mod:`.metaseq`, :mod:`.plain`) add what only they know (what a
``cfg`` means, which writer a file came from); nothing here interprets a ``cfg``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import glob
import os
import re
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

from .. import _storage
from .._errors import (CheckpointLayoutError, CheckpointNotFoundError, OneloadError, OutOfResourcesError,
                       cap_list as _cap, os_error_message)
from .._layout import CheckpointFile, FileName, omegaconf_types
from .._reading import Extent, key_path, range_readable, read_header, storage_byte_offset
from .._zip import NOT_TORCH_IN_A_SET, file_kind
from . import _index

__all__ = ["TRAINING_KEYS", "FileSet", "TorchSet", "scan", "resolve_links", "resolve_grid", "skipped_note", "read_set",
           "alone_if_one", "container", "model_dict", "model_key", "direct_extent", "file_format", "check_tensor"]

_POINTER_MAX_BYTES = 4096
_MAX_POINTER_HOPS = 40
# Where torch.save'd training checkpoints keep the model's state dict: metaseq/fairseq
# ("model"), Lightning ("state_dict"), the PyTorch tutorials ("model_state_dict"), DeepSpeed
# ("module"). A bare state dict is its own container.
_CONTAINERS = ("model", "state_dict", "model_state_dict", "module")
# Keys only metaseq/fairseq training checkpoints carry.
TRAINING_KEYS = ("cfg", "args", "optimizer_history", "shard_metadata", "fsdp_metadata", "extra_state")


# --------------------------------------------------------------------------- pointers


def _read_pointer(path: str) -> Optional[str]:
    """The target name if ``path`` is a tiny text file holding a checkpoint file name (how
    a symlink looks after a copy that does not keep links, e.g. a git checkout)."""
    try:
        raw = _storage.read_small(path, _POINTER_MAX_BYTES)
    except OSError:
        return None
    if raw is None:
        return None
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    if not text or "\n" in text or not text.endswith(".pt") or "\x00" in text:
        return None
    return text


def resolve_links(path: str) -> str:
    """Follow symlinks and text pointers to the real file; raise on loops and dangling
    links."""
    if _storage.is_url(path):
        return _resolve_url(path)
    chain = [path]
    current = path
    for _ in range(_MAX_POINTER_HOPS):
        try:
            real = os.path.realpath(current, strict=True)
        except OSError as e:
            if e.errno == errno.EACCES:
                raise CheckpointLayoutError(
                    f"{path}: permission denied while following {' -> '.join(chain)}: a folder on the way "
                    "cannot be searched by this user. Check the permissions (ls -ld on each folder) or run "
                    "as a user who can read the checkpoint."
                ) from None
            if os.path.islink(current) and ("loop" in str(e).lower() or getattr(e, "errno", None) == 40):
                raise CheckpointLayoutError(
                    f"{path}: symlink loop ({' -> '.join(chain)} -> ...); point the link at a real "
                    "checkpoint file."
                ) from None
            if os.path.lexists(current) or len(chain) > 1:
                shown = chain + ([os.readlink(current)] if os.path.islink(current) else [])
                raise CheckpointLayoutError(
                    f"{path}: dangling link: {' -> '.join(shown)} does not exist. Re-create the link "
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


def _resolve_url(url: str) -> str:
    """An object store has no links; a small object holding a file name is a pointer."""
    chain = [url]
    current = url
    for _ in range(_MAX_POINTER_HOPS):
        try:
            st = _storage.stat(current)
        except FileNotFoundError:
            if len(chain) > 1:
                raise CheckpointLayoutError(
                    f"{url}: dangling pointer: {' -> '.join(chain)} does not exist. Rewrite the pointer "
                    "or pass the checkpoint's real object name.") from None
            raise CheckpointNotFoundError(
                f"{url}: no such object (nor a folder of that name). Check the bucket and key, e.g. with "
                "`aws s3 ls` or `fsspec`'s ls, and the endpoint and credentials "
                "(docs/remote.md).") from None
        except PermissionError as e:
            raise CheckpointLayoutError(
                f"{url}: access denied ({e}): the credentials this process has may not read it. Check "
                "them (AWS_PROFILE, AWS_ACCESS_KEY_ID, METASEQ_ONELOAD_STORAGE_OPTIONS; docs/remote.md).") from None
        if st.isdir:
            return current
        target = _read_pointer(current) if st.size <= _POINTER_MAX_BYTES else None
        if target is None:
            return current
        nxt = current.rsplit("/", 1)[0] + "/" + target
        if nxt in chain:
            raise CheckpointLayoutError(f"{url}: pointer loop ({' -> '.join(chain + [nxt])}).")
        chain.append(nxt)
        current = nxt
    raise CheckpointLayoutError(f"{url}: more than {_MAX_POINTER_HOPS} pointers deep ({' -> '.join(chain[:5])} ...).")


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


def scan(directory: str, problems: Optional[list] = None) -> list:
    """The folder's *.pt entries, resolved. A broken link is skipped here (and noted in
    ``problems``): if it belonged to the set the user asked for, the grid check names the
    missing file instead."""
    try:
        names = sorted(_storage.listdir(directory))
    except PermissionError:
        raise CheckpointLayoutError(
            f"{directory}: permission denied: this user cannot list the folder. Check its permissions "
            "(ls -ld) or run as a user who can read the checkpoint."
        ) from None
    except OSError as e:
        if e.errno == errno.ENOMEM:  # the machine's, not the folder's
            raise OutOfResourcesError(os_error_message(e, directory, doing="list")) from e
        raise CheckpointLayoutError(f"{directory}: cannot list the folder ({e.strerror or e}).") from e
    entries = []
    for n in names:
        parsed = FileName.parse(n)
        full = os.path.join(directory, n)
        if parsed is None or _storage.isdir(full):
            continue
        try:
            entries.append(_Entry(n, parsed, resolve_links(full)))
        except CheckpointLayoutError as e:
            if problems is not None:
                problems.append(str(e))
    return entries


# --------------------------------------------------------------------------- sets


@dataclass(frozen=True)


class FileSet:
    directory: str
    prefix: str
    members: tuple  # real paths
    aliases: tuple  # entry names pointing into the set that are not its real names
    # What the folder the user named held beside the set and was skipped, each "name (why)".
    skipped: tuple = ()


def _set_from(key: tuple, entries: Iterable) -> FileSet:
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
        for e in scan(directory):
            if e.set_key == key:
                members.add(e.real)
                if os.path.join(directory, e.name) != e.real:
                    aliases.add(e.name)
    return FileSet(directory, prefix, tuple(sorted(members)), tuple(sorted(aliases)))


# FasterTransformer's converters write one raw array per tensor (and tensor-parallel rank),
# model.<name>.bin, beside a config.ini: no pickle, no dtype, nothing a loader could map.
_FT_WEIGHT_RE = re.compile(r"^model\..+\.bin$")
_PARAM_LEAVES = ("weight", "bias")


def _fastertransformer_files(directory: str) -> list:
    try:
        names = sorted(_storage.listdir(directory))
    except OSError:
        return []
    bins = [n for n in names if _FT_WEIGHT_RE.match(n)]
    return (["config.ini"] if bins and "config.ini" in names else []) + bins


def _fastertransformer_note(names: Sequence[str]) -> str:
    bins = [n for n in names if _FT_WEIGHT_RE.match(n)]
    return (f"{len(names)} FasterTransformer file(s) ({'config.ini and ' if 'config.ini' in names else ''}"
            f"{len(bins)} model.*.bin, e.g. {bins[0]}): raw weight arrays without names or "
            "dtypes, a format metaseq-oneload does not read (load them with FasterTransformer, or pass the "
            "metaseq checkpoint they were converted from)")


def _why_not_a_model(obj: Any) -> Optional[str]:
    """Why a readable header holds no model's weights (a metrics or logits file saved beside a
    checkpoint), or None where it does: a training container, or a bare state dict with a
    parameter-like name (``decoder.layers.0.fc1.weight``, ``weight``)."""
    if not isinstance(obj, Mapping):
        return f"holds a {type(obj).__name__}, not a state dict"
    key = container(obj)
    if key:
        return None
    if key is None and any(k in obj for k in _CONTAINERS + TRAINING_KEYS):
        return None  # a training checkpoint, maybe damaged: reading the set says what is wrong with it
    keys = [str(k) for k in obj.keys()]
    tensors = [k for k, v in obj.items() if torch.is_tensor(v)]
    if key is None:
        what = f"{len(tensors)} tensor(s) among" if tensors else "no tensors, only"
        return f"{what} {len(keys)} value(s) ({_cap(keys, 3)}): no model state dict"
    for k, v in obj.items():
        if v.is_floating_point() and v.dim() >= 1 and ("." in k or k in _PARAM_LEAVES):
            return None
    return (f"{len(tensors)} tensor(s) named {_cap(keys, 3)}: no parameter names such as "
            "decoder.layers.0.fc1.weight, so not a model's weights")


def _kind_of_set(fs: FileSet) -> tuple:
    """("model", None), ("other", why) for a readable file that holds no model's weights, or
    ("unreadable", None) / ("unknown", None) where its header cannot be read here (damaged, or
    a pickle the allowlist refuses: reading the set says which, under trust_pickle too)."""
    try:
        obj = read_header(fs.members[0])
    except CheckpointLayoutError:
        return "unreadable", None
    except OneloadError:
        return "unknown", None
    why = _why_not_a_model(obj)
    return ("model", None) if why is None else ("other", why)


def skipped_note(fs: FileSet) -> tuple:
    """The notes saying what the folder held beside ``fs`` and why it was skipped."""
    return tuple(f"skipped {s}" for s in fs.skipped)


def _describe_sets(sets: Sequence[FileSet]) -> str:
    return ", ".join(f"{s.prefix} ({len(s.members)} file{'s' * (len(s.members) != 1)})" for s in sets)


def _resolve_set(path: str) -> FileSet:
    """(local) The one set of files ``path`` names: a glob, a folder, a file (or a link or
    pointer to one), or the un-suffixed name of a set."""
    path = os.fspath(path)
    if glob.has_magic(path):
        return _set_of_glob(path)
    if _storage.isdir(path):
        return _set_of_folder(path)
    if _storage.lexists(path):
        return _set_of_file(path)
    return _set_of_prefix(path)


def _set_of_file(path: str) -> FileSet:
    real = resolve_links(path)
    if _storage.isdir(real):
        return _resolve_set(real)
    entry = _Entry(os.path.basename(path), FileName.parse(os.path.basename(path)) or FileName(path), real)
    if entry.real_name is None:
        raise CheckpointLayoutError(
            f"{path}: not a checkpoint file name: expected a name ending in .pt "
            "(X.pt, X-model_part-M.pt, X-model_part-M-shardD.pt, X-shardD.pt, X_partK.pt)."
        )
    return _set_from(entry.set_key, [entry])


def _set_of_glob(path: str) -> FileSet:
    matches = [m for m in sorted(_storage.glob(path)) if not _storage.isdir(m)]
    if not matches:
        raise CheckpointNotFoundError(f"{path}: the pattern matches no files.")
    entries = [_Entry(os.path.basename(m), FileName.parse(os.path.basename(m)) or FileName(m), resolve_links(m))
               for m in matches]
    keys = sorted({e.set_key for e in entries})
    if len(keys) > 1:
        raise CheckpointLayoutError(
            f"{path}: the pattern matches files of {len(keys)} different checkpoints "
            f"({', '.join(os.path.join(*k) for k in keys)}); narrow it to one."
        )
    return _set_from(keys[0], entries)


def _set_of_folder(path: str) -> FileSet:
    problems: list = []
    entries = scan(path, problems)
    if not entries and problems:
        # Links whose targets are not here: on a rank where a mount is missing this is "not
        # visible" (the others can send the weights), so not-found, with the true reason.
        raise CheckpointNotFoundError(
            f"{path}: the folder holds {len(problems)} *.pt entr{'y' if len(problems) == 1 else 'ies'} "
            f"but none can be read: {_cap(problems, 3, fmt=lambda m: m.rstrip('.'), sep='; ')}."
        )
    foreign = _fastertransformer_files(path)
    if not entries and foreign:
        raise CheckpointLayoutError(
            f"{path}: the folder holds no *.pt files, only {_fastertransformer_note(foreign)}. Expected a "
            "checkpoint such as checkpoint_last.pt or checkpoint_N-model_part-0-shard0.pt."
        )
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
    return _one_of(path, [_set_from(k, v) for k, v in sorted(by_key.items())], foreign)


def _one_of(path: str, sets: Sequence[FileSet], foreign: Sequence[str]) -> FileSet:
    """The one checkpoint among a folder's sets: what is not a model's weights is skipped
    (and noted), several checkpoints are an error naming them."""
    # A lone set with our index beside it is ours: not unpickled just to be sure.
    lone_ours = (len(sets) == 1 and not foreign
                 and _storage.lexists(_index.index_path(sets[0].directory, sets[0].prefix)))
    kinds = [("model", None) if lone_ours else _kind_of_set(s) for s in sets]
    skipped = [f"{os.path.basename(s.members[0])}"
               + (f" and {len(s.members) - 1} more file(s) of {s.prefix}" if len(s.members) > 1 else "")
               + f" ({why})" for s, (kind, why) in zip(sets, kinds) if kind == "other"]
    if foreign:
        skipped.append(_fastertransformer_note(foreign))
    # Damaged files stay candidates only where nothing else is: reading them says what they are.
    candidates = ([s for s, (kind, _) in zip(sets, kinds) if kind in ("model", "unknown")]
                  or [s for s, (kind, _) in zip(sets, kinds) if kind == "unreadable"])
    if len(candidates) == 1:
        return replace(candidates[0], skipped=tuple(skipped))
    if not candidates:
        raise CheckpointLayoutError(
            f"{path}: the folder holds no checkpoint; skipped {'; '.join(skipped)}. Expected a checkpoint "
            "such as checkpoint_last.pt or checkpoint_N-model_part-0-shard0.pt: pass its folder or one of "
            "its files."
        )
    raise CheckpointLayoutError(
        f"{path}: the folder holds {len(candidates)} checkpoints and no checkpoint_last: "
        f"{_describe_sets(candidates)}. Choose one by passing its name, e.g. "
        f"{os.path.join(path, candidates[-1].prefix + '.pt')}."
        + (f" (Not checkpoints, so skipped {'; '.join(skipped)}.)" if skipped else "")
    )


def _set_of_prefix(path: str) -> FileSet:
    """The un-suffixed name metaseq scripts take: X.pt where only X-model_part-*.pt,
    X-shard*.pt or X_part*.pt exist (checkpoint_last.pt, reshard.pt, checkpoint_2.pt); or the
    bare prefix X, as convert's destination and inspect's "checkpoint" show it."""
    directory, base = os.path.split(path)
    directory = directory or "."
    if not base or not _storage.isdir(directory):
        raise CheckpointNotFoundError(f"{path}: no such file or folder.")
    stem = base[:-3] if base.endswith(".pt") else base
    entries = [e for e in scan(directory) if e.parsed.prefix == stem]
    if not entries:
        raise CheckpointNotFoundError(
            f"{path}: no such file{'' if base.endswith('.pt') else ' or folder'}, and no "
            f"{'' if base.endswith('.pt') else stem + '.pt, '}{stem}-model_part-*.pt, "
            f"{stem}-shard*.pt or {stem}_part*.pt "
            f"beside it in {_storage.abspath(directory)}. Pass an existing file or the folder."
        )
    keys = sorted({e.set_key for e in entries})
    if len(keys) > 1:
        raise CheckpointLayoutError(
            f"{path}: the files named {stem}-* point to {len(keys)} different checkpoints "
            f"({', '.join(k[1] for k in keys)}); fix the links or pass one file."
        )
    return _set_from(keys[0], entries)


# --------------------------------------------------------------------------- headers


def container(obj: Any) -> Optional[str]:
    """The key under which ``obj`` keeps its model state dict, "" for a bare state dict, or
    None if it holds none. An OmegaConf container is never one (its ``get`` and ``values``
    resolve the interpolations the file chose; ``read_header`` refuses such a header)."""
    if not isinstance(obj, Mapping) or isinstance(obj, omegaconf_types()):
        return None
    for key in _CONTAINERS:
        model = obj.get(key)
        if isinstance(model, Mapping) and not isinstance(model, omegaconf_types()) and model \
                and all(isinstance(k, str) for k in model) \
                and all(torch.is_tensor(v) for v in model.values()):
            return key
    if obj and all(isinstance(k, str) for k in obj) and all(torch.is_tensor(v) for v in obj.values()):
        return ""  # a bare state dict (plain PyTorch)
    return None


def model_dict(obj: Any) -> Optional[Mapping]:
    """The model state dict inside a checkpoint object, or None if it has none."""
    key = container(obj)
    if key is None:
        return None
    return obj[key] if key else obj


def model_key(obj: Mapping, name: str) -> str:
    key = container(obj)
    return key_path(key, name) if key else key_path(name)


def _contiguous(t: torch.Tensor) -> bool:
    expected, stride = 1, []
    for s in reversed(t.shape):
        stride.append(expected)
        expected *= s
    return t.dim() == 0 or all(st == ex or sz == 1 for st, ex, sz in zip(t.stride(), reversed(stride), t.shape))


def direct_extent(path: str, fmt: str, obj: Mapping, name: str, t: torch.Tensor) -> Extent:
    check_tensor(path, fmt, name, t)
    offset = storage_byte_offset(t) if fmt == "zip" and _contiguous(t) else None
    return Extent(path, model_key(obj, name), 0, t.numel(), offset)


def file_format(path: str) -> str:
    """"zip" when tensors can be read in place, "zip-packed" for a zip whose records are
    compressed or big-endian, "legacy" for torch's pre-1.6 format (both read whole)."""
    kind = file_kind(path)
    if kind == "zip" and not range_readable(path):
        return "zip-packed"
    return kind


def _fmt_list(xs: Sequence[int], n: int = 20) -> str:
    return ",".join(str(x) for x in xs[:n]) + (f",... ({len(xs) - n} more)" if len(xs) > n else "")


def _check_grid(fs: FileSet) -> tuple:
    """Parse member names into a [part][shard] grid; raise on mixed or missing files."""
    parsed = {p: FileName.parse(os.path.basename(p)) for p in fs.members}
    patterns = {n.pattern for n in parsed.values()}
    if len(patterns) > 1:
        raise CheckpointLayoutError(
            f"{os.path.join(fs.directory, fs.prefix)}: mixed naming in one set: "
            f"{_cap(sorted(os.path.basename(p) for p in fs.members), 8)}. Expected every file to "
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
            f"{_fmt_list(parts)} of {n_parts} (missing {_cap(missing, fmt=lambda m: any_name.format(part=m, shard=0 if any_name.shard is not None else None))}). "
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
                f"(missing {_cap(missing, fmt=lambda d: any_name.format(part=m, shard=d))}). "
                "Copy the missing shard(s) next to the others."
            )
    return any_name, [[grid[m][d] for d in range(n_shards)] for m in range(n_parts)]


def _read_headers(paths: Sequence[str]) -> dict:
    if len(paths) <= 1:  # a singleton's header is cached by detection: a pool's start is the cost
        return {p: read_header(p) for p in paths}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(paths))) as pool:
        return dict(zip(paths, pool.map(read_header, paths)))

# --------------------------------------------------------------------------- sets of files


@dataclass(frozen=True)


class TorchSet:
    """A complete grid of ``torch.save`` files, their headers read: what every torch family's
    describer starts from."""

    fileset: FileSet
    name: FileName
    files: tuple  # [part][shard] of CheckpointFile
    headers: Mapping  # path -> header

    @property
    def label(self) -> str:
        return os.path.join(self.fileset.directory, self.fileset.prefix)

    @property
    def first(self) -> Any:
        return self.headers[self.files[0][0].path]


@contextlib.contextmanager
def alone_if_one(paths: Sequence[str]):
    """A set of one file that is not torch at all was named alone (a README, a text file):
    the advice is to pass a checkpoint, not to take the file out of a set it alone makes."""
    try:
        yield
    except CheckpointLayoutError as e:
        text = str(e)
        if len(paths) != 1 or not text.endswith(NOT_TORCH_IN_A_SET):
            raise
        raise CheckpointLayoutError(
            text[:-len(NOT_TORCH_IN_A_SET)] + " Pass a checkpoint: a file torch.save wrote (a metaseq or fairseq "
            ".pt, a state dict), a folder holding one, or a Hugging Face model folder.") from None


def resolve_grid(path: str) -> tuple:
    """(local) ``path`` resolved to one complete grid of files, from names alone:
    (file set, parsed name, [part][shard] of paths)."""
    fs = _resolve_set(os.fspath(path))
    name, grid = _check_grid(fs)
    return fs, name, grid


def read_set(path: str, *, trust_pickle: bool = False, resolved: Optional[tuple] = None) -> TorchSet:
    """(local) Resolve ``path`` to one complete grid of files and read their headers."""
    fs, name, grid = resolved or resolve_grid(path)
    paths = [p for row in grid for p in row]
    with alone_if_one(paths):
        if trust_pickle:
            headers = {p: read_header(p, trust_pickle=True) for p in paths}
        else:
            headers = _read_headers(paths)
    for p, h in headers.items():
        if model_dict(h) is None:
            keys = _cap([repr(k) for k in h.keys()], 8) if isinstance(h, Mapping) else type(h).__name__
            raise CheckpointLayoutError(
                f"{p}: not a model checkpoint: its top level is [{keys}]; expected a metaseq/fairseq "
                "checkpoint (a dict with a 'model' state dict) or a plain state dict of tensors."
            )
    files = tuple(
        tuple(CheckpointFile(p, m, d, _storage.getsize(p), file_format(p)) for d, p in enumerate(row))
        for m, row in enumerate(grid)
    )
    return TorchSet(fs, name, files, headers)


# What the expanded views of one file may take once loaded (a load gives each as a
# contiguous copy, where torch.load gives a view of its storage): a broadcast bias or
# position ids cost a few KB; a 1 MB file must not make a load allocate GBs.
_EXPANDED_FLOOR = 64 << 20
_EXPANDED_RATIO = 16


def check_tensor(path: str, fmt: str, shown: str, t: torch.Tensor, expanded: Optional[list] = None) -> None:
    """A load builds each tensor whole (its elements in order), so one that declares more
    bytes than its file stores for it (an expanded view: torch.load gives a view of its small
    storage) is allocated at its declared size: loaded as torch.load's values while the
    file's expanded views (``expanded``: [bytes so far], shared across its tensors) stay
    within max(64 MiB, 16 x the file's size); past it refused here, at inspect."""
    s = t.untyped_storage()
    dtype = str(t.dtype).replace("torch.", "")
    need = t.numel() * t.element_size()
    if fmt != "legacy" and (getattr(s, "_oneload_storageless", False) or not hasattr(s, "_oneload_offset")):
        raise CheckpointLayoutError(
            f"{path}: tensor {shown}: saved without data (a meta tensor: shape {tuple(t.shape)}, {t.numel()} "
            f"{dtype} elements, {need} bytes, and no record in the file), so there are no weights to load. "
            "Save the checkpoint from a model whose weights are materialised (not on the meta device).")
    if need > s.nbytes():
        # torch.load returns such a tensor as a view of its small storage; a load here
        # allocates every element
        total = need + (expanded[0] if expanded else 0)
        budget = max(_EXPANDED_FLOOR, _EXPANDED_RATIO * _storage.getsize(path))
        if total > budget:
            raise CheckpointLayoutError(
                f"{path}: tensor {shown}: shape {tuple(t.shape)} stride {tuple(t.stride())} is an expanded view "
                f"whose {t.numel()} {dtype} elements ({need} bytes) repeat the {s.nbytes()} bytes its record "
                f"holds; loading it would allocate {need} bytes where torch.load returns a view of {s.nbytes()}, "
                f"past the {budget} bytes the expanded views of one file may take (64 MiB, or {_EXPANDED_RATIO} "
                f"times the file's size{f'; {total - need} taken by the ones before it' if total > need else ''}). "
                "If these weights are meant, re-save the tensor with .contiguous(); else leave it out of the state "
                "dict.")
        if expanded is not None:
            expanded[0] = total
