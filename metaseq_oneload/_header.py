"""The one header reader: a torch checkpoint's pickle onto ``meta``, checked against its file.

:func:`read_header` reads a file's pickle and, for a zip, its records (:mod:`._zip`), never
tensor data. Two unpicklers can read the pickle, and one set of checks judges what either
gives:

* the one pass of the C unpickler (:mod:`._unpickle`) reads every plain torch.save pickle,
  under exactly the allowlist of torch's ``weights_only`` loader (:mod:`._allowlist`); it
  lists the storages the pickle names as :class:`._unpickle.StorageRef` and checks them and
  every tensor against the records as it builds the meta tensors.
* torch's own ``weights_only`` loader is its single fallback, for what the one pass does not
  build (a tensor subclass, an omegaconf config, a legacy file) or finds wrong. Its result
  goes through :func:`check_zip`: the pickle's storages, listed by a replay with a stand-in
  for every global (the same :class:`._unpickle.StorageRef`), against the records; every
  tensor inside its storage (:func:`check_bounds`); the verified offsets attached.
  :func:`check_configs` refuses an OmegaConf config anywhere but the top-level
  ``cfg``/``args``, where the one pass builds none.

A file the one pass finds wrong gets its refusal in the fallback's words, which name the
tensor; where those checks let the file through, the one pass's finding stands.
"""

from __future__ import annotations

import argparse
import functools
import io
import os
import pickle
import warnings
import zipfile
from typing import Any, Optional

import torch

from . import _storage
from ._allowlist import allowlisted
from ._errors import (CheckpointLayoutError, OneloadError, UnsafeCheckpointError, os_error_message, out_of_resources,
                      resource_problem)
from ._opscan import stream, torch_opcodes_only
from ._unpickle import MAX_DEPTH, header as one_pass, last_element, storage_of, storage_record, too_deep_error
from ._zip import ZipIndex, bad_zip, file_kind, record_bytes, stat_key, zip_index

__all__ = ["read_header", "torch_load", "walk_tensors", "check_zip", "check_configs", "check_bounds"]


def _describe_unsafe(path: str, error: str = "") -> str:
    """What torch's weights_only loader refused in the file (``error``: its message), as the
    rest of the sentence "refused to unpickle: ..."."""
    if "Unsupported operand" in error:  # e.g. protocol 4's FRAME: no class involved at all
        proto = ""
        try:  # best effort: the PROTO opcode that starts the pickle of a local file
            if not _storage.is_url(path):
                with zipfile.ZipFile(path) as z:
                    head = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))[:2]
                proto = f" (protocol {head[1]})" if head[:1] == b"\x80" else ""
        except Exception:  # noqa: BLE001 - the refusal stands either way
            pass
        return (f"the file uses pickle opcodes torch's weights_only loader cannot read{proto}; re-save it with "
                "torch.save's default protocol")
    try:
        with allowlisted():
            names = torch.serialization.get_unsafe_globals_in_checkpoint(
                _storage.RemoteFile(path) if _storage.is_url(path) else path)
    except Exception:  # the scan is best effort; the refusal stands either way
        names = []
    if not names and "WeightsUnpickler error: " in error:  # allowlisted names, used in a way it refuses
        why = next((ln.strip() for ln in error.split("WeightsUnpickler error: ", 1)[1].splitlines() if ln.strip()), "")
        return f"the file asks torch's weights_only loader for what it refuses ({why})"
    return (f"the file needs {', '.join(names) if names else 'a class outside the allowlist'}, which is not on "
            "the allowlist of classes that metaseq/fairseq checkpoints carry")


# --------------------------------------------------------------------------- the pickle's storages
@functools.lru_cache(maxsize=None)
def _storage_class_dtype(module: str, name: str) -> Optional[torch.dtype]:
    """torch.FloatStorage -> torch.float32, torch.storage.UntypedStorage -> torch.uint8: the
    classes torch.save names in a persistent id (bytes of dtypes without a typed class, e.g.
    float8 or uint16, are saved untyped)."""
    if module not in ("torch", "torch.storage") or not name.endswith("Storage"):
        return None
    with warnings.catch_warnings():  # the typed storage classes are deprecated, not their names
        warnings.simplefilter("ignore")
        cls = getattr(torch if module == "torch" else torch.storage, name, None)
        if cls is torch.UntypedStorage:
            return torch.uint8
        dtype = getattr(cls, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


class _Anything:
    """Stands in for every object a pickle builds while its storage references are listed:
    takes any arguments and state, does nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass

    def append(self, value):
        pass

    def extend(self, values):
        pass

    def add(self, value):
        pass


@functools.lru_cache(maxsize=None)
def _anything_named(module: str, name: str) -> type:
    return type(name, (_Anything,), {"global_name": (module, name)})


class _StorageLister(pickle.Unpickler):
    """Replays a pickle with a stand-in for every global it names (nothing is imported,
    nothing of the file's runs) to see its persistent ids, in the order torch's loader meets
    them."""

    def __init__(self, data: bytes):
        super().__init__(stream(data))
        self.pids: list = []

    def find_class(self, module, name):
        return _anything_named(module, name)

    def persistent_load(self, pid):
        self.pids.append(pid)
        return _Anything()


class _DictMemoLister(pickle._Unpickler):
    """The same replay in pickle's Python unpickler, whose memo is a dict (as torch's
    loader's is): a memo index far past the memo costs one entry, where the C unpickler
    grows an array to twice the index and clears it (LONG_BINPUT 2**27 in a 1 KB file: 2 GiB
    written). About as slow as torch's loader, so only for pickles the C one cannot take."""

    find_class = _StorageLister.find_class
    persistent_load = _StorageLister.persistent_load

    def __init__(self, data: bytes):
        super().__init__(stream(data))
        self.pids: list = []


def _dtype_named(stand_in: Any) -> Optional[torch.dtype]:
    """The dtype of a storage class as the listing's stand-in names it (None: not one)."""
    name = getattr(stand_in, "global_name", None)
    if not (isinstance(name, tuple) and len(name) == 2):
        return None
    return _storage_class_dtype(*name)


def _storage_refs(data: bytes, path: str) -> list:
    """(local) The storages a torch pickle refers to, each once, in first-use order."""
    try:
        # torch.save's pickles (only opcodes torch's loader reads, memo indices within the
        # pickle's length: a memo of at most 16 bytes per pickle byte) go through the C one
        lister = (_StorageLister if torch_opcodes_only(data) else _DictMemoLister)(data)
        lister.load()
    except Exception as e:  # noqa: BLE001 - whatever a stand-in could not stand in for
        raise CheckpointLayoutError(
            f"{path}: cannot list the tensor storages its pickle refers to ({type(e).__name__}: {e}); the "
            "pickle is not one torch.save writes. Re-save the checkpoint with torch.save.") from None
    refs: dict = {}
    for pid in lister.pids:
        ref = storage_of(pid, _dtype_named)
        if ref is None:
            raise CheckpointLayoutError(
                f"{path}: its pickle refers to {pid!r}, which is not a storage torch.save writes "
                "('storage', <dtype>Storage, key, location, elements). Re-save the checkpoint with torch.save.")
        first = refs.setdefault(ref.key, ref)
        if not first.same(ref):
            raise CheckpointLayoutError(
                f"{path}: its pickle refers to storage {ref.key} as {first.numel} {first.dtype} elements "
                f"and as {ref.numel} {ref.dtype}; the file was edited. Re-save it with torch.save.")
    return list(refs.values())


# --------------------------------------------------------------------------- the header's tensors
_WALKED = (dict, list, tuple, argparse.Namespace, torch.Tensor, torch.UntypedStorage, torch.TypedStorage, set)


def _key_height(k: Any, file: str, path: tuple, depth: int) -> int:
    """How deep a dict key or set element nests (tuples in tuples), bounded like values."""
    if type(k) is not tuple:
        return 0
    if depth > MAX_DEPTH:
        raise too_deep_error(file, list(path))
    return 1 + max((_key_height(v, file, path, depth + 1) for v in k), default=0)


def walk_tensors(obj: Any, file: str = "the checkpoint", path: tuple = (), seen: Optional[set] = None,
                 depth: int = 1, heights: Optional[dict] = None):
    """(local) (dotted name, tensor or storage) for every tensor in dicts, lists, tuples and
    Namespaces (an omegaconf container holds no tensors, and iterating one resolves
    interpolations). Each container is entered once however often it is shared; past
    ``MAX_DEPTH`` levels of nesting (counting the levels a shared container holds
    wherever it is met again) it raises CheckpointLayoutError naming ``file``."""
    if seen is None:
        seen, heights = set(), {}
    if isinstance(obj, torch.Tensor):
        if obj.layout == torch.strided:  # sparse tensors are read whole, like legacy files
            yield ".".join(path), obj
        return
    if isinstance(obj, (torch.UntypedStorage, torch.TypedStorage)):
        yield ".".join(path), obj
        return
    if isinstance(obj, (dict, list, tuple, argparse.Namespace, set)):
        if id(obj) in seen:
            h = heights.get(id(obj))  # None while it is walked: a cycle
            if h is not None and depth + h - 1 > MAX_DEPTH:
                raise too_deep_error(file, list(path))
            return
        if depth > MAX_DEPTH:
            raise too_deep_error(file, list(path))
        seen.add(id(obj))
        sub = 0
        if isinstance(obj, set):  # not searched for tensors (as before); its elements nest
            sub = max((_key_height(k, file, path, depth + 1) for k in obj), default=0)
        else:
            if isinstance(obj, dict) and not all(type(k) is str for k in obj):
                sub = max((_key_height(k, file, path, depth + 1) for k in obj), default=0)
            items = (vars(obj).items() if isinstance(obj, argparse.Namespace)
                     else obj.items() if isinstance(obj, dict) else enumerate(obj))
            for k, v in items:
                if isinstance(v, _WALKED):
                    yield from walk_tensors(v, file, path + (str(k),), seen, depth + 1, heights)
                    sub = max(sub, heights.get(id(v), 0))
        if depth + sub > MAX_DEPTH:
            raise too_deep_error(file, list(path))
        heights[id(obj)] = 1 + sub


# Where a checkpoint may keep an OmegaConf config: its top-level ``cfg`` and ``args``, read
# raw everywhere (``_layout.raw_get``). Anywhere else every ``.get``, ``in``, ``.values()``
# on a DictConfig resolves the interpolations the file chose, and the tensor walk does not
# enter one.
_CONFIG_KEYS = ("cfg", "args")


def _omegaconf_node() -> Optional[type]:
    try:
        from omegaconf.base import Node
    except ImportError:  # without omegaconf no pickle can rebuild one
        return None
    return Node


def _where(chain: Any) -> str:
    keys: list = []
    while chain is not None:
        chain, k = chain
        keys.append(str(k))
    return ".".join(reversed(keys))


def check_configs(path: str, obj: Any) -> None:
    """(local) Refuse an OmegaConf container or node anywhere in a header but under the
    top-level ``cfg``/``args`` (a top-level DictConfig, a DictConfig state dict or
    ``extra_state``, one deep in a list), and a tensor or storage inside an OmegaConf
    container anywhere. Walked without resolving (each node's own stored value), each object
    once per context, iteratively (no recursion, nothing copied per level)."""
    node_type = _omegaconf_node()
    if node_type is None:
        return
    if isinstance(obj, node_type):
        raise CheckpointLayoutError(
            f"{path}: its top level is an OmegaConf {type(obj).__name__}; expected a dict (a training "
            "checkpoint's 'model', 'cfg', 'extra_state', ... or a state dict of tensors), as torch.save writes "
            "one. Reading an OmegaConf container resolves the interpolations (${...}) the file chose, which can "
            "run code, so nothing of it was used. If you trust the file, torch.load(path, weights_only=False) "
            "reads it: re-save it as a plain dict (OmegaConf.to_container(..., resolve=False)).")
    seen: set = set()
    # (object, key chain, under cfg/args, inside an OmegaConf container)
    stack: list = []
    if isinstance(obj, dict):
        stack += [(v, (None, k), isinstance(k, str) and k in _CONFIG_KEYS, False) for k, v in obj.items()]
        stack += [(k, (None, "<key>"), False, False) for k in obj if not isinstance(k, (str, int))]
    else:
        stack.append((obj, None, False, False))
    while stack:
        x, chain, in_cfg, in_oc = stack.pop()
        if x is None or isinstance(x, (str, bytes, int, float, bool)):
            continue
        if isinstance(x, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            if in_oc:
                raise CheckpointLayoutError(
                    f"{path}: {_where(chain)}: a tensor inside an OmegaConf config; a config holds settings, "
                    "not tensors, and a tensor there is never checked against the file's records. The file was "
                    "crafted or built wrongly: re-save it with the tensor outside the config (torch.load(path, "
                    "weights_only=False) reads it, if you trust the file).")
            continue
        state = (id(x), in_cfg, in_oc)
        if state in seen:
            continue
        seen.add(state)
        if isinstance(x, node_type):
            if not in_cfg:
                raise CheckpointLayoutError(
                    f"{path}: the value at {_where(chain)} is an OmegaConf {type(x).__name__}; expected a dict, "
                    "list or tensor, as torch.save writes a training checkpoint: only the top-level 'cfg' and "
                    "'args' may be OmegaConf configs (they are read raw). Reading this one resolves the "
                    "interpolations (${...}) the file chose, which can run code, so nothing of it was used. If "
                    "you trust the file, torch.load(path, weights_only=False) reads it: re-save that entry as a "
                    "plain dict or list (OmegaConf.to_container(..., resolve=False)).")
            raw = vars(x)  # the node's own fields: never a property, never resolved
            content = raw.get("_content", raw.get("_val"))
            if isinstance(content, dict):
                stack += [(v, (chain, k), in_cfg, True) for k, v in content.items()]
            elif isinstance(content, (list, tuple)):
                stack += [(v, (chain, i), in_cfg, True) for i, v in enumerate(content)]
            elif content is not None and not isinstance(content, str):
                stack.append((content, chain, in_cfg, True))
            continue
        if isinstance(x, dict):
            stack += [(v, (chain, k), in_cfg, in_oc) for k, v in x.items()]
            stack += [(k, (chain, "<key>"), in_cfg, in_oc) for k in x if not isinstance(k, (str, int))]
        elif isinstance(x, (list, tuple, set, frozenset)):
            stack += [(v, (chain, i), in_cfg, in_oc) for i, v in enumerate(x)]
        elif isinstance(x, argparse.Namespace):
            stack += [(v, (chain, k), in_cfg, in_oc) for k, v in vars(x).items()]


def _untyped(x: Any) -> torch.UntypedStorage:
    if isinstance(x, torch.Tensor):
        return x.untyped_storage()
    if isinstance(x, torch.TypedStorage):
        return x._untyped_storage
    return x


def _storage_keys(found: list, refs: list, index: ZipIndex) -> Optional[dict]:
    """id(untyped storage) -> the key of its record, or None where the header cannot tell.

    torch marks each meta storage with ``_checkpoint_offset`` only: the record's true data
    offset (older torch, or a file without ``.format_version``), or one computed in
    first-use order, strictly increasing (recent torch, 2.13 here). Both readings are tried;
    one is used only when it is consistent (every storage matched, sizes agree) and the
    other, if also consistent, agrees with it.
    """
    by_offset: dict = {}
    for _, t in found:
        s = _untyped(t)
        off = getattr(s, "_checkpoint_offset", None)
        if off is None:
            return None
        by_offset.setdefault(int(off), []).append(s)
    nbytes = {ref.key: ref.nbytes for ref in refs}

    def consistent(mapping: dict) -> bool:
        # >=: a meta storage grows to fit a tensor that reaches past it (meta storages are
        # resizable), which the bounds check then reports against the declared size.
        return all(key in nbytes and all(s.nbytes() >= nbytes[key] for s in by_offset[off])
                   for off, key in mapping.items())

    data_at = {rec.data_offset: rec.name[len("data/"):] for rec in index.records.values()
               if rec.name.startswith("data/")}
    true = {off: data_at[off] for off in by_offset if off in data_at}
    true = true if len(true) == len(by_offset) and consistent(true) else None
    ranked = None
    if len(by_offset) == len(refs):
        ranked = dict(zip(sorted(by_offset), (ref.key for ref in refs)))
        first = index.records.get("data/" + refs[0].key) if refs else None
        if not consistent(ranked) or (first is not None and min(by_offset) != first.data_offset):
            ranked = None
    mapping = true if ranked is None else ranked if true is None else (true if true == ranked else None)
    if mapping is None:
        return None
    return {id(s): key for off, key in mapping.items() for s in by_offset[off]}


def _fmt_shape(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} stride {tuple(t.stride())} at storage offset {t.storage_offset()}"


def check_bounds(path: str, found: list, declared: Optional[dict] = None) -> None:
    """(local) Every tensor lies inside its storage (torch.load refuses otherwise: 'Trying to
    resize storage that is not resizable'); checked on meta, before anything is allocated.

    ``declared`` maps id(untyped storage) to the bytes the pickle declares for it: a meta
    storage silently grows to fit whatever tensor is built on it, so its own size proves
    nothing once a tensor reached past it.
    """
    for name, t in found:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        last = last_element(t.storage_offset(), t.shape, t.stride())
        if last is None:
            raise CheckpointLayoutError(f"{path}: tensor {name}: {_fmt_shape(t)}: negative strides or offsets "
                                        "cannot come from torch.save. The file's header was edited or is damaged.")
        s = t.untyped_storage()
        nbytes = s.nbytes() if declared is None else declared.get(id(s), s.nbytes())
        have = nbytes // t.element_size()
        if last >= have:
            raise CheckpointLayoutError(
                f"{path}: tensor {name}: {_fmt_shape(t)} reaches element {last + 1} of a storage of "
                f"{have} {str(t.dtype).replace('torch.', '')} elements; torch.load refuses this file too "
                "('Trying to resize storage that is not resizable'). The file's header was edited or is "
                "damaged: copy it again from its source.")


def check_zip(path: str, obj: Any, index: ZipIndex, data_pkl: bytes) -> None:
    """(local) Check every storage the pickle names against its record (the one pass's rule,
    :func:`._unpickle.storage_record`), every tensor against its storage
    (:func:`check_bounds`), and attach the verified data offsets that
    :func:`._reading.storage_byte_offset` returns."""
    refs = _storage_refs(data_pkl, path)
    found = list(walk_tensors(obj, path))
    # A tensor torch.save wrote without data (a meta tensor: torch._utils.
    # _rebuild_meta_tensor_no_storage) has no record: torch's meta load gives every storage it
    # read from a record its place, and gives these none. They are marked, so that a load
    # never allocates what they declare (they hold nothing to load), and set aside.
    placed = [getattr(_untyped(t), "_checkpoint_offset", None) is not None for _, t in found]
    if any(placed) or (found and not refs):
        for (_, t), p in zip(found, placed):
            if not p:
                _untyped(t)._oneload_storageless = True
        found = [nt for nt, p in zip(found, placed) if p]
    keys = _storage_keys(found, refs, index)
    named: dict = {}
    if keys is not None:
        for name, t in found:
            named.setdefault(keys[id(_untyped(t))], name)
    for ref in refs:
        what = f"tensor {named[ref.key]}" if ref.key in named else f"a tensor stored as {index.folder}/data/{ref.key}"
        rec, problem = storage_record(index, ref)
        if rec is None:
            raise CheckpointLayoutError(
                f"{path}: {what}: the pickle refers to record {index.folder}/data/{ref.key}, which the archive "
                "does not hold. The file is incomplete or was re-packed wrongly: copy it again from its source.")
        if problem:  # in the words this check always used: the elements, the dtype, what torch.load says
            raise CheckpointLayoutError(
                f"{path}: {what}: its storage record {index.folder}/data/{ref.key} holds {rec.size} bytes, but "
                f"the header declares {ref.numel} {str(ref.dtype).replace('torch.', '')} elements "
                f"({ref.nbytes} bytes); torch.load refuses it too ('record size ... does not match expected "
                "size'). The file is damaged or was edited: copy it again from its source.")
    declared = None
    if keys is not None:
        size_of = {ref.key: ref.nbytes for ref in refs}
        declared = {sid: size_of[key] for sid, key in keys.items()}
    check_bounds(path, found, declared)
    in_place = index.why_not_range_readable is None
    for _, t in found:
        s = _untyped(t)
        key = None if keys is None else keys.get(id(s))
        # None: this file's tensors are read through torch.load (which reads the true offsets)
        s._oneload_offset = index.records["data/" + key].data_offset if in_place and key is not None else None


# --------------------------------------------------------------------------- reading a file
def torch_load(path: str, *, trust_pickle: bool, archive: Optional[tuple] = None, **kwargs) -> Any:
    """(local) ``torch.load`` through the allowlist, its errors as ours. Every unpickling of a file
    passes here, once (tests and bench/discovery_scale.py count the calls).

    ``archive``, (ZipIndex, pickle bytes) of a zip: the file's header onto ``meta``, checked
    against the archive: in one pass of the C unpickler where the pickle is a plain
    torch.save one (:mod:`._unpickle`), else by torch's own loader and :func:`check_zip`,
    whose messages say what is wrong.
    """
    if archive is None:
        obj = _load_with_torch(path, trust_pickle=trust_pickle, **kwargs)
        check_configs(path, obj)
        return obj
    obj, problem = (None, None) if trust_pickle else one_pass(path, *archive)
    if obj is not None:  # (the one pass hands every omegaconf object to torch's loader)
        return obj
    obj = _load_with_torch(path, trust_pickle=trust_pickle, **kwargs)
    check_configs(path, obj)
    check_zip(path, obj, *archive)
    if problem:  # the one pass found what torch's loader and the checks above let through
        raise CheckpointLayoutError(f"{path}: {problem}; torch.load would read wrong bytes or refuse it. The "
                                    "file is damaged or was edited: copy it again from its source.")
    return obj


def _load_with_torch(path: str, *, trust_pickle: bool, **kwargs) -> Any:
    kind = file_kind(path)
    src: Any = path
    if kind == "legacy" or _storage.is_url(path):
        kwargs.pop("mmap", None)  # legacy files and objects cannot be memory-mapped
    if _storage.is_url(path):
        # a zip's header onto meta: ranged reads of what torch asks for; anything else
        # (tensor data, a legacy pickle) is read whole, once
        src = (_storage.RemoteFile(path) if kind == "zip" and kwargs.get("map_location") == "meta"
               else io.BytesIO(_storage.read_all(path)))
    try:
        if trust_pickle:
            return torch.load(src, weights_only=False, **kwargs)
        with allowlisted():
            return torch.load(src, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        if "weights only" in str(e).lower() or "weights_only" in str(e):
            raise UnsafeCheckpointError(
                f"{path}: refused to unpickle: {_describe_unsafe(path, str(e))}. Nothing "
                "from the file was executed. If you trust this file and its author, load it with "
                "trust_pickle=True (CLI: --trust-pickle); that runs whatever code the pickle holds."
            ) from None
        raise CheckpointLayoutError(f"{path}: the checkpoint's pickle is damaged ({_quote(e)}). Copy the file "
                                    "again from its source.") from e
    except OneloadError:  # a remote file's own refusal, already in our words
        raise
    except Exception as e:  # noqa: BLE001 - whatever an allowlisted call or a crafted opcode raised in torch's loader
        if (short := resource_problem(e)) is not None:  # the machine ran short, or the pickle asked too much
            raise out_of_resources(short, path, unpickling=True, trusted=trust_pickle) from e
        if isinstance(e, OSError):
            raise CheckpointLayoutError(os_error_message(e, path)) from e
        msg = str(e) if isinstance(e, RuntimeError) else ""
        if "central directory" in msg or "zip archive" in msg or "PytorchStreamReader" in msg:
            raise CheckpointLayoutError(
                f"{path}: truncated or corrupted torch checkpoint ({msg.splitlines()[0]}). "
                "Copy the file again from its source."
            ) from None
        if any(s in msg for s in ("not resizable", "does not match expected size", "out of bounds for storage",
                                  "wrong byte size")):
            # where the header could not tie every tensor to its record (legacy files, a
            # tensor in a container the header walk does not enter), torch's own check speaks
            raise CheckpointLayoutError(
                f"{path}: a tensor's header and its stored bytes disagree ({msg.splitlines()[0]}); "
                "the file is damaged or was edited: copy it again from its source."
            ) from e
        raise _unrebuildable(path, e, trust_pickle) from e


def _quote(e: BaseException, limit: int = 300) -> str:
    """``type: message`` of an error raised on a file's behalf, cut to ``limit`` characters:
    a crafted pickle chooses the arguments a message quotes (a 100 KB string)."""
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters)"


def _unrebuildable(path: str, e: BaseException, trust_pickle: bool) -> CheckpointLayoutError:
    """The refusal of a pickle torch's loader fails on: an allowlisted function that failed on
    what the file handed it (bool() of a meta tensor, float() of a word), a memo entry never
    stored, nesting past the interpreter's recursion limit. torch.save never writes such a
    pickle."""
    how = "weights_only=False" if trust_pickle else "weights_only=True"
    what = (f"it refers to memo entry {e.args[0]!r}, which it never stored" if type(e) is KeyError and e.args
            else _quote(e))
    return CheckpointLayoutError(
        f"{path}: torch.load({how}) cannot rebuild the file's pickle ({what}). A pickle torch.save wrote "
        "rebuilds without error: the file was damaged or crafted, and nothing from it is used. Copy it again "
        "from its source, or re-save it with torch.save.")


@functools.lru_cache(maxsize=4096)
def _cached_header(key: tuple, trust_pickle: bool) -> Any:
    path = key[0]
    kind = file_kind(path)
    index = None
    if kind == "zip":  # the archive first: its errors are clearer than torch's
        index = zip_index(key)
        pkl = index.records.get("data.pkl")
        if pkl is None:
            raise bad_zip(path, f"it holds no {index.folder}/data.pkl record (the pickle torch.load reads)")
        fd = _storage.open_ro(path)
        try:
            data_pkl = record_bytes(fd, pkl, path, index.folder)
        finally:
            _storage.close(fd)
    obj = torch_load(path, trust_pickle=trust_pickle, map_location="meta",
                     archive=None if index is None else (index, data_pkl))
    if index is None:  # legacy: read whole by torch.load, which checks its own sizes; the shapes still here
        check_bounds(path, list(walk_tensors(obj, path)))
    return obj


def dcp_data_file(path: Any) -> bool:
    """(local) Whether ``path`` is a data file of a DCP folder: named ``*.distcp`` with a
    ``.metadata`` beside it. A lone ``model.distcp`` (a plain torch.save under that name)
    is read as any file. An object store's ``*.distcp`` is taken by its name (no request)."""
    path = str(path)
    if not path.endswith(".distcp"):
        return False
    if _storage.is_url(path):
        return True
    return os.path.isfile(os.path.join(os.path.dirname(path), ".metadata"))


def read_header(path: str, *, trust_pickle: bool = False) -> Any:
    """(any rank, local) The file's pickled object with every tensor on ``meta``.

    Reads the pickle, the zip's central directory and one local header per record, never
    tensor data; cached per (path, size, mtime). Checks what ``torch.load`` checks when it
    reads the data: every storage the pickle names has its record, of exactly the storage's
    size, and every tensor's shape, stride and offset lie inside its storage. Each meta
    tensor's storage remembers where its record's bytes start in the file, as found through
    the record's own local header (:func:`._reading.storage_byte_offset`).

    A top-level ``last_optimizer_state`` comes back as a mapping that builds its meta
    tensors when it is first used (its records and bounds are checked here, like the
    rest): discovery never pays for the optimizer state, the optimizer paths read it as
    before. Copies and pickles of it are plain dicts.

    Raises:
        CheckpointLayoutError: the file is missing, empty, truncated or not a checkpoint; a
            record is missing, compressed in a way torch cannot read, or of the wrong size; a
            tensor reaches past its storage. The message names the file and the tensor.
        UnsafeCheckpointError: the pickle needs a class outside the allowlist.
    """
    if dcp_data_file(path):
        # A torch.distributed.checkpoint data file: items only, described by the folder's
        # .metadata (formats/dcp.py); what callers ask of a file's header (cfg, optimizer
        # state, extra_state) it holds none of.
        return {}
    try:
        key = stat_key(path)
    except OSError as e:
        raise CheckpointLayoutError(os_error_message(e, path)) from e
    return _cached_header(key, bool(trust_pickle))

