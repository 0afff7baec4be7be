"""A header read in one pass: a torch zip checkpoint's pickle unpickled onto ``meta`` by the
C unpickler, under exactly the allowlist of torch's ``weights_only`` loader.

``torch.load(map_location="meta", weights_only=True)`` runs torch's ``weights_only``
unpickler, a Python loop of about 2.5 us an opcode, over the whole pickle (optimizer state
and FSDP metadata included), and the header read then listed the pickle's storages in a
second pass. This module does both in one pass of :class:`pickle.Unpickler` (C):

* it reads only pickles of the opcodes torch's loader reads (a scan first; no EXT, INST,
  OBJ, NEWOBJ_EX, protocol 4 framing, no memo index past the pickle's length).
* ``find_class`` accepts exactly the names torch's loader accepts (torch's own allowlist,
  the process's ``torch.serialization`` safe globals, ours: :func:`._allowlist.allowed`)
  and refuses every other name before anything of it is imported or called. It returns a stand-in
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
  numbers (:func:`._opscan.scan`): one nested past MAX_DEPTH, or whose walk meets more
  items than the file could hold without sharing, is refused (hashing it as a key would
  crash the process or never end, in torch's loader too).
* what the pass puts where torch's loader puts a tensor, a storage or a global (a record of
  ours) refuses repr, hash and truth value while the pass runs: an allowlisted callable
  applied to it (``str``, ``bool``, ``set``, ``Counter``, a dict key) would make something
  other than what it makes of torch's object, so torch's loader reads such a file. Dict keys
  and set elements in the result are checked like values (no stand-in of a global).
* the checks of a header read run on the records, the same rules :mod:`._header` applies
  to what torch's loader gives (:func:`storage_record`, :func:`last_element`, one
  :class:`StorageRef` type for both): every storage has its record, of its size; every
  tensor lies inside its storage. The walk that builds the meta tensors enters
  each shared container once, and refuses (CheckpointLayoutError) a header nested past
  MAX_DEPTH, counting what a shared container holds wherever it is met again.
* meta tensors are built for everything but the top-level ``last_optimizer_state``, which
  becomes a dict that builds its tensors on first read (:class:`_Deferred`): discovery
  never reads it, the optimizer paths (``_optim``) do.

A file this pass cannot vouch for (refused, unknown to it, or failing a check) gets no
header from it: torch's loader and :func:`._header.check_zip` then read it and say what is
wrong, in the words they always used.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import collections
import functools
import pickle
import threading
import types
import typing
from typing import Any, Optional

import torch

from ._allowlist import allowed
from ._errors import CheckpointLayoutError
from ._opscan import scan, stream

_OPTIMIZER_KEY = "last_optimizer_state"
# How deep containers may nest in a header (dicts, lists, tuples, sets, Namespaces, one in
# the next). metaseq's and fairseq's deepest is about 10 (cfg sections, FSDP metadata); a
# crafted pickle nests 200,000 deep in 400 KB, which torch's loader builds (it does not
# recurse) and every recursive walk of the result then fails on (ours, deepcopy, pickle.dumps
# for a broadcast, repr). Checked where the header is first walked, before anyone else walks it.
MAX_DEPTH = 100

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


class StorageRef(_Record):
    """One storage a pickle names (torch's persistent id): its record's key, dtype and
    elements, checked against the record. Both readers of a header list the storages with it
    (:func:`storage_of`): this pass, which also makes the meta storage when a tensor on it is
    first built, and :mod:`._header`'s listing for a file torch's own loader reads."""

    __slots__ = ("key", "dtype", "numel", "file_offset", "_untyped")

    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel
        self.file_offset: Optional[int] = None
        self._untyped = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def same(self, other: "StorageRef") -> bool:
        """Whether two mentions of one key name the same storage."""
        return (self.dtype, self.numel) == (other.dtype, other.numel)

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


def storage_record(index: Any, ref: StorageRef) -> tuple:
    """(local) (the record of storage ``ref`` in the archive ``index``, None) where it holds
    exactly the bytes the pickle declares, else (that record or None where it is missing,
    why torch.load would refuse it). Both readers of a header check every storage so."""
    rec = index.records.get("data/" + ref.key)
    if rec is None:
        return None, f"the pickle refers to record {index.folder}/data/{ref.key}, which the archive does not hold"
    if rec.size != ref.nbytes:
        return rec, (f"storage record {index.folder}/data/{ref.key} holds {rec.size} bytes, the header "
                     f"declares {ref.nbytes}")
    return rec, None


def last_element(offset: int, size: typing.Sequence[int], stride: typing.Sequence[int]) -> Optional[int]:
    """(local) The last element of its storage a (non-empty) tensor reaches; None where its
    offset or a stride is negative, which torch.save never writes. Both readers of a header
    check every tensor so."""
    if offset < 0 or any(st < 0 for st in stride):
        return None
    return offset + sum((n - 1) * st for n, st in zip(size, stride))


def storage_of(pid: Any, dtype_of: typing.Callable[[Any], Optional[torch.dtype]]) -> Optional[StorageRef]:
    """(local) The storage a persistent id names, where it is one torch.save writes
    (``('storage', <dtype>Storage, key, location, elements)``), else None. ``dtype_of``: the
    dtype the reader's stand-in for the storage class names (None: not a storage class)."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")):
        return None
    dtype = dtype_of(pid[1])
    if dtype is None or not isinstance(pid[4], int):
        return None
    return StorageRef(f"{pid[2]}", dtype, pid[4])  # torch reads record data/{key}


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


def _dtype_named(storage_class: Any) -> Optional[torch.dtype]:
    """The dtype of a storage class as this pass hands it out (:func:`_stand_in`)."""
    return storage_class.dtype if type(storage_class) is _StorageClass else None


class _HeaderUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` (C) under torch's ``weights_only`` allowlist, tensors as stubs."""

    def __init__(self, data: bytes, allowed: dict):
        super().__init__(stream(data), encoding="utf-8")  # torch.load's encoding
        self.allowed = allowed
        self.storages: dict = {}  # key -> StorageRef, in first-use order
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

    def persistent_load(self, pid: Any) -> StorageRef:
        ref = storage_of(pid, _dtype_named)
        if ref is None:
            raise _NotPlain(f"persistent id {pid!r}")
        s = self.storages.setdefault(ref.key, ref)
        if not s.same(ref):
            raise _NotPlain(f"storage {ref.key} named twice, differently")
        return s

    def _stub(self, storage, offset, size, stride, requires_grad, metadata=None) -> _Stub:
        if (type(storage) is not StorageRef or type(offset) is not int or not 0 <= offset < 2 ** 63
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
    if t is StorageRef:
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
        walk = _resolve_entered if t in _ENTERED else _resolve_tuple
        return walk(obj, build, seen, reached, depth, heights)
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


def _resolve_entered(obj: Any, build: bool, seen: dict, reached: set, depth: int, heights: dict) -> Any:
    """:func:`_resolve` of a dict, list or Namespace met for the first time: changed in place."""
    seen[id(obj)] = obj
    d = vars(obj) if type(obj) is argparse.Namespace else obj
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


def _resolve_tuple(obj: tuple, build: bool, seen: dict, reached: set, depth: int, heights: dict) -> tuple:
    """:func:`_resolve` of a tuple (or torch.Size) met for the first time: rebuilt where a
    stub in it became a tensor."""
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
    elif type(obj) is not tuple:  # a torch.Size holding a tensor: not rebuilt here
        raise _NotPlain(f"a tensor inside a {type(obj).__name__}")
    if depth + sub > MAX_DEPTH:
        raise _TooDeep([])
    seen[id(obj)] = new
    heights[id(obj)] = 1 + sub
    return new


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
    plain, bad_tuple = scan(data, MAX_DEPTH)
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
        u = _HeaderUnpickler(data, allowed())
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
    problem = _check(u, index)
    if problem:
        return None, problem
    try:
        obj, reached = _build(obj)
    except _TooDeep as e:
        raise too_deep_error(path, e.args[0]) from None
    except (_NotPlain, RecursionError):
        return None, None
    if not {id(s) for s in u.stubs if not s.wrapped} <= reached:
        return None, None  # a tensor inside a container this pass does not enter: torch's loader builds it
    return obj, None


def _check(u: _HeaderUnpickler, index: Any) -> Optional[str]:
    """(local) What is wrong with the storages and tensors the pass read, against the
    archive's records, or None; then every storage carries its verified data offset."""
    for s in u.storages.values():
        _, problem = storage_record(index, s)
        if problem:
            return problem
    for stub in u.stubs:
        if stub.wrapped or 0 in stub.size:
            continue
        last = last_element(stub.offset, stub.size, stub.stride)
        if last is None:
            return "a tensor with negative strides or offsets"
        if last >= stub.storage.numel:
            return f"a tensor reaches element {last + 1} of a storage of {stub.storage.numel} elements"
    in_place = index.why_not_range_readable is None
    for s in u.storages.values():
        s.file_offset = index.records["data/" + s.key].data_offset if in_place else None
    return None


def _build(obj: Any) -> tuple:
    """(local) (the header with its meta tensors, the ids of the stubs reached): the
    top-level ``last_optimizer_state`` only counted, to be built on first use
    (:class:`_Deferred`). Raises _TooDeep and _NotPlain as :func:`_resolve` does."""
    seen: dict = {}
    reached: set = set()
    heights: dict = {}
    # only a plain dict (an OrderedDict stays one) that no other top-level key holds too
    # (that key would be left holding its tensor records)
    if not (type(obj) is dict and type(obj.get(_OPTIMIZER_KEY)) is dict
            and sum(v is obj[_OPTIMIZER_KEY] for v in obj.values()) == 1):
        return _resolve(obj, True, seen, reached, 1, heights), reached
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
    return obj, reached

