"""A ``torch.distributed.checkpoint`` folder's ``.metadata``, read as data.

torch reads this file with a bare ``pickle.load`` (``FileSystemReader.read_metadata``): a
crafted ``.metadata`` runs whatever code it names. Here it is read by a small pickle machine
of our own that knows the opcodes ``pickle.dump`` writes for DCP's dataclasses and nothing
else, and whose globals are a named allowlist (:data:`ALLOWED`): DCP's metadata classes,
``torch.Size``, dtypes, layouts, ``pathlib`` paths. No class or function of torch's (or of
anyone's) is imported or called for a name the file gives: an allowed class becomes a record
of ours (its name and the state the pickle gave it), and the records become the frozen
descriptions below, each field's type checked. Dict keys are strings, ints or records (never
tuples, whose hash recurses without a limit), so nothing the file builds is walked
recursively by anyone.

Which ranks: every function here is (local); the describer (:mod:`.formats.dcp`) calls
them on the rank that discovers, and a reader of a ``.distcp`` file (:mod:`._reading`)
calls :func:`data_spans` to check every read against the items the ``.metadata`` declares.
"""

from __future__ import annotations

import functools
import os
import posixpath
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from . import _storage
from ._errors import CheckpointLayoutError, UnsafeCheckpointError, os_error_message, out_of_resources, resource_problem
from ._zip import stat_key

__all__ = ["METADATA", "ALLOWED", "Chunk", "TensorEntry", "Item", "DcpMetadata", "read_metadata", "metadata_of"]

METADATA = ".metadata"
# A .metadata of a 70B model saved by 512 ranks (700 tensors x 512 chunks) is tens of MB.
_MAX_METADATA = 1 << 30
_MAX_DIMS = 64  # what torch's TensorImpl allows

_META = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
# What a .metadata may name, and what each becomes: "class" (a record of ours), or a
# converter of a REDUCE's arguments. Everything else is refused by name.
_CLASSES = frozenset((
    (_META, "Metadata"), (_META, "TensorStorageMetadata"), (_META, "ChunkStorageMetadata"),
    (_META, "TensorProperties"), (_META, "BytesStorageMetadata"), (_META, "MetadataIndex"),
    (_META, "StorageMeta"), (_FS, "_StorageInfo"),
))
_LAYOUTS = ("torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch.sparse_csc", "torch.sparse_bsr",
            "torch.sparse_bsc", "torch._mkldnn", "torch.jagged")
_PATHS = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path", "PurePath")


def _dtypes() -> dict:
    return {n: getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}


_DTYPES = _dtypes()
ALLOWED = tuple(sorted(
    [f"{m}.{n}" for m, n in _CLASSES] + [f"{_META}._MEM_FORMAT_ENCODING", "torch.Size",
                                         "torch.serialization._get_layout", "collections.OrderedDict"]
    + [f"pathlib.{n}" for n in _PATHS] + [f"torch.{n}" for n in _DTYPES]))


# --------------------------------------------------------------------------- the pickle machine
class _Damaged(Exception):
    """The pickle is not one pickle.dump writes for DCP metadata (what is wrong: args[0])."""


class _Unsafe(Exception):
    """The pickle names a global, or uses an opcode, outside the allowlist (args[0])."""


class _Class:
    """An allowed class, as a name: NEWOBJ makes a :class:`_Rec` of it."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


class _Rec:
    """An object of an allowed class: its class name and the state BUILD gave it. Hashed by
    identity (a MetadataIndex is a dict key), so hashing it walks nothing."""

    __slots__ = ("name", "state")

    def __init__(self, name: str):
        self.name, self.state = name, None


class _Func:
    """An allowed callable: ``convert`` turns REDUCE's argument tuple into plain data."""

    __slots__ = ("name", "convert")

    def __init__(self, name: str, convert):
        self.name, self.convert = name, convert


def _size(args: tuple) -> tuple:
    if len(args) == 1 and isinstance(args[0], (tuple, list)) and all(type(x) is int for x in args[0]):
        return tuple(args[0])
    raise _Damaged("torch.Size of something other than a sequence of ints")


def _layout(args: tuple) -> str:
    if len(args) == 1 and type(args[0]) is str and args[0] in _LAYOUTS:
        return args[0]
    raise _Damaged("an unknown layout")  # (never the value: a repr of what the file built recurses)


def _mem_format(args: tuple) -> int:
    if len(args) == 1 and type(args[0]) is int and args[0] in (0, 1, 2):
        return args[0]
    raise _Damaged("an unknown memory format")


def _ordered(args: tuple) -> dict:
    if args == ():
        return {}
    raise _Damaged("an OrderedDict built from arguments")


def _path(args: tuple) -> str:
    if args and all(isinstance(a, str) for a in args):
        return posixpath.join(*args)
    raise _Damaged("a path of something other than strings")


def _global(module: str, name: str) -> Any:
    if (module, name) in _CLASSES:
        return _Class(name)
    if module == "torch" and name in _DTYPES:
        return _DTYPES[name]
    calls = {("torch", "Size"): _size, ("torch.serialization", "_get_layout"): _layout,
             (_META, "_MEM_FORMAT_ENCODING"): _mem_format, ("collections", "OrderedDict"): _ordered}
    calls.update({("pathlib", n): _path for n in _PATHS})
    if (module, name) in calls:
        return _Func(f"{module}.{name}", calls[(module, name)])
    raise _Unsafe(f"it names {module[:100]}.{name[:100]}, which is not one of DCP's metadata types")


_KEY_TYPES = (str, int, _Rec)
_OPS = {name: getattr(__import__("pickle"), name)[0] for name in (
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP", "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1",
    "BININT2", "LONG1", "LONG4", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "SHORT_BINBYTES",
    "BINBYTES", "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "APPEND",
    "APPENDS", "SETITEM", "SETITEMS", "BINPUT", "LONG_BINPUT", "MEMOIZE", "BINGET", "LONG_BINGET", "GLOBAL",
    "STACK_GLOBAL", "NEWOBJ", "REDUCE", "BUILD", "DICT", "LIST")}
# Opcodes that construct or call by other routes (the old INST/OBJ, copyreg's extension
# registry, persistent ids, NEWOBJ_EX's keyword arguments): never in a .metadata.
_CALLING = {b"i"[0]: "INST", b"o"[0]: "OBJ", b"\x82"[0]: "EXT1", b"\x83"[0]: "EXT2", b"\x84"[0]: "EXT4",
            b"P"[0]: "PERSID", b"Q"[0]: "BINPERSID", b"\x92"[0]: "NEWOBJ_EX"}
_B, _H, _I4, _U4, _Q, _D = (struct.Struct(f) for f in ("<B", "<H", "<i", "<I", "<Q", ">d"))
_TRUNCATED = "it ends in the middle of an opcode (truncated)"


class _Machine:
    """Runs a pickle's opcodes onto plain containers and records (see the module docstring):
    one handler per opcode, found by its byte (:data:`_HANDLERS`); a 70B model's .metadata
    is millions of opcodes, most of them memo, tuple and small-int ones."""

    __slots__ = ("data", "i", "stack", "marks", "memo")

    def __init__(self, data: bytes):
        self.data, self.i = data, 0
        self.stack: list = []
        self.marks: list = []
        self.memo: dict = {}

    def take(self, n: int) -> bytes:
        if n < 0 or self.i + n > len(self.data):
            raise _Damaged(_TRUNCATED)
        b = self.data[self.i:self.i + n]
        self.i += n
        return b

    def u(self, st: struct.Struct) -> Any:
        i = self.i
        if i + st.size > len(self.data):
            raise _Damaged(_TRUNCATED)
        self.i = i + st.size
        return st.unpack_from(self.data, i)[0]

    def text(self, n: int) -> str:
        try:
            return self.take(n).decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise _Damaged("a string that is not UTF-8") from None

    def pop_mark(self) -> list:
        if not self.marks:
            raise _Damaged("an opcode that needs a MARK without one")
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items

    def pop(self) -> Any:
        if not self.stack or (self.marks and len(self.stack) <= self.marks[-1]):
            raise _Damaged("an opcode that pops an empty stack")
        return self.stack.pop()

    def run(self) -> Any:
        data, handlers, n = self.data, _HANDLERS, len(self.data)
        while True:
            i = self.i
            if i >= n:
                raise _Damaged("it ends before its STOP opcode (truncated)")
            code = data[i]
            self.i = i + 1
            handler = handlers.get(code)
            if handler is None:
                if code == _STOP:
                    if len(self.stack) != 1 or self.marks:
                        raise _Damaged("it stops with other than one object on its stack")
                    return self.stack[0]
                if code in _CALLING:
                    raise _Unsafe(f"it uses the {_CALLING[code]} opcode, which constructs objects outside the allowlist")
                raise _Damaged(f"opcode {code:#04x} at byte {i}, which pickle.dump does not write for DCP")
            handler(self)


_STOP = _OPS["STOP"]


# ---- the opcodes' handlers, each given the machine (by name: _HANDLERS maps the bytes)
def _op_proto(m: _Machine) -> None:
    if m.take(1)[0] > 5:
        raise _Damaged("an unknown pickle protocol")


def _op_frame(m: _Machine) -> None:
    m.take(8)


def _op_long(m: _Machine, n: int) -> None:
    if not 0 <= n <= 8:
        raise _Damaged("an integer wider than 64 bits")
    m.stack.append(int.from_bytes(m.take(n), "little", signed=True))


def _op_tuple_n(n: int):
    def handler(m: _Machine) -> None:
        items = [m.pop() for _ in range(n)]
        items.reverse()
        m.stack.append(tuple(items))
    return handler


def _op_tuple1(m: _Machine) -> None:  # the commonest tuple (a chunk's offsets of a 1-D tensor, an argument)
    m.stack.append((m.pop(),))


def _op_marked(kind):
    def handler(m: _Machine) -> None:
        m.stack.append(kind(m.pop_mark()))
    return handler


def _op_append(m: _Machine, items: list) -> None:
    target = m.pop()
    if type(target) is not list:
        raise _Damaged("APPEND(S) to something other than a list")
    target.extend(items)
    m.stack.append(target)


def _op_setitems(m: _Machine, items: list, target: Any) -> None:
    if type(target) is not dict or len(items) % 2:
        raise _Damaged("SETITEM(S) on something other than a dict")
    for k, v in zip(items[::2], items[1::2]):
        if type(k) not in _KEY_TYPES:
            raise _Damaged(f"a dict key of type {type(k).__name__}")
        target[k] = v
    m.stack.append(target)


def _op_setitems_marked(m: _Machine) -> None:
    items = m.pop_mark()
    _op_setitems(m, items, m.pop())


def _op_setitem(m: _Machine) -> None:
    v = m.pop()
    k = m.pop()
    _op_setitems(m, [k, v], m.pop())


def _op_put(m: _Machine, index: struct.Struct) -> None:
    if not m.stack:
        raise _Damaged("a memo PUT with an empty stack")
    m.memo[m.u(index)] = m.stack[-1]


def _op_get(m: _Machine, idx: int) -> None:
    if idx not in m.memo:
        raise _Damaged(f"memo entry {idx}, which it never stored")
    m.stack.append(m.memo[idx])


def _op_binget(m: _Machine) -> None:  # the commonest opcode after MEMOIZE: its byte read in place
    i = m.i
    if i >= len(m.data):
        raise _Damaged(_TRUNCATED)
    m.i = i + 1
    _op_get(m, m.data[i])


def _op_memoize(m: _Machine) -> None:
    if not m.stack:
        raise _Damaged("a memo PUT with an empty stack")
    m.memo[len(m.memo)] = m.stack[-1]


def _op_global(m: _Machine) -> None:
    # two lines (found in place: a copy of the rest per GLOBAL is quadratic)
    a = m.data.find(b"\n", m.i)
    b = m.data.find(b"\n", a + 1) if a >= 0 else -1
    if b < 0:
        raise _Damaged(_TRUNCATED)
    module = m.data[m.i:a].decode("utf-8", "replace")
    qual = m.data[a + 1:b].decode("utf-8", "replace")
    m.i = b + 1
    m.stack.append(_global(module, qual))


def _op_stack_global(m: _Machine) -> None:
    qual, module = m.pop(), m.pop()
    if not (isinstance(module, str) and isinstance(qual, str)):
        raise _Damaged("STACK_GLOBAL of something other than two strings")
    m.stack.append(_global(module, qual))


def _op_newobj(m: _Machine) -> None:
    args, cls = m.pop(), m.pop()
    if type(cls) is not _Class or args != ():
        raise _Damaged("NEWOBJ of something other than an allowed class")
    m.stack.append(_Rec(cls.name))


def _op_reduce(m: _Machine) -> None:
    args, fn = m.pop(), m.pop()
    if type(fn) is not _Func or type(args) is not tuple:
        raise _Unsafe("it calls something other than an allowed function")
    m.stack.append(fn.convert(args))


def _op_build(m: _Machine) -> None:
    state, obj = m.pop(), m.pop()
    if type(obj) is not _Rec or obj.state is not None:
        raise _Damaged("BUILD of something other than a new DCP metadata object")
    obj.state = state
    m.stack.append(obj)


def _op_dup(m: _Machine) -> None:
    m.stack.append(m.pop())
    m.stack.append(m.stack[-1])


def _op_pop_mark(m: _Machine) -> None:
    m.pop_mark()


_BY_NAME = {
    "PROTO": _op_proto, "FRAME": _op_frame,
    "NONE": lambda m: m.stack.append(None),
    "NEWTRUE": lambda m: m.stack.append(True),
    "NEWFALSE": lambda m: m.stack.append(False),
    "BININT": lambda m: m.stack.append(m.u(_I4)),
    "BININT1": lambda m: m.stack.append(m.u(_B)),
    "BININT2": lambda m: m.stack.append(m.u(_H)),
    "LONG1": lambda m: _op_long(m, m.u(_B)),
    "LONG4": lambda m: _op_long(m, m.u(_I4)),
    "BINFLOAT": lambda m: m.stack.append(m.u(_D)),
    "SHORT_BINUNICODE": lambda m: m.stack.append(m.text(m.u(_B))),
    "BINUNICODE": lambda m: m.stack.append(m.text(m.u(_U4))),
    "BINUNICODE8": lambda m: m.stack.append(m.text(m.u(_Q))),
    "SHORT_BINBYTES": lambda m: m.stack.append(m.take(m.u(_B))),
    "BINBYTES": lambda m: m.stack.append(m.take(m.u(_U4))),
    "MARK": lambda m: m.marks.append(len(m.stack)),
    "POP": lambda m: m.pop(),
    "POP_MARK": _op_pop_mark,
    "DUP": _op_dup,
    "EMPTY_DICT": lambda m: m.stack.append({}),
    "EMPTY_LIST": lambda m: m.stack.append([]),
    "EMPTY_TUPLE": lambda m: m.stack.append(()),
    "TUPLE": _op_marked(tuple), "LIST": _op_marked(list),
    "TUPLE1": _op_tuple1, "TUPLE2": _op_tuple_n(2), "TUPLE3": _op_tuple_n(3),
    "APPEND": lambda m: _op_append(m, [m.pop()]),
    "APPENDS": lambda m: _op_append(m, m.pop_mark()),
    "SETITEM": _op_setitem,
    "SETITEMS": _op_setitems_marked,
    "DICT": lambda m: _op_setitems(m, m.pop_mark(), {}),
    "BINPUT": lambda m: _op_put(m, _B),
    "LONG_BINPUT": lambda m: _op_put(m, _U4),
    "MEMOIZE": _op_memoize,
    "BINGET": _op_binget,
    "LONG_BINGET": lambda m: _op_get(m, m.u(_U4)),
    "GLOBAL": _op_global, "STACK_GLOBAL": _op_stack_global,
    "NEWOBJ": _op_newobj, "REDUCE": _op_reduce, "BUILD": _op_build,
}
# Which handler runs each opcode, by its byte; STOP (and anything else) is the loop's own.
_HANDLERS = {_OPS[name]: handler for name, handler in _BY_NAME.items()}


# --------------------------------------------------------------------------- the description
@dataclass(frozen=True)
class Chunk:
    """One saved piece of a tensor: where it starts (``offsets``) and its ``sizes``."""

    offsets: tuple
    sizes: tuple


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the saved state dict: its FQN, dtype, full size and saved chunks."""

    fqn: str
    dtype: torch.dtype
    size: tuple
    chunks: tuple  # of Chunk


@dataclass(frozen=True)
class Item:
    """Where one chunk (or one non-tensor value) lies: a ``.distcp`` file of the folder and
    the bytes ``offset .. offset+length`` of it; ``transforms`` names the writer extensions
    that transformed the stream (compression), empty when none did."""

    relative_path: str
    offset: int
    length: int
    transforms: tuple


@dataclass(frozen=True)
class DcpMetadata:
    """What a ``.metadata`` says, as plain data."""

    path: str
    tensors: Mapping  # fqn -> TensorEntry
    values: tuple  # fqns of the non-tensor values (BytesStorageMetadata): pickled objects
    items: Mapping  # (fqn, chunk offsets or None) -> Item
    planner_data: Mapping  # fqn -> path of keys in the state dict that was saved; {} where absent
    checkpoint_id: Optional[str]
    version: Optional[str]

    def item(self, fqn: str, offsets: Optional[tuple]) -> Optional[Item]:
        return self.items.get((fqn, offsets))


def _state(rec: Any, kind: str, where: str) -> Any:
    if type(rec) is not _Rec or rec.name != kind:
        raise _Damaged(f"{where} is {_what(rec)}, expected a {kind}")
    return rec.state


def _what(x: Any) -> str:
    return f"a {x.name}" if type(x) is _Rec else f"a {type(x).__name__}"


def _fields(rec: Any, kind: str, where: str) -> dict:
    state = _state(rec, kind, where)
    if state is None:
        return {}
    if type(state) is not dict or not all(type(k) is str for k in state):
        raise _Damaged(f"{where}: a {kind} whose state is not a dict of fields")
    return state


def _ints(x: Any, where: str) -> tuple:
    if type(x) not in (tuple, list) or not all(type(v) is int and 0 <= v < 2 ** 62 for v in x):
        raise _Damaged(f"{where} is not a sequence of non-negative ints")
    return tuple(x)


def _tensor(fqn: str, rec: Any) -> TensorEntry:
    f = _fields(rec, "TensorStorageMetadata", f"tensor {fqn}")
    props = _state(f.get("properties"), "TensorProperties", f"tensor {fqn}: its properties")
    dtype = props[0] if type(props) is tuple and props else (props.get("dtype") if type(props) is dict else None)
    if not isinstance(dtype, torch.dtype):
        raise _Damaged(f"tensor {fqn}: its properties give no dtype")
    size = _ints(f.get("size"), f"tensor {fqn}: its size")
    if len(size) > _MAX_DIMS:
        raise _Damaged(f"tensor {fqn} has {len(size)} dimensions (a tensor has at most {_MAX_DIMS})")
    chunks = f.get("chunks")
    if type(chunks) is not list:
        raise _Damaged(f"tensor {fqn}: its chunks are not a list")
    out = []
    for c in chunks:
        cf = _fields(c, "ChunkStorageMetadata", f"tensor {fqn}: a chunk")
        out.append(Chunk(_ints(cf.get("offsets"), f"tensor {fqn}: a chunk's offsets"),
                         _ints(cf.get("sizes"), f"tensor {fqn}: a chunk's sizes")))
    return TensorEntry(fqn, dtype, size, tuple(out))


def _items(storage: Any) -> dict:
    if type(storage) is not dict:
        raise _Damaged(f"its storage_data is {_what(storage)}, expected a dict of MetadataIndex -> _StorageInfo")
    items = {}
    for k, v in storage.items():
        kf = _fields(k, "MetadataIndex", "a storage_data key")
        fqn, offsets = kf.get("fqn"), kf.get("offset")
        if type(fqn) is not str:
            raise _Damaged("a storage_data key without an FQN")
        offsets = None if offsets is None else _ints(offsets, f"{fqn}: a storage key's offset")
        vf = _fields(v, "_StorageInfo", f"{fqn}: its storage info")
        rel, off, n = vf.get("relative_path"), vf.get("offset"), vf.get("length")
        tr = vf.get("transform_descriptors") or ()
        if type(rel) is not str or type(off) is not int or type(n) is not int or off < 0 or n < 0 \
                or type(tr) not in (list, tuple) or not all(type(t) is str for t in tr):
            raise _Damaged(f"{fqn}: its storage info is not (relative_path, offset, length, transforms)")
        items[(fqn, offsets)] = Item(rel, off, n, tuple(tr))
    return items


def _planner_data(pd: Any) -> dict:
    if type(pd) is not dict:
        return {}
    out = {}
    for k, v in pd.items():
        if type(k) is str and type(v) in (tuple, list) and all(type(x) in (str, int) for x in v):
            out[k] = tuple(v)
    return out


def _describe(path: str, root: Any) -> DcpMetadata:
    f = _fields(root, "Metadata", "the pickled object")
    sdm = f.get("state_dict_metadata")
    if type(sdm) is not dict:
        raise _Damaged("its state_dict_metadata is not a dict")
    tensors, values = {}, []
    for fqn, rec in sdm.items():
        if type(fqn) is not str:
            raise _Damaged(f"a state_dict_metadata key of type {type(fqn).__name__}")
        if type(rec) is _Rec and rec.name == "BytesStorageMetadata":
            values.append(fqn)
        else:
            tensors[fqn] = _tensor(fqn, rec)
    meta = f.get("storage_meta")
    cid = _fields(meta, "StorageMeta", "its storage_meta").get("checkpoint_id") if meta is not None else None
    version = f.get("version")
    return DcpMetadata(path, tensors, tuple(values), _items(f.get("storage_data")), _planner_data(f.get("planner_data")),
                       cid if isinstance(cid, str) else None, version if isinstance(version, str) else None)


def _read_bytes(path: str) -> bytes:
    try:
        size = _storage.getsize(path)
        if size > _MAX_METADATA:
            raise CheckpointLayoutError(f"{path}: {size} bytes, larger than any DCP .metadata ({_MAX_METADATA}); "
                                        "not a torch.distributed.checkpoint metadata file.")
        if _storage.is_url(path):
            return _storage.read_all(path)
        with open(path, "rb") as fh:
            return fh.read(_MAX_METADATA + 1)
    except OSError as e:
        raise CheckpointLayoutError(os_error_message(e, path)) from e


def read_metadata(path: str) -> DcpMetadata:
    """(local) The ``.metadata`` at ``path`` as plain data, unpickled by our own machine.

    Raises:
        UnsafeCheckpointError: the pickle names a global outside DCP's metadata types (or
            calls through an opcode that constructs objects); nothing of it was run.
        CheckpointLayoutError: it is truncated, damaged, or not DCP metadata.
    """
    try:
        key = stat_key(path)
    except OSError as e:
        raise CheckpointLayoutError(os_error_message(e, path)) from e
    return _cached(key)


@functools.lru_cache(maxsize=64)
def _cached(key: tuple) -> DcpMetadata:
    path = key[0]
    data = _read_bytes(path)
    if not data:
        raise CheckpointLayoutError(f"{path}: the file is empty (0 bytes); expected torch.distributed.checkpoint "
                                    "metadata. Copy the folder again from where it was saved.")
    try:
        return _describe(path, _Machine(data).run())
    except _Unsafe as e:
        raise UnsafeCheckpointError(
            f"{path}: refused to unpickle the DCP metadata: {e.args[0]}. Nothing from the file was executed "
            "(torch's own reader would have run it: pickle.load). Re-save the checkpoint with "
            "torch.distributed.checkpoint.save from a trusted copy.") from None
    except MemoryError as e:  # the machine's, or what the file's pickle builds (4 MiB of ']' is 4M lists)
        raise out_of_resources(resource_problem(e), path, unpickling=True) from e
    except _Damaged as e:
        raise CheckpointLayoutError(
            f"{path}: not a readable torch.distributed.checkpoint metadata file: {e.args[0]}. Copy the folder "
            "again from where it was saved (the .metadata is written last: a save cut short leaves none, or "
            "a partial one).") from None


def metadata_of(folder: str) -> DcpMetadata:
    """(local) The ``.metadata`` of a DCP folder (a local path or a URL)."""
    sep = "/" if _storage.is_url(folder) else os.sep
    return read_metadata(folder.rstrip(sep) + sep + METADATA)
