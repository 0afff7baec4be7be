"""A header read in one pass: a torch zip checkpoint's pickle unpickled onto ``meta`` by the
C unpickler, under exactly the allowlist of torch's ``weights_only`` loader.

``torch.load(map_location="meta", weights_only=True)`` runs torch's ``weights_only``
unpickler, a Python loop of about 2.5 us an opcode, over the whole pickle (optimizer state
and FSDP metadata included), and the header read then listed the pickle's storages in a
second pass. This module does both in one pass of :class:`pickle.Unpickler` (C):

* it reads only pickles of the opcodes torch's loader reads (a scan first; no EXT, INST,
  OBJ, NEWOBJ_EX, protocol 4 framing, no memo index past the pickle's length).
* ``find_class`` accepts exactly the names torch's loader accepts (torch's own allowlist,
  the process's ``torch.serialization`` safe globals, our ``safe_globals()``) and refuses
  every other name before anything of it is imported or called. It returns a stand-in
  that refuses BUILD for what the process shares (a Python class, a function, torch's
  storage classes), so a pickle cannot change them for later loads; C types and the
  like come back as they are. torch's tensor rebuild functions are replaced by builders of
  small records (:class:`_Stub`), and every persistent id must be a storage torch.save
  writes; anything else the pass does not know (a tensor subclass, sparse or quantized
  tensors, tensors with state, a class used as a value) hands the file to torch's own
  loader. The C unpickler calls nothing but these, and methods of the objects they made:
  ``__setstate__`` (BUILD, as torch's loader does for allowlisted types), ``append``/
  ``extend`` and ``__setitem__``. torch's loader allows these on lists and dicts only, the
  C unpickler on whatever is on its stack; so the pass hands out only classes whose
  objects cannot be such a target (plain containers, scalars, ``torch.Size``/``device``),
  and, through stand-ins that note every object they make, ``argparse.Namespace``,
  ``OrderedDict`` and ``Counter``; an object of any other class, or one of these with an
  ``append``/``extend`` attribute (what APPENDS would have called), sends the file to
  torch's loader, found or not in what the pickle returns. A numpy array, an omegaconf
  container, a bytearray, a defaultdict or an object of a class the process allowlisted is
  thus always read by torch's loader. Left as the C unpickler reads them: SETITEM(S) on a
  list, APPENDS/SETITEMS with no items, BUILD with an empty state (on a tuple, None, a
  dtype); torch's loader refuses them, they change nothing, and telling them apart needs
  to know what is on the stack, which the scan does not track.
* before either unpickler runs the pickle, the tuples it builds are followed on a stack of
  numbers (:func:`_scan`): one nested past MAX_DEPTH, or whose walk meets more items than
  the file could hold without sharing, is refused (hashing it as a key would crash the
  process or never end, in torch's loader too).
* what the pass puts where torch's loader puts a tensor, a storage or a global (a record of
  ours) refuses repr, hash and truth value while the pass runs: an allowlisted callable
  applied to it (``str``, ``bool``, ``set``, ``Counter``, a dict key) would make something
  other than what it makes of torch's object, so torch's loader reads such a file. Dict keys
  and set elements in the result are checked like values (no stand-in of a global).
* the checks of a header read run on the records: every storage has its record, of its
  size; every tensor lies inside its storage. The walk that builds the meta tensors enters
  each shared container once, and refuses (CheckpointLayoutError) a header nested past
  MAX_DEPTH, counting what a shared container holds wherever it is met again.
* meta tensors are built for everything but the top-level ``last_optimizer_state``, which
  becomes a dict that builds its tensors on first read (:class:`_Deferred`): discovery
  never reads it, the optimizer paths (``_optim``) do.

A file this pass cannot vouch for (refused, unknown to it, or failing a check) gets no
header from it: torch's loader and ``_reading._check_zip`` then read it and say what is
wrong, in the words they always used.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import collections
import functools
import io
import pickle
import struct
import threading
import types
import typing
from typing import Any, Optional

import torch

from ._errors import CheckpointLayoutError

_OPTIMIZER_KEY = "last_optimizer_state"
# How deep containers may nest in a header (dicts, lists, tuples, sets, Namespaces, one in
# the next). metaseq's and fairseq's deepest is about 10 (cfg sections, FSDP metadata); a
# crafted pickle nests 200,000 deep in 400 KB, which torch's loader builds (it does not
# recurse) and every recursive walk of the result then fails on (ours, deepcopy, pickle.dumps
# for a broadcast, repr). Checked where the header is first walked, before anyone else walks it.
MAX_DEPTH = 100

# The opcodes torch's weights_only loader reads, by their argument's length; the C unpickler
# reads every other one too, and some reach past find_class: EXT takes a global from
# copyreg's process-wide cache (filled by any earlier unpickling) without asking it, INST,
# OBJ and NEWOBJ_EX call with other arguments. A pickle with any other opcode goes to
# torch's loader, which refuses it as it always did.
_STOP, _STR4, _STR1, _GLOBAL, _PUT4 = -2, -3, -4, -5, -6
_ARG_LEN = [-1] * 256
for _op, _n in ((pickle.NEWOBJ, 0), (pickle.REDUCE, 0), (pickle.BUILD, 0), (pickle.APPEND, 0), (pickle.APPENDS, 0),
                (pickle.SETITEM, 0), (pickle.SETITEMS, 0), (pickle.MARK, 0), (pickle.TUPLE, 0), (pickle.TUPLE1, 0),
                (pickle.TUPLE2, 0), (pickle.TUPLE3, 0), (pickle.NONE, 0), (pickle.NEWFALSE, 0), (pickle.NEWTRUE, 0),
                (pickle.EMPTY_TUPLE, 0), (pickle.EMPTY_LIST, 0), (pickle.EMPTY_DICT, 0), (pickle.EMPTY_SET, 0),
                (pickle.BINPERSID, 0), (pickle.BININT, 4), (pickle.BININT1, 1), (pickle.BININT2, 2),
                (pickle.BINFLOAT, 8), (pickle.BINGET, 1), (pickle.LONG_BINGET, 4), (pickle.BINPUT, 1),
                (pickle.PROTO, 1), (pickle.STOP, _STOP), (pickle.BINUNICODE, _STR4),
                (pickle.SHORT_BINSTRING, _STR1), (pickle.LONG1, _STR1), (pickle.GLOBAL, _GLOBAL),
                (pickle.LONG_BINPUT, _PUT4)):
    _ARG_LEN[_op[0]] = _n
_U32 = struct.Struct("<I").unpack_from


class _View(io.RawIOBase):
    """A read-only file over a buffer, which it never copies whole."""

    def __init__(self, data):
        self._mv, self._pos = memoryview(data).cast("B"), 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self._mv) - self._pos))
        b[:n] = self._mv[self._pos:self._pos + n]
        self._pos += n
        return n


def stream(data) -> io.BufferedIOBase:
    """A file over a pickle's bytes for an unpickler: ``bytes`` as they are (BytesIO shares
    them), any other buffer (the bytearray an inflated record fills) without the copy BytesIO
    would make of it."""
    if type(data) is bytes:
        return io.BytesIO(data)
    return io.BufferedReader(_View(data), 1 << 20)


def _torch_opcodes_only(data: bytes) -> bool:
    """Whether ``data`` holds only opcodes torch's loader reads, and no memo index past its
    own length: the C unpickler grows its memo array to twice the largest index and clears
    it, so LONG_BINPUT 2**32-1 (9 bytes) would make it write 64 GiB; a pickler numbers its
    memo from 0, one PUT at a time. (A Python loop: a fifth of a header read, 22 ms for
    250k opcodes, where torch's loader takes 0.8 s.)"""
    arg, n, i, find, u32 = _ARG_LEN, len(data), 0, data.find, _U32
    try:
        while True:
            k = arg[data[i]]
            if k >= 0:
                i += 1 + k
            elif k == _STR4:
                i += 5 + u32(data, i + 1)[0]
            elif k == _STR1:
                i += 2 + data[i + 1]
            elif k == _PUT4:
                if u32(data, i + 1)[0] >= n:
                    return False
                i += 5
            elif k == _GLOBAL:  # two lines; each find starts past the last, so i only grows
                j = find(b"\n", i + 1)
                j = find(b"\n", j + 1) if j > 0 else -1
                if j < 0:
                    return False
                i = j + 1
            else:
                return k == _STOP
    except (IndexError, struct.error):  # an argument past the end: truncated
        return False


# How the rarer opcodes torch's loader reads move the stack, for _scan (the common ones
# are spelled out there): what each pushes (a scalar, an empty container: nesting 0), pops.
_PUSH0, _TUPLE_N, _POP1, _POP2, _POP_MARK, _NOP = range(6)
_SIM = [-1] * 256
for _ops, _kind in (((pickle.NONE, pickle.NEWTRUE, pickle.BININT, pickle.BININT2, pickle.BINFLOAT,
                      pickle.SHORT_BINSTRING, pickle.LONG1, pickle.GLOBAL, pickle.EMPTY_LIST, pickle.EMPTY_DICT,
                      pickle.EMPTY_SET), _PUSH0),
                    ((pickle.TUPLE2, pickle.TUPLE3), _TUPLE_N), ((pickle.APPEND, pickle.BUILD), _POP1),
                    ((pickle.SETITEM,), _POP2), ((pickle.APPENDS, pickle.SETITEMS), _POP_MARK),
                    ((pickle.PROTO, pickle.BINPUT), _NOP)):
    for _op in _ops:
        _SIM[_op[0]] = _kind
_OP = {name: getattr(pickle, name)[0] for name in (
    "LONG_BINPUT", "BINGET", "BININT1", "MARK", "TUPLE", "REDUCE", "NEWOBJ", "EMPTY_TUPLE", "TUPLE1", "BINUNICODE",
    "BINPERSID", "NEWFALSE", "LONG_BINGET", "BINPUT", "TUPLE2")}


_SIZE_BITS = 40
_SIZE = (1 << _SIZE_BITS) - 1


def _scan(data: bytes, limit: int) -> tuple:
    """(plain, tuples): ``plain`` as :func:`_torch_opcodes_only` says; ``tuples``: None when
    every tuple the pickle builds is one a hash or repr walks in proportion to the file, up
    to its first opcode torch's loader does not read (where that loader stops); else what
    is wrong with the first that is not.

    Hashing a tuple (a dict key, a set element, what Counter counts) recurses in C with no
    recursion check and no memo: a 200,000-deep tuple in a 400 KB pickle crashes the process
    (SIGSEGV), and ``a = (a, a)`` sixty times (a 1 KB pickle, sharing through the memo)
    hashes 2**60 items, in torch's own loader as in the C unpickler. So before either runs
    the pickle, the tuples are followed on a stack of numbers, one per object on the
    unpickler's stack: how deep it nests in tuples (high bits) and how many items a walk of
    it meets, shared ones each time (low bits). A call's result counts as its arguments;
    lists and dicts as one item (a tuple holding one is not hashable, and fails there). A
    malformed pickle ends the scan as not plain; its unpickler says what is wrong. One loop
    for both answers (the common opcodes first): about 2.5 times the opcode scan alone."""
    o = _OP
    LBP, BG, BI1, MARK, TUP, RED, NEWOBJ, ETUP, TUP1, BU, PID, NF, LBG, BP = (
        o["LONG_BINPUT"], o["BINGET"], o["BININT1"], o["MARK"], o["TUPLE"], o["REDUCE"], o["NEWOBJ"],
        o["EMPTY_TUPLE"], o["TUPLE1"], o["BINUNICODE"], o["BINPERSID"], o["NEWFALSE"], o["LONG_BINGET"], o["BINPUT"])
    arg, sim, n, find, u32 = _ARG_LEN, _SIM, len(data), data.find, _U32
    bits, size = _SIZE_BITS, _SIZE
    most = max(1 << 20, 16 * n)  # items a walk of one tuple may meet: what the file itself holds, and then some
    stack: list = []
    marks: list = []
    memo: dict = {}
    push, pop, mark = stack.append, stack.pop, marks.append
    plain = True
    i = 0

    def tuple_of(items) -> Optional[int]:  # its number, or None past the bounds
        d = max((v >> bits for v in items), default=0) + 1
        m = sum((v & size) or 1 for v in items) + 1
        return None if d > limit or m > most else d << bits | m

    def why(items) -> str:
        d = max((v >> bits for v in items), default=0) + 1
        return (f"tuples nested {d} deep" if d > limit else
                f"a tuple that a hash or repr walks through more than {most} items (shared tuples inside it)")

    try:
        while True:
            op = data[i]
            if op == LBP:
                idx = u32(data, i + 1)[0]
                if idx >= n:  # the C unpickler would grow its memo array to twice that
                    plain = False
                memo[idx] = stack[-1]
                i += 5
            elif op == BG:
                push(memo.get(data[i + 1], 0))
                i += 2
            elif op == BI1:
                push(0)
                i += 2
            elif op == MARK:
                mark(len(stack))
                i += 1
            elif op == TUP:
                at = marks.pop()
                items = stack[at:]
                if not any(items):  # scalars only: the common one
                    v = 1 << bits | (len(items) + 1)
                else:
                    v = tuple_of(items)
                    if v is None:
                        return plain, why(items)
                del stack[at:]
                push(v)
                i += 1
            elif op == RED or op == NEWOBJ:
                d = pop()
                stack[-1] = d
                i += 1
            elif op == ETUP:
                push(1 << bits | 1)
                i += 1
            elif op == TUP1:
                v = stack[-1]
                if not v:
                    stack[-1] = 1 << bits | 2  # the common one: a shape of one dimension
                else:
                    v = tuple_of([v])
                    if v is None:
                        return plain, why(stack[-1:])
                    stack[-1] = v
                i += 1
            elif op == BU:
                push(0)
                i += 5 + u32(data, i + 1)[0]
            elif op == PID:
                stack[-1] = 0
                i += 1
            elif op == NF:
                push(0)
                i += 1
            elif op == LBG:
                push(memo.get(u32(data, i + 1)[0], 0))
                i += 5
            else:
                kind = sim[op]
                if kind == _PUSH0:
                    push(0)
                elif kind == _TUPLE_N:
                    k = 2 if op == o["TUPLE2"] else 3
                    if len(stack) < k:
                        return False, None
                    v = tuple_of(stack[-k:])
                    if v is None:
                        return plain, why(stack[-k:])
                    del stack[-k:]
                    push(v)
                elif kind == _POP1:
                    pop()
                elif kind == _POP2:
                    if len(stack) < 2:
                        return False, None
                    del stack[-2:]
                elif kind == _POP_MARK:
                    del stack[marks.pop():]
                elif kind == _NOP:
                    if op == BP:
                        memo[data[i + 1]] = stack[-1]
                else:  # STOP, or an opcode torch's loader refuses: it reads no further
                    return plain and op == pickle.STOP[0], None
                k = arg[op]
                if k >= 0:
                    i += 1 + k
                elif k == _STR4:
                    i += 5 + u32(data, i + 1)[0]
                elif k == _STR1:
                    i += 2 + data[i + 1]
                else:  # GLOBAL: two lines; each find starts past the last, so i only grows
                    j = find(b"\n", i + 1)
                    j = find(b"\n", j + 1) if j > 0 else -1
                    if j < 0:
                        return False, None
                    i = j + 1
    except (IndexError, struct.error, ValueError):  # truncated, or the stack runs out: malformed
        return False, None


_LEAVES = frozenset((str, int, float, bool, type(None), bytes, torch.dtype))
_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: a C type, whose attributes nothing can set


class _Refused(Exception):
    """A global outside the allowlist: the pass stops before the name is looked up."""


class _NotPlain(Exception):
    """Something this pass does not build; torch's loader reads the file instead."""


class _TooDeep(Exception):
    """Containers nested past MAX_DEPTH; ``args[0]`` collects the keys on the way out."""


def too_deep_error(path: str, keys: list, where: Optional[str] = None) -> CheckpointLayoutError:
    """(local) The refusal of a header that nests past MAX_DEPTH; ``keys`` lead there."""
    if where is None:
        where = "under " + (".".join(map(str, keys[:6])) + (" ..." if len(keys) > 6 else "") or "the top level")
    return CheckpointLayoutError(
        f"{path}: the checkpoint's header nests containers more than {MAX_DEPTH} deep ({where}); a "
        "metaseq/fairseq checkpoint nests about 10 deep. The file was crafted or damaged, and nothing from it "
        "was used; re-save it with torch.save from a trusted copy.")


def _in_pass() -> bool:
    return getattr(_MADE, "objs", None) is not None


class _Record:
    """What the pass puts where torch's loader puts a real object (a tensor, a storage, a
    global). The pickle can hand one to an allowlisted callable (``str``, ``bool``,
    ``set``, ``Counter``, a dict key): what the callable made of our record would differ
    from what it makes of torch's object, so while the pass runs every such use (repr,
    hash, truth value) stops it and torch's loader reads the file instead."""

    __slots__ = ()

    def __repr__(self) -> str:
        if _in_pass():
            raise _NotPlain(f"repr() of a {type(self).__name__.lstrip('_').lower()}")
        return self._describe()

    def _describe(self) -> str:
        return object.__repr__(self)

    def __hash__(self) -> int:
        if _in_pass():
            raise _NotPlain(f"a {type(self).__name__.lstrip('_').lower()} as a key")
        return object.__hash__(self)

    def __bool__(self) -> bool:
        if _in_pass():
            raise _NotPlain(f"bool() of a {type(self).__name__.lstrip('_').lower()}")
        return True


class _Storage(_Record):
    """One storage the pickle names (its persistent id), checked against its record; the
    meta storage is made when a tensor on it is first built."""

    __slots__ = ("key", "dtype", "numel", "file_offset", "_untyped")

    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel
        self.file_offset: Optional[int] = None
        self._untyped = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def untyped(self) -> torch.UntypedStorage:
        if self._untyped is None:
            s = torch.UntypedStorage(self.nbytes, device="meta")
            # what storage_byte_offset reads: the record's data, found through its local header
            s._oneload_offset = self.file_offset
            self._untyped = s
        return self._untyped

    def __setstate__(self, state):  # a BUILD aimed at it would overwrite what was checked
        raise _NotPlain("BUILD on a storage")

    def _describe(self) -> str:
        return f"<storage data/{self.key}: {self.numel} {self.dtype}>"


class _Stub(_Record):
    """A tensor as the pickle describes it (torch's ``_rebuild_tensor_v2`` arguments)."""

    __slots__ = ("storage", "offset", "size", "stride", "requires_grad", "param", "wrapped", "_tensor")

    def __init__(self, storage, offset, size, stride, requires_grad, param):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride
        self.requires_grad, self.param = requires_grad, param
        self.wrapped = False  # the data of a parameter stub: not itself in the object
        self._tensor = None

    def tensor(self) -> torch.Tensor:
        """The meta tensor torch's loader builds for it (one per stub, shared like torch's)."""
        if self._tensor is None:
            t = torch.empty((0,), dtype=self.storage.dtype, device="meta").set_(
                self.storage.untyped(), self.offset, self.size, self.stride)
            if self.param:
                t = torch.nn.Parameter(t, requires_grad=self.requires_grad)
            elif self.requires_grad:
                t.requires_grad_(True)
            self._tensor = t
        return self._tensor

    def __setstate__(self, state):  # BUILD would set slots after the builder's checks
        raise _NotPlain("BUILD on a tensor")

    def _describe(self) -> str:
        return f"<tensor {self.size} on {self.storage!r}, not built>"


_INT64 = range(-2 ** 63, 2 ** 63)


def _ints(xs: Any) -> bool:
    return type(xs) is tuple and all(type(x) is int and x in _INT64 for x in xs)


# What find_class returns is shared by the whole process (a class, a function, torch's
# StorageType objects), and the C unpickler's BUILD sets attributes of whatever is on its
# stack: on the shared object itself, it would change it for every later load (torch's
# loader refuses BUILD on anything but allowlisted instances). So find_class hands out
# stand-ins that do what the pickle may ask of a global (be called, be NEWOBJ's class, name
# a storage's dtype) and refuse BUILD.
class _Call(_Record):
    """An allowlisted function (or one of our builders), callable only."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        obj = self.fn(*args, **kwargs)
        made = getattr(_MADE, "objs", None)
        if made is not None:
            made.append(obj)
        return obj

    def __setstate__(self, state):
        raise _NotPlain("BUILD on a function")


class _Builder(_Call):
    """One of our tensor builders: what it makes is a stub, tracked in ``stubs``."""

    __slots__ = ()

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class _StorageClass(_Record):
    """torch's ``FloatStorage`` etc. in a persistent id: the dtype it names."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __setstate__(self, state):
        raise _NotPlain("BUILD on a storage class")


_GUARDS: set = set()  # ids of the classes _guard made
# What the stand-ins (classes and functions) made in this thread's running pass (None
# outside one): checked after the pass, as APPENDS/SETITEMS/BUILD may have been aimed at an
# object the pickle then dropped (an argument a builder ignores, a value a later SETITEM
# replaced, the stack left at STOP), which no walk of the result finds.
_MADE = threading.local()
# Classes whose objects the pass accepts from the stand-ins: torch's loader allows SETITEM
# on dicts, OrderedDicts and Counters, BUILD on all three; APPEND on none (the C unpickler
# calls an ``append``/``extend`` attribute a BUILD set, so those names are refused).
_MADE_OK = frozenset((argparse.Namespace, collections.OrderedDict, collections.Counter))
# Classes find_class hands out as they are: the C unpickler makes their objects unseen, and
# none can be a target torch's loader refuses where the C unpickler goes on (no attributes
# to set, no item assignment; a list's SETITEM is the exception, see the module docstring).
# Every other C class (bytearray, defaultdict, numpy's) and C function (numpy's,
# _codecs.encode) sends the file to torch's loader.
_INERT = frozenset((dict, list, tuple, set, int, float, str, bool, complex, torch.Size, torch.device))


@functools.lru_cache(maxsize=None)
def _guard(real: type) -> type:
    """A stand-in for a Python class: NEWOBJ and calls make instances of ``real`` itself;
    setting an attribute of the stand-in (BUILD aimed at the class) is refused."""
    meta = type(real)

    def call(cls, *args, **kwargs):
        obj = real(*args, **kwargs)
        made = getattr(_MADE, "objs", None)
        if made is not None:
            made.append(obj)
        return obj

    def setattr_(cls, name, value):
        if "_oneload_sealed" in cls.__dict__:
            raise _NotPlain("BUILD on a class")
        meta.__setattr__(cls, name, value)  # while the class is made (ABCMeta sets its cache)

    def new(cls, *args):
        obj = real.__new__(real, *args)
        made = getattr(_MADE, "objs", None)
        if made is not None:
            made.append(obj)
        return obj

    def setstate(state):
        raise _NotPlain("BUILD on a class")

    guarded_meta = type(f"_Guarded{meta.__name__}", (meta,), {"__call__": call, "__setattr__": setattr_,
                                                             "__delattr__": setattr_})
    cls = guarded_meta(real.__name__, (real,), {"__new__": new, "__setstate__": setstate, "__slots__": (),
                                                "__module__": real.__module__, "__qualname__": real.__qualname__})
    meta.__setattr__(cls, "_oneload_sealed", True)
    _GUARDS.add(id(cls))
    return cls


def _stand_in(obj: Any) -> Any:
    """What find_class returns for an allowlisted ``obj`` (see above); raises _NotPlain for
    what has none (a class the file uses as a value, e.g. omegaconf's ``typing.Any``)."""
    if obj is typing.Any:
        raise _NotPlain("typing.Any")
    if isinstance(obj, type):
        if obj in _INERT:
            return obj
        if obj.__flags__ & _IMMUTABLE_TYPE and obj is not collections.OrderedDict:
            raise _NotPlain(f"{obj!r}")  # its objects are made unseen (see _INERT)
        return _guard(obj)
    if isinstance(obj, torch.serialization.StorageType):
        return _StorageClass(obj.dtype)
    if isinstance(obj, (types.FunctionType, types.MethodType)) or hasattr(obj, "__dict__"):
        if not callable(obj):
            raise _NotPlain(f"{obj!r}")
        return _Call(obj)
    if callable(obj):
        raise _NotPlain(f"{obj!r}")  # a C function: what it returns is made unseen
    return obj  # a C object that is neither called nor built on: a dtype, a qscheme


class _HeaderUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` (C) under torch's ``weights_only`` allowlist, tensors as stubs."""

    def __init__(self, data: bytes, allowed: dict):
        super().__init__(stream(data), encoding="utf-8")  # torch.load's encoding
        self.allowed = allowed
        self.storages: dict = {}  # key -> _Storage, in first-use order
        self.stubs: list = []
        wo = torch._weights_only_unpickler
        self.blocked = wo._blocklisted_modules
        u = torch._utils
        self.builders = {id(u._rebuild_tensor_v2): _Builder(self._tensor_v2),
                         id(u._rebuild_tensor): _Builder(self._tensor), id(u._rebuild_parameter): _Builder(self._parameter),
                         id(u._rebuild_parameter_with_state): _Builder(self._parameter_with_state)}
        self.others = {id(f) for f in wo._tensor_rebuild_functions()} | {
            id(torch._tensor._rebuild_from_type_v2), id(torch.nn.Parameter), id(torch.Tensor)} | {
            # torch.FloatTensor etc. make real tensors, whose __setstate__ (the C unpickler's
            # BUILD) takes backward hooks; torch's loader calls only set_(*state) on them
            id(c) for c in torch._tensor_classes}

    def find_class(self, module: str, name: str) -> Any:
        # torch's loader reads names as protocol 2 writes them (Python 2 spellings mapped)
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        full = f"{module}.{name}"
        if module in self.blocked or full not in self.allowed:
            raise _Refused(full)
        obj = self.allowed[full]
        build = self.builders.get(id(obj))
        if build is not None:
            return build
        if id(obj) in self.others:
            raise _NotPlain(full)
        return _stand_in(obj)

    def persistent_load(self, pid: Any) -> _Storage:
        if type(pid) is not tuple or len(pid) != 5 or pid[0] not in ("storage", b"storage"):
            raise _NotPlain(f"persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid
        dtype = (torch.uint8 if storage_type is torch.UntypedStorage
                 else storage_type.dtype if type(storage_type) is _StorageClass else None)
        if dtype is None or type(numel) is not int:
            raise _NotPlain(f"persistent id {pid!r}")
        key = f"{key}"  # torch reads record data/{key}
        s = self.storages.get(key)
        if s is None:
            s = self.storages[key] = _Storage(key, dtype, numel)
        elif (s.dtype, s.numel) != (dtype, numel):
            raise _NotPlain(f"storage {key} named twice, differently")
        return s

    def _stub(self, storage, offset, size, stride, requires_grad, metadata=None) -> _Stub:
        if (type(storage) is not _Storage or type(offset) is not int or not 0 <= offset < 2 ** 63
                or not _ints(size) or not _ints(stride)
                or len(size) != len(stride) or any(n < 0 for n in size) or type(requires_grad) is not bool
                or metadata or (requires_grad and not (storage.dtype.is_floating_point or storage.dtype.is_complex))):
            raise _NotPlain("a tensor torch.save does not write")
        stub = _Stub(storage, offset, size, stride, requires_grad, False)
        self.stubs.append(stub)
        return stub

    def _tensor_v2(self, storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
        return self._stub(storage, storage_offset, size, stride, requires_grad, metadata)

    def _tensor(self, storage, storage_offset, size, stride):
        return self._stub(storage, storage_offset, size, stride, False)

    def _parameter(self, data, requires_grad, backward_hooks):
        if type(data) is not _Stub or type(requires_grad) is not bool or (
                requires_grad and not (data.storage.dtype.is_floating_point or data.storage.dtype.is_complex)):
            raise _NotPlain("a parameter torch.save does not write")
        data.wrapped = True
        stub = _Stub(data.storage, data.offset, data.size, data.stride, requires_grad, True)
        self.stubs.append(stub)
        return stub

    def _parameter_with_state(self, data, requires_grad, backward_hooks, state):
        if state:
            raise _NotPlain("a parameter with state")
        return self._parameter(data, requires_grad, backward_hooks)


def _allowed() -> dict:
    """Every name torch's ``weights_only`` loader accepts inside ``_reading._allowlisted()``:
    its own allowlist first, then the process's safe globals and ours."""
    return _allowed_with(frozenset(torch._weights_only_unpickler._marked_safe_globals_set))


@functools.lru_cache(maxsize=8)
def _allowed_with(process: frozenset) -> dict:
    from ._reading import safe_globals

    wo = torch._weights_only_unpickler
    allowed = {f"{g.__module__}.{g.__qualname__}": g for g in safe_globals()}
    allowed.update(wo._get_user_allowed_globals())  # the process's, ``process`` as torch reads it
    allowed.update(wo._get_allowed_globals())
    return allowed


_IN_PROGRESS = object()
_OPAQUE = frozenset((set, complex, torch.device, torch.dtype, torch.qscheme, torch.layout, str, int, float, bool,
                     bytes, type(None)))
_IS_LEAF = _LEAVES.__contains__


def _leaves_only(values) -> bool:
    """No value could hold a stub (a list of names, a shape): checked at C speed, as most of
    a header (FSDP metadata, cfg) is such containers."""
    return all(map(_IS_LEAF, map(type, values)))


def _key_height(k: Any, depth: int) -> int:
    """How deep a dict key or set element nests (0 for a scalar), after checking that it
    is what torch's loader would have put there: a global stand-in (a guarded class) as a
    key is not the class torch's loader gives. Stubs and the other records never get here:
    hashing one stops the pass."""
    t = type(k)
    if t is tuple or t is torch.Size:
        if depth > MAX_DEPTH:
            raise _TooDeep([])
        return 1 + max((_key_height(v, depth + 1) for v in k if type(v) not in _LEAVES), default=0)
    if t in _OPAQUE or (t is type and k in _INERT):
        return 0
    raise _NotPlain(f"a {t.__name__} as a key")  # a guarded class: the real one in torch's loader


def _resolve(obj: Any, build: bool, seen: dict, reached: set, depth: int = 1, heights: Optional[dict] = None) -> Any:
    """``obj`` with every stub in dicts, lists, tuples and Namespaces (what the old header
    walk entered) replaced by its meta tensor (``build``) or only counted (``reached``);
    dicts, lists and Namespaces change in place, tuples are rebuilt. Each container is
    walked once however often it is shared (``seen``); ``heights`` keeps how deep each one
    nests, so that a shared container met again at ``depth`` still counts towards
    MAX_DEPTH (chains of shared containers nest as deep as their sum, and every later
    walk that follows them recurses that deep)."""
    if heights is None:
        heights = {}
    t = type(obj)
    if t is _Stub:
        reached.add(id(obj))
        return obj.tensor() if build else obj
    if t is _Storage:
        raise _NotPlain("a storage outside a tensor")
    if t in _ENTERED or t is tuple or t is torch.Size:
        done = seen.get(id(obj))
        if done is not None:
            h = heights.get(id(obj))  # None while it is walked: a cycle, no deeper for a memoizing walk
            if h is not None and depth + h - 1 > MAX_DEPTH:
                raise _TooDeep([])
            if done is _IN_PROGRESS:
                raise _NotPlain("a tuple that holds itself")
            return done
        if depth > MAX_DEPTH:
            raise _TooDeep([])
    if t in _ENTERED:
        seen[id(obj)] = obj
        d = vars(obj) if t is argparse.Namespace else obj
        sub = 0
        if isinstance(d, dict):
            if not _leaves_only(dict.keys(d)):
                sub = max(_key_height(k, depth + 1) for k in dict.keys(d))
            values = dict.values(d)
        else:
            values = d
        if not _leaves_only(values):
            items = dict.items(d) if isinstance(d, dict) else enumerate(d)  # dict's own: a _Deferred's builds
            for k, v in items:
                tv = type(v)
                if tv in _LEAVES:
                    continue
                if (tv is list or tv is tuple) and _leaves_only(v):
                    sub = max(sub, 1)
                    continue
                try:
                    new = _resolve(v, build, seen, reached, depth + 1, heights)
                except _TooDeep as e:
                    e.args[0].insert(0, k)
                    raise
                sub = max(sub, heights.get(id(v), 0))
                if new is not v:
                    d[k] = new  # a value replaced, no key added: iterating on is safe
        if depth + sub > MAX_DEPTH:
            raise _TooDeep([])
        heights[id(obj)] = 1 + sub
        return obj
    if t is tuple or t is torch.Size:
        if _leaves_only(obj):
            return obj  # the common tuple: a shape
        seen[id(obj)] = _IN_PROGRESS
        new, sub = [], 0
        for i, v in enumerate(obj):
            if type(v) in _LEAVES:
                new.append(v)
                continue
            try:
                new.append(_resolve(v, build, seen, reached, depth + 1, heights))
            except _TooDeep as e:
                e.args[0].insert(0, i)
                raise
            sub = max(sub, heights.get(id(v), 0))
        new = tuple(new)
        if all(a is b for a, b in zip(new, obj)):
            new = obj
        elif t is not tuple:  # a torch.Size holding a tensor: not rebuilt here
            raise _NotPlain(f"a tensor inside a {t.__name__}")
        if depth + sub > MAX_DEPTH:
            raise _TooDeep([])
        seen[id(obj)] = new
        heights[id(obj)] = 1 + sub
        return new
    if t is _Call or t is _Builder or t is _StorageClass or id(obj) in _GUARDS:
        raise _NotPlain("a global used as a value")  # where torch's loader gives the real one
    if t is set:  # not entered for stubs (hashing one stopped the pass); its elements are keys
        if not _leaves_only(obj) and id(obj) not in seen:
            seen[id(obj)] = obj
            heights[id(obj)] = 1 + max(_key_height(k, depth + 1) for k in obj)
        return obj
    if t in _OPAQUE or (t is type and obj in _INERT):
        return obj  # not entered (OrderedDict attributes): a stub in one is found below
    # nothing else can come out of the pass (see _INERT); a class added to it without its
    # objects being vetted here goes to torch's loader rather than through unchecked
    raise _NotPlain(f"a {t.__name__} in the header")


class _Deferred(dict):
    """A header's ``last_optimizer_state``: a dict whose meta tensors are built when it is
    first read (discovery and a weights-only load never read it). Its keys are there from
    the start; every way to its values (items, values, [], get, iteration, ==, copies,
    pickles) builds them first, and copies and pickles of it are plain dicts."""

    def __init__(self, raw: dict):
        super().__init__(raw)
        self._built = False
        self._lock = threading.Lock()

    def _build(self) -> "_Deferred":
        if not self._built:
            with self._lock:
                if not self._built:
                    _resolve(self, True, {}, set())
                    self._built = True
        return self

    def __getitem__(self, key):
        return dict.__getitem__(self._build(), key)

    def get(self, key, default=None):
        return dict.get(self._build(), key, default)

    def __iter__(self):  # also what dict(), {**d} and update() go through, a dict subclass's __iter__ being ours
        return dict.__iter__(self._build())

    def keys(self):
        return dict.keys(self._build())

    def values(self):
        return dict.values(self._build())

    def items(self):
        return dict.items(self._build())

    def pop(self, *args):
        return dict.pop(self._build(), *args)

    def popitem(self):
        return dict.popitem(self._build())

    def setdefault(self, key, default=None):
        return dict.setdefault(self._build(), key, default)

    def __eq__(self, other):
        return dict.__eq__(self._build(), other)

    def __ne__(self, other):
        return dict.__ne__(self._build(), other)

    __hash__ = None

    def __repr__(self) -> str:
        return dict.__repr__(self._build())

    def copy(self) -> dict:
        return dict(dict.items(self._build()))

    __copy__ = copy

    def __deepcopy__(self, memo) -> dict:
        import copy

        return copy.deepcopy(self.copy(), memo)

    def __reduce_ex__(self, protocol):
        return (dict, (self.copy(),))


# the containers the walk enters, by exact type: what a subclass would hold is not vetted
_ENTERED = frozenset((dict, collections.OrderedDict, collections.Counter, list, argparse.Namespace, _Deferred))


def header(path: str, index: Any, data: bytes) -> tuple:
    """(local) (the header, None) for a plain torch.save pickle whose checks pass, each
    storage carrying ``_oneload_offset``; (None, what is wrong) when a check fails; (None,
    None) when this pass cannot read the file (then torch's loader does). Raises
    CheckpointLayoutError for a pickle that neither this pass nor torch's loader may run (its
    tuples nest past MAX_DEPTH: hashing one would crash the process)."""
    plain, bad_tuple = _scan(data, MAX_DEPTH)
    if bad_tuple:
        raise CheckpointLayoutError(
            f"{path}: the checkpoint's pickle builds {bad_tuple}, found before unpickling it: hashing or printing "
            f"such a tuple crashes the process or never ends, in torch's own loader too. A checkpoint's tuples "
            f"(shapes, arguments) nest a few deep; expected at most {MAX_DEPTH}. The file was crafted or damaged, "
            "and nothing from it was used; re-save it with torch.save from a trusted copy.")
    if not plain:
        return None, None
    _MADE.objs = made = []
    try:
        u = _HeaderUnpickler(data, _allowed())
        obj = u.load()
    except Exception:  # noqa: BLE001 - refused, or not plain: torch's loader reads it and says why
        return None, None
    finally:
        _MADE.objs = None
    for m in made:  # also what the result no longer holds
        t = type(m)
        if t is _Stub or t in _OPAQUE or t in _INERT:
            continue  # as if the pickle had written it (a stub refuses BUILD)
        if t not in _MADE_OK or "extend" in m.__dict__ or "append" in m.__dict__:
            return None, None  # e.g. an allowlisted function's bytearray, a user's safe class
    for s in u.storages.values():
        rec = index.records.get("data/" + s.key)
        if rec is None:
            return None, f"the pickle refers to record {index.folder}/data/{s.key}, which the archive does not hold"
        if rec.size != s.nbytes:
            return None, (f"storage record {index.folder}/data/{s.key} holds {rec.size} bytes, the header "
                          f"declares {s.nbytes}")
    for stub in u.stubs:
        if stub.wrapped or 0 in stub.size:
            continue
        if stub.offset < 0 or any(st < 0 for st in stub.stride):
            return None, "a tensor with negative strides or offsets"
        last = stub.offset + sum((n - 1) * st for n, st in zip(stub.size, stub.stride))
        if last >= stub.storage.numel:
            return None, f"a tensor reaches element {last + 1} of a storage of {stub.storage.numel} elements"
    in_place = index.why_not_range_readable is None
    for s in u.storages.values():
        s.file_offset = index.records["data/" + s.key].data_offset if in_place else None
    try:
        seen: dict = {}
        reached: set = set()
        heights: dict = {}
        deferred = None
        # only a plain dict (an OrderedDict stays one) that no other top-level key holds too
        # (that key would be left holding its tensor records)
        if type(obj) is dict and type(obj.get(_OPTIMIZER_KEY)) is dict and sum(
                v is obj[_OPTIMIZER_KEY] for v in obj.values()) == 1:
            deferred = obj[_OPTIMIZER_KEY]
            seen[id(obj)] = obj
            for k in obj:
                if type(k) not in _LEAVES:
                    _key_height(k, 2)
            # the rest first: what it shares with the optimizer state is built there
            for k, v in [*((k, v) for k, v in obj.items() if v is not deferred), (_OPTIMIZER_KEY, deferred)]:
                if type(v) in _LEAVES:
                    continue
                try:
                    new = _resolve(v, v is not deferred, seen, reached, 2, heights)  # counted; built on first use
                except _TooDeep as e:
                    e.args[0].insert(0, k)
                    raise
                if new is not v:
                    obj[k] = new
            obj[_OPTIMIZER_KEY] = _Deferred(deferred)
        else:
            obj = _resolve(obj, True, seen, reached, 1, heights)
    except _TooDeep as e:
        raise too_deep_error(path, e.args[0]) from None
    except (_NotPlain, RecursionError):
        return None, None
    if not {id(s) for s in u.stubs if not s.wrapped} <= reached:
        return None, None  # a tensor inside a container this pass does not enter: torch's loader builds it
    return obj, None

