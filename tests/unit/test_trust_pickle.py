"""Issue 21 (classes 2 and 4), the pickle side of a header read: a checkpoint's pickle is
data we do not trust. Each test is a real torch.save archive whose pickle was crafted (by a
reducer torch.save pickles as it is told, or by raw opcodes spliced into torch.save's own
pickle), read through the package's public entry points and compared with what
``torch.load(weights_only=True)`` makes of the same file. The header must be exactly
torch's, or the file refused with one of our errors; never a different header, a raw
exception, gigabytes of memory or a hang."""

from __future__ import annotations

import collections
import pickletools
import struct
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import metaseq_oneload as mo
from metaseq_oneload import CheckpointLayoutError, OneloadError
from metaseq_oneload import _allowlist, _header, _reading
from tests.unit.test_unpickle_attacks import replace_pickle

REPO = Path(__file__).resolve().parents[2]


class _Call:
    """Pickles as ``fn(*args)``: what a crafted file asks the unpickler to call."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def _data_pkl(path) -> bytes:
    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))




def _torch_reads(path):
    """torch's own meta load of the file under our allowlist: the header to match."""
    with _allowlist.allowlisted():
        return torch.load(path, map_location="meta", weights_only=True)


def _shape(obj, seen=None):
    """``obj`` with every tensor as (type, dtype, shape, stride, offset): comparable with ==."""
    if isinstance(obj, torch.Tensor):
        return ("T", type(obj).__name__, obj.dtype, tuple(obj.shape), obj.stride(), obj.storage_offset())
    if isinstance(obj, dict):
        return (type(obj).__name__, [(_shape(k), _shape(v)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [_shape(v) for v in obj])
    if isinstance(obj, (set, frozenset)):
        return (type(obj).__name__, sorted(map(repr, map(_shape, obj))))
    return (type(obj).__name__, obj)


def _ours(path):
    _header._cached_header.cache_clear()
    return _reading.read_header(path)


# ---------------------------------------------------------------------- class 2: built-ins on tensors
_T = torch.arange(4.0)
_ONE = torch.ones(1)
with warnings.catch_warnings():  # typed storages are deprecated; torch.save still names them
    warnings.simplefilter("ignore")
    _TYPED = _T.storage()  # ('storage', torch.FloatStorage, ...): the one pass reads it itself
    _EMPTY = torch.zeros(0).storage()
# Each: a header where an allowlisted callable (builtins.str, dict keys, set, Counter) meets
# a tensor or its storage. torch's loader hands it the meta tensor; the one pass had a
# record of its own there, which leaked into the header.
_SAME_AS_TORCH = {
    "str of a tensor": {"model": {"w": _T}, "s": _Call(str, _T)},
    "str of a list holding a tensor": {"model": {"w": _T}, "s": _Call(str, [_T])},
    "str of a storage": {"model": {"w": _T}, "s": _Call(str, _TYPED)},
    "bool of an empty storage": {"model": {"w": _T}, "b": _Call(bool, _EMPTY)},
    "a tensor as a dict key": {"model": {"w": _T}, "k": {_T: 1}},
    "a tensor in a set": {"model": {"w": _T}, "k": {_T}},
    "a tensor counted by Counter": {"model": {"w": _T}, "k": _Call(collections.Counter, [_T, _T])},
    "a tensor key of an OrderedDict": {"model": {"w": _T}, "k": _Call(collections.OrderedDict, [(_T, 1)])},
    "a class as a dict key": {"model": {"w": _T}, "k": {collections.OrderedDict: 1}},
    "a class in a set": {"model": {"w": _T}, "k": _Call(set, [(collections.OrderedDict,)])},
}


@pytest.mark.parametrize("what", sorted(_SAME_AS_TORCH))
def test_allowlisted_builtins_applied_to_tensors_give_torchs_header(tmp_path, what):
    path = tmp_path / "c.pt"
    torch.save(_SAME_AS_TORCH[what], path)
    want = _torch_reads(path)
    got = _ours(str(path))
    assert _shape(got) == _shape(want)
    if "str" in what:
        assert got["s"] == want["s"] and "tensor(" in got["s"] or "Storage" in got["s"]


# torch's meta load refuses these (bool/int/float of a meta tensor calls .item()); the one
# pass answered True, or torch's RuntimeError escaped raw.
_TORCH_REFUSES = {
    "bool of a tensor": {"model": {"w": _ONE}, "b": _Call(bool, _ONE)},
    "int of a tensor": {"model": {"w": _ONE}, "b": _Call(int, _ONE)},
    "float of a tensor": {"model": {"w": _ONE}, "b": _Call(float, _ONE)},
}


@pytest.mark.parametrize("what", sorted(_TORCH_REFUSES))
def test_allowlisted_builtins_torch_refuses_on_tensors_are_refused_as_ours(tmp_path, what):
    path = tmp_path / "c.pt"
    torch.save(_TORCH_REFUSES[what], path)
    with pytest.raises(Exception) as torch_error:  # noqa: B017 - torch's own error, whatever it is
        _torch_reads(path)
    assert not isinstance(torch_error.value, OneloadError)
    with pytest.raises(CheckpointLayoutError, match=r"c\.pt: torch\.load\(weights_only=True\) cannot rebuild the "
                                                    r"file's pickle \(.+\)\..*Copy it again") as ours:
        _ours(str(path))
    assert "Tensor.item()" in str(ours.value) or "meta" in str(ours.value) or "Storage" in str(ours.value)


def test_the_cli_refuses_them_with_exit_2(tmp_path):
    path = tmp_path / "c.pt"
    torch.save(_TORCH_REFUSES["bool of a tensor"], path)
    r = subprocess.run([sys.executable, "-m", "metaseq_oneload", "inspect", str(path)], capture_output=True,
                       text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "cannot rebuild" in r.stderr


# ---------------------------------------------------------------------- class 4: memo, nesting, sharing
def _splice_after_none(path, extra: bytes) -> str:
    """torch.save's pickle of {"junk": None, ...} with ``extra`` right after the None."""
    data = _data_pkl(path)
    pos = next(pos for op, _, pos in pickletools.genops(data) if op.name == "NONE")
    return replace_pickle(path, data[: pos + 1] + extra + data[pos + 1:])


_PEAK_RSS = """
import sys, time
import torch
from metaseq_oneload import _reading

def hwm():  # this process's peak RSS in KiB; ru_maxrss would carry the parent's peak over a fork
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))

base = hwm()
t0 = time.time()
try:
    h = _reading.read_header(sys.argv[1])
    what = "ok " + repr(sorted(h))
except Exception as e:
    what = type(e).__name__ + " " + str(e)
print((hwm() - base) // 1024, round(time.time() - t0, 2), what)
"""


def _peak_rss_mib(path: str, timeout: float = 120) -> tuple:
    """(MiB of peak RSS a header read adds, seconds, its outcome), in a fresh process."""
    r = subprocess.run([sys.executable, "-c", _PEAK_RSS, path], capture_output=True, text=True, timeout=timeout,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    mib, secs, what = r.stdout.strip().splitlines()[-1].split(" ", 2)
    return int(mib), float(secs), what


def test_a_memo_index_far_past_the_memo_costs_no_memory_in_the_storage_scan(tmp_path):
    """LONG_BINPUT 2**25 after a None: torch's loader (a dict memo) reads the file in 3 MB;
    the one pass hands it to torch's loader, and the storage scan that follows replayed it
    with the C unpickler, whose memo array grew to 2**26 slots (512 MiB; 2 GiB at 2**27)."""
    path = tmp_path / "memo.pt"
    torch.save({"junk": None, "model": {"w": torch.arange(4.0)}}, path)
    _splice_after_none(path, b"r" + struct.pack("<I", 2 ** 25))
    assert _shape(_ours(str(path))) == _shape(_torch_reads(path))
    mib, _, what = _peak_rss_mib(str(path))
    print("peak RSS added by the header read:", mib, "MiB")
    assert what == "ok ['junk', 'model']"
    assert mib < 64, f"a header read of a {path.stat().st_size}-byte file took {mib} MiB more peak RSS"


def test_a_memo_get_past_the_memo_is_refused_as_ours(tmp_path):
    """LONG_BINGET of an index never put: both unpicklers fail; the refusal is ours."""
    path = tmp_path / "get.pt"
    torch.save({"junk": None, "model": {"w": torch.arange(4.0)}}, path)
    data = _data_pkl(path)
    pos = next(pos for op, _, pos in pickletools.genops(data) if op.name == "NONE")
    replace_pickle(path, data[:pos] + b"j" + struct.pack("<I", 2 ** 31) + data[pos + 1:])
    with pytest.raises(OneloadError, match=r"get\.pt: .*memo entry 2147483648, which it never stored.*Copy it again"):
        _ours(str(path))


def _nested(path, n: int, kind: str) -> str:
    """{"model": {"w": t}, "deep": <n containers of ``kind``, one inside the next>}."""
    torch.save({"model": {"w": torch.arange(4.0)}, "deep": "XX"}, path)
    data = _data_pkl(path)
    s = b"X\x02\x00\x00\x00XX"
    if kind == "list":
        deep = b"]" * n + b"a" * (n - 1)
    elif kind == "dict":  # {"k": {"k": ...}}: the dicts and keys pushed, then n-1 SETITEMs inside out
        deep = b"}X\x01\x00\x00\x00k" * (n - 1) + b"}" + b"s" * (n - 1)
    else:
        deep = b")" + b"\x85" * (n - 1)
    return replace_pickle(path, data.replace(s, deep, 1))


@pytest.mark.parametrize("kind", ["list", "dict", "tuple"])
def test_nesting_200000_deep_is_refused_clearly(tmp_path, kind):
    """torch's loader builds it (iteratively); every walk of ours recursed and raised a raw
    RecursionError. Now the depth is bounded, with our error saying where."""
    path = _nested(tmp_path / "deep.pt", 200_000, kind)
    _torch_reads(path)  # torch reads it: a refusal must be ours, never a crash
    # tuples are caught before unpickling (hashing one that deep would crash), the rest after
    with pytest.raises(CheckpointLayoutError, match=r"deep\.pt: the checkpoint's (header nests containers more "
                                                    r"than 100 deep|pickle builds tuples nested 101 deep).*re-save"):
        _ours(path)
    with pytest.raises(CheckpointLayoutError, match="nests containers|tuples nested"):
        mo.load_state_dict(path)


@pytest.mark.parametrize("kind", ["list", "dict", "tuple"])
def test_nesting_as_deep_as_a_checkpoint_goes_reads_as_torch_reads_it(tmp_path, kind):
    path = _nested(tmp_path / "d.pt", 30, kind)
    assert _shape(_ours(path)) == _shape(_torch_reads(path))


def test_nesting_through_torchs_loader_is_refused_clearly(tmp_path):
    """The same depth in a file the one pass hands to torch's loader (a set is in it): the
    walk after torch's loader (_walk_tensors) was recursive too."""
    path = tmp_path / "deepset.pt"
    torch.save({"model": {"w": torch.arange(4.0)}, "s": {1}, "deep": "XX"}, path)
    data = _data_pkl(path)
    replace_pickle(path, data.replace(b"X\x02\x00\x00\x00XX", b"]" * 200_000 + b"a" * 199_999, 1))
    with pytest.raises(CheckpointLayoutError, match="nests containers more than"):
        _ours(str(path))


_DAG_RUN = """
import sys, time
import metaseq_oneload as mo
for name, fn in (("inspect", mo.inspect), ("load_state_dict", mo.load_state_dict)):
    t0 = time.time()
    fn(sys.argv[1])
    print(name, round(time.time() - t0, 2), flush=True)
"""


@pytest.mark.parametrize("through", ["one pass", "torch's loader"])
def test_a_header_of_shared_lists_is_walked_once(tmp_path, through):
    """a = [a, a] sixty times (2**60 paths, 61 lists), as a value and holding a tensor, in
    the header: every walk visits a shared object once, so inspect and load_state_dict
    finish in seconds (a walk without a memo never finishes; the subprocess's timeout
    fails the test rather than the suite)."""
    t = torch.arange(4.0)
    a, b, d = [], [t], {}
    for _ in range(60):
        a, b, d = [a, a], [b, b], {"x": d, "y": d}
    obj = {"model": {"decoder.w": t}, "extra_state": {"dag": a, "dagd": d}, "cfg": {"dag": a}, "held": b,
           "t": tuple(a)}
    if through == "torch's loader":
        obj["s"] = {1}  # a set: the one pass hands the file on
    path = tmp_path / "checkpoint_last.pt"
    torch.save(obj, path)
    r = subprocess.run([sys.executable, "-c", _DAG_RUN, str(path)], capture_output=True, text=True, timeout=90,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    secs = {ln.split()[0]: float(ln.split()[1]) for ln in r.stdout.splitlines()}
    assert set(secs) == {"inspect", "load_state_dict"} and max(secs.values()) < 30, secs
    assert _shape(_ours(str(path))["model"]) == _shape(_torch_reads(path)["model"])


def test_an_error_message_from_a_crafted_header_stays_small(tmp_path):
    """What we quote of torch's error is capped: a crafted file cannot make a huge message."""
    path = tmp_path / "c.pt"
    torch.save({"model": {"w": _ONE}, "b": _Call(float, "x" * 100_000)}, path)
    with pytest.raises(OneloadError) as e:
        _ours(str(path))
    assert len(str(e.value)) < 2000


def _shared_chains(k: int, n: int) -> list:
    """k chains of n nested lists, each chain's bottom holding the chain before: each
    container is met once on the way down a chain, yet the whole nests k * n deep."""
    chains, below = [], None
    for _ in range(k):
        top = cur = []
        for _ in range(n - 1):
            nxt = []
            cur.append(nxt)
            cur = nxt
        if below is not None:
            cur.append(below)
        chains.append(top)
        below = top
    return chains


@pytest.mark.parametrize("through", ["one pass", "torch's loader"])
def test_shared_chains_that_nest_past_the_bound_are_refused(tmp_path, through):
    """A walk that remembers what it has seen does not recurse far on its own (each chain
    stops at the one below, already seen), so a depth check counting only its own recursion
    let through 30 chains of 90 lists: 2,700 deep, and a later walk of the header that meets
    them in another order (repr always; copy.deepcopy or pickle.dumps where the deepest chain
    comes first) raised a raw RecursionError. How deep a shared container nests is remembered
    and counted wherever it is met again."""
    obj = {"model": {"w": torch.arange(4.0)}, "extra_state": {"chains": _shared_chains(30, 90)}}
    if through == "torch's loader":
        obj["s"] = {1}
    path = tmp_path / "chains.pt"
    torch.save(obj, path)
    with pytest.raises(CheckpointLayoutError, match=r"chains\.pt: the checkpoint's header nests containers more "
                                                    r"than 100 deep \(under extra_state\.chains"):
        _ours(str(path))


def test_shared_chains_within_the_bound_read_as_torch_reads_them(tmp_path):
    obj = {"model": {"w": torch.arange(4.0)}, "extra_state": {"chains": _shared_chains(3, 20)}}
    path = tmp_path / "chains.pt"
    torch.save(obj, path)
    assert _shape(_ours(str(path))) == _shape(_torch_reads(path))


_READ_IN_A_CHILD = """
import sys
from metaseq_oneload import _reading
try:
    _reading.read_header(sys.argv[1])
    print("ok")
except Exception as e:
    print(type(e).__name__, str(e)[:400])
"""


@pytest.mark.parametrize("where", ["a dict key", "a set element"])
def test_a_tuple_nested_200000_deep_as_a_key_is_refused_before_it_is_hashed(tmp_path, where):
    """Hashing a tuple recurses in C with no recursion check: a 200,000-deep tuple (400 KB)
    used as a dict key or set element crashes the process (SIGSEGV) inside torch's own
    weights_only loader as in the C unpickler, before any walk of ours could refuse it. The
    pickle is scanned for how deep its tuples nest before either unpickler runs it."""
    path = tmp_path / "deepkey.pt"
    torch.save({"model": {"w": torch.arange(4.0)}, "k": "XX"}, path)
    data = _data_pkl(path)
    deep = b")" + b"\x85" * 199_999
    deep = (b"}" + deep + b"K\x01s" if where == "a dict key"
            else b"c__builtin__\nset\n]" + deep + b"a\x85R")
    replace_pickle(path, data.replace(b"X\x02\x00\x00\x00XX", deep, 1))
    r = subprocess.run([sys.executable, "-c", _READ_IN_A_CHILD, str(path)], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == 0, f"the reading process died with {r.returncode}: {r.stderr[-2000:]}"
    assert r.stdout.startswith("CheckpointLayoutError") and "builds tuples nested 101 deep" in r.stdout


@pytest.mark.parametrize("where", ["a dict key", "a set element"])
def test_a_tuple_of_shared_tuples_as_a_key_is_refused_before_it_is_hashed(tmp_path, where):
    """a = (a, a) sixty times: 61 tuples through the memo, a 1 KB pickle, yet hashing it
    (a tuple's hash is not cached, nor memoized) walks 2**61 items: torch's loader and the C
    unpickler never finish. Refused by the same scan, in well under a second."""
    path = tmp_path / "dagkey.pt"
    torch.save({"model": {"w": torch.arange(4.0)}, "k": "XX"}, path)
    data = _data_pkl(path)
    # EMPTY_TUPLE, then 60 times: BINPUT 0, BINGET 0, TUPLE2 (the tuple on top, twice)
    dag = b")" + b"q\x00h\x00\x86" * 60
    deep = (b"}" + dag + b"K\x01s" if where == "a dict key" else b"c__builtin__\nset\n]" + dag + b"a\x85R")
    replace_pickle(path, data.replace(b"X\x02\x00\x00\x00XX", deep, 1))
    r = subprocess.run([sys.executable, "-c", _READ_IN_A_CHILD, str(path)], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("CheckpointLayoutError") and "walks through more than" in r.stdout
