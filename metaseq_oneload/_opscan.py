"""What a pickle's bytes say before anything unpickles them.

Two questions about a torch checkpoint's pickle, answered by reading its opcodes, not
running them:

* does it hold only opcodes torch's ``weights_only`` loader reads, and no memo index past
  its own length (:func:`torch_opcodes_only`)? The C unpickler reads every other opcode
  too, and some reach past ``find_class``; and it grows its memo array to twice the largest
  index it is given.
* does every tuple it builds stay within what a hash or repr can walk (:func:`scan`)?
  Hashing a tuple recurses in C with no recursion check and no memo, in torch's own loader
  as in the C unpickler: the tuples are followed on a stack of numbers before either runs
  the pickle, and one nested past a limit, or whose walk meets more items than the file
  could hold without sharing, is refused.

Both header readers ask (:mod:`._unpickle` the one pass, :mod:`._header` the listing of a
file torch's own loader reads), and read the bytes through :func:`stream`.
"""

from __future__ import annotations

import io
import pickle
import struct

__all__ = ["stream", "torch_opcodes_only", "scan"]

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


def torch_opcodes_only(data: bytes) -> bool:
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


# How the rarer opcodes torch's loader reads move the stack, for scan (the common ones
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
# The ones of those that push a scalar or an empty container and take an argument of a
# fixed length (that length; -1 for every other opcode): scan handles them in its loop.
_PUSH_FIXED = [-1] * 256
for _op in (pickle.NONE, pickle.NEWTRUE, pickle.BININT, pickle.BININT2, pickle.BINFLOAT, pickle.EMPTY_LIST,
            pickle.EMPTY_DICT, pickle.EMPTY_SET):
    _PUSH_FIXED[_op[0]] = _ARG_LEN[_op[0]]
_OP = {name: getattr(pickle, name)[0] for name in (
    "LONG_BINPUT", "BINGET", "BININT1", "MARK", "TUPLE", "REDUCE", "NEWOBJ", "EMPTY_TUPLE", "TUPLE1", "BINUNICODE",
    "BINPERSID", "NEWFALSE", "LONG_BINGET", "BINPUT", "TUPLE2")}


_SIZE_BITS = 40
_SIZE = (1 << _SIZE_BITS) - 1


class _ScanEnd(Exception):
    """The scan stops here: ``args`` (whether the pickle may still be plain, what is wrong
    with a tuple or None)."""


def _tuple_number(items, limit: int, most: int) -> int:
    """The scan's number for a tuple of ``items`` (see :func:`scan`); _ScanEnd past the bounds."""
    bits, size = _SIZE_BITS, _SIZE
    d = max((v >> bits for v in items), default=0) + 1
    m = sum((v & size) or 1 for v in items) + 1
    if d > limit:
        raise _ScanEnd(True, f"tuples nested {d} deep")
    if m > most:
        raise _ScanEnd(True, f"a tuple that a hash or repr walks through more than {most} items (shared tuples "
                             "inside it)")
    return d << bits | m


def scan(data: bytes, limit: int) -> tuple:
    """(plain, tuples): ``plain`` as :func:`torch_opcodes_only` says; ``tuples``: None when
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
    for both answers, the common opcodes spelled out in it and the rest in
    :func:`_scan_rare`: about 2.5 times the opcode scan alone."""
    o = _OP
    LBP, BG, BI1, MARK, TUP, RED, NEWOBJ, ETUP, TUP1, BU, PID, NF, LBG, BP = (
        o["LONG_BINPUT"], o["BINGET"], o["BININT1"], o["MARK"], o["TUPLE"], o["REDUCE"], o["NEWOBJ"],
        o["EMPTY_TUPLE"], o["TUPLE1"], o["BINUNICODE"], o["BINPERSID"], o["NEWFALSE"], o["LONG_BINGET"], o["BINPUT"])
    n, u32, bits, pushes = len(data), _U32, _SIZE_BITS, _PUSH_FIXED
    most = max(1 << 20, 16 * n)  # items a walk of one tuple may meet: what the file itself holds, and then some
    stack: list = []
    marks: list = []
    memo: dict = {}
    push, pop, mark = stack.append, stack.pop, marks.append
    plain = True
    i = 0
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
                # scalars only (the common one), else counted
                v = 1 << bits | (len(items) + 1) if not any(items) else _tuple_number(items, limit, most)
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
            elif op == TUP1:  # a scalar in it: the common one, a shape of one dimension
                v = stack[-1]
                stack[-1] = 1 << bits | 2 if not v else _tuple_number([v], limit, most)
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
            elif op == BP:
                memo[data[i + 1]] = stack[-1]
                i += 2
            else:
                k = pushes[op]  # a scalar or an empty container, of a fixed length: the common rest
                if k >= 0:
                    push(0)
                    i += 1 + k
                else:
                    i = _scan_rare(data, i, stack, marks, memo, limit, most)
    except _ScanEnd as e:
        may_be_plain, bad_tuple = e.args
        return plain and may_be_plain, bad_tuple
    except (IndexError, struct.error, ValueError):  # truncated, or the stack runs out: malformed
        return False, None


def _scan_rare(data: bytes, i: int, stack: list, marks: list, memo: dict, limit: int, most: int) -> int:
    """One of the rarer opcodes for :func:`scan`, at ``i``: its move of the stack, and where
    the next opcode starts; _ScanEnd where the scan stops (STOP, an opcode torch's loader
    does not read, a malformed pickle, a tuple past the bounds)."""
    op = data[i]
    kind = _SIM[op]
    if kind == _PUSH0:
        stack.append(0)
    elif kind == _TUPLE_N:
        k = 2 if op == _OP["TUPLE2"] else 3
        if len(stack) < k:
            raise _ScanEnd(False, None)
        v = _tuple_number(stack[-k:], limit, most)
        del stack[-k:]
        stack.append(v)
    elif kind == _POP1:
        stack.pop()
    elif kind == _POP2:
        if len(stack) < 2:
            raise _ScanEnd(False, None)
        del stack[-2:]
    elif kind == _POP_MARK:
        del stack[marks.pop():]
    elif kind == _NOP:
        if op == _OP["BINPUT"]:
            memo[data[i + 1]] = stack[-1]
    else:  # STOP, or an opcode torch's loader refuses: it reads no further
        raise _ScanEnd(op == pickle.STOP[0], None)
    k = _ARG_LEN[op]
    if k >= 0:
        return i + 1 + k
    if k == _STR4:
        return i + 5 + _U32(data, i + 1)[0]
    if k == _STR1:
        return i + 2 + data[i + 1]
    # GLOBAL: two lines; each find starts past the last, so i only grows
    j = data.find(b"\n", i + 1)
    j = data.find(b"\n", j + 1) if j > 0 else -1
    if j < 0:
        raise _ScanEnd(False, None)
    return j + 1
