"""Hand-written pickles against the one-pass header read (metaseq_oneload._unpickle): the C
unpickler reads opcodes torch's weights_only loader refuses, and calls methods of what is on
its stack. Each test is one way a checkpoint could run code, change the process, or make the
header disagree with torch.load; each must end with torch's loader judging the file, or with
the header torch's loader gives."""

from __future__ import annotations

import collections
import copyreg
import io
import pickle
import struct
import sys
import tracemalloc
import zipfile

import pytest
import torch

from metaseq_oneload import CheckpointLayoutError, UnsafeCheckpointError
from metaseq_oneload import _allowlist, _header, _unpickle
from metaseq_oneload._reading import read_header


class _Index:
    """The archive of a pickle-only file: no storage records."""

    records: dict = {}
    folder = "x"
    why_not_range_readable = None


def replace_pickle(path, data_pkl: bytes) -> str:
    """The archive at ``path`` with its data.pkl replaced by ``data_pkl`` (stored, as torch
    writes it); the header cache forgets it."""
    with zipfile.ZipFile(path) as z:
        members = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members:
            z.writestr(name, data_pkl if name.endswith("/data.pkl") else data)
    _header._cached_header.cache_clear()
    return str(path)


def _zip_with_pickle(path, data_pkl: bytes) -> str:
    """A torch.save archive whose data.pkl is replaced by ``data_pkl``."""
    torch.save({"model": {}}, path)
    return replace_pickle(path, data_pkl)


def _torch_reads(data: bytes):
    """What torch's weights_only loader makes of a pickle (under our allowlist)."""
    with _allowlist.allowlisted():
        return torch._weights_only_unpickler.load(io.BytesIO(data), encoding="utf-8")


@pytest.fixture
def evil_module(tmp_path, monkeypatch):
    """A module whose payload() leaves a marker file: it ran."""
    marker = tmp_path / "ran"
    (tmp_path / "oneload_ext_payload.py").write_text(
        f"def payload(*a):\n    open({str(marker)!r}, 'w').close()\n    return 'ran'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "oneload_ext_payload", marker
    sys.modules.pop("oneload_ext_payload", None)


def test_ext_cannot_take_a_global_from_copyregs_cache(tmp_path, evil_module):
    """EXT1/2/4 name a global by a copyreg extension code, and the C unpickler looks the code
    up in copyreg's process-wide cache before it asks find_class: once any trusted unpickling
    used a registered code, a checkpoint could call that global past the allowlist (here a
    module's function; `os.getpid` worked the same, though torch blocks `os` outright).
    torch's loader reads no EXT; neither does the one pass."""
    module, marker = evil_module
    code = 0x7FFF_FFF0
    copyreg.add_extension(module, "payload", code)
    try:
        ext4 = b"\x84" + struct.pack("<i", code)
        assert pickle.loads(b"\x80\x02" + ext4 + b".").__name__ == "payload"  # a trusted load fills the cache
        marker.unlink(missing_ok=True)
        data = b"\x80\x02" + ext4 + b")R."
        assert _unpickle.header("x.pt", _Index, data) == (None, None)
        assert not marker.exists()
        with pytest.raises((UnsafeCheckpointError, CheckpointLayoutError)):
            read_header(_zip_with_pickle(tmp_path / "ext.pt", data))
        assert not marker.exists()
    finally:
        copyreg.remove_extension(module, "payload", code)
        copyreg.clear_extension_cache()


def test_a_memo_index_far_past_the_pickle_allocates_nothing():
    """LONG_BINPUT with index i makes the C unpickler grow its memo array to 2*i slots and
    clear them: a 9-byte pickle with i = 2**32-1 asks for 64 GiB and writes it (an OOM kill
    on a big node, before any error). torch's loader keeps its memo in a dict; the one pass
    hands such a pickle to it."""
    data = b"\x80\x02N" + b"r" + struct.pack("<I", 2 ** 22) + b"."  # 8M slots: 64 MiB
    tracemalloc.start()
    try:
        assert _unpickle.header("x.pt", _Index, data) == (None, None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2 ** 20, peak
    assert _torch_reads(data) is None  # torch's loader reads it, at no cost


# Opcodes torch's loader refuses ("Unsupported operand"); the C unpickler reads each one.
_BEYOND_TORCH = {
    "STACK_GLOBAL": b"\x80\x04\x8c\x0bcollections\x8c\x0bOrderedDict\x93)R.",
    "INST": b"\x80\x02(icollections\nOrderedDict\n.",
    "OBJ": b"\x80\x02(ccollections\nOrderedDict\no.",
    "NEWOBJ_EX": b"\x80\x04cbuiltins\ndict\n)}\x92.",
    "FRAME and SHORT_BINUNICODE": b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00\x8c\x01a\x94.",
    "EMPTY_SET and ADDITEMS": b"\x80\x04\x8f(K\x01\x90.",
    "FROZENSET": b"\x80\x04(K\x01\x91.",
    "BINBYTES": b"\x80\x03C\x01a.",
    "BYTEARRAY8": b"\x80\x05\x96\x01\x00\x00\x00\x00\x00\x00\x00a.",
    "EXT1 (unregistered)": b"\x80\x02\x82\x01.",
    "PERSID (text)": b"\x80\x02P0\n.",
    "BINSTRING": b"\x80\x02T\x01\x00\x00\x00a.",
}


@pytest.mark.parametrize("what", sorted(_BEYOND_TORCH))
def test_opcodes_torchs_loader_refuses_go_to_it(what):
    data = _BEYOND_TORCH[what]
    with pytest.raises(Exception):  # noqa: B017 - torch's own wording varies by opcode
        _torch_reads(data)
    assert _unpickle.header("x.pt", _Index, data) == (None, None)


def test_a_pickle_refused_for_its_opcodes_says_so(tmp_path):
    """Not "a class outside the allowlist": protocol 4 names no class torch refuses."""
    path = _zip_with_pickle(tmp_path / "p4.pt", _BEYOND_TORCH["FRAME and SHORT_BINUNICODE"])
    with pytest.raises(UnsafeCheckpointError, match=r"refused to unpickle: the file uses pickle opcodes torch's "
                                                    r"weights_only loader cannot read \(protocol 4\); re-save it "
                                                    r"with torch.save's default protocol\. Nothing"):
        read_header(path)


def test_a_legacy_tensor_class_cannot_plant_backward_hooks():
    """torch.FloatTensor(...) makes a real tensor; the C unpickler's BUILD on it calls
    Tensor.__setstate__, which takes (requires_grad, _, hooks) and installs the hooks (any
    allowlisted callable, run at the next backward). torch's loader calls only set_(*state)."""
    data = (b"\x80\x02ctorch\nFloatTensor\n]G?\xf0\x00\x00\x00\x00\x00\x00a\x85R"
            b"\x88N}K\x00ccollections\nOrderedDict\ns\x87b.")
    with pytest.raises(Exception):  # noqa: B017 - set_() refuses the state
        _torch_reads(data)
    assert _unpickle.header("x.pt", _Index, data) == (None, None)


def _header_of(tmp_path, obj) -> dict:
    path = tmp_path / "c.pt"
    torch.save(obj, path)
    _header._cached_header.cache_clear()
    return read_header(str(path))


def test_the_optimizer_state_shared_with_another_key_is_built_there(tmp_path):
    """A top-level value that is the optimizer state itself (one dict, memoized) is built,
    not left holding the deferred state's tensor records."""
    d = {"w": torch.arange(3.0)}
    header = _header_of(tmp_path, {"model": d, "last_optimizer_state": d})
    assert type(header["model"]["w"]) is torch.Tensor and header["model"]["w"].device.type == "meta"
    assert type(header["last_optimizer_state"]["w"]) is torch.Tensor


def test_an_ordered_optimizer_state_stays_ordered(tmp_path):
    header = _header_of(tmp_path, {"model": {}, "last_optimizer_state": collections.OrderedDict(a=torch.zeros(2))})
    los = header["last_optimizer_state"]
    assert type(los) is collections.OrderedDict and los["a"].device.type == "meta"


@pytest.mark.parametrize("geometry", [(-1, (0,), (1,)), (0, (0, 2 ** 63), (1, 1))], ids=["offset", "int64"])
def test_a_tensor_torch_cannot_build_goes_to_torchs_loader(geometry):
    """An empty tensor passes the bounds checks whatever its offset; set_() then refuses a
    negative offset or a size past int64. The one pass hands it on (in the optimizer state
    the error would otherwise surface at its first use, far from the read)."""
    offset, size, stride = geometry

    class _Idx(_Index):
        records = {"data/0": type("R", (), {"size": 8, "data_offset": 0})()}

    data = (b"\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage"
            b"ctorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x02tQ"
            + pickle.dumps(offset, 2)[2:-1] + pickle.dumps(size, 2)[2:-1] + pickle.dumps(stride, 2)[2:-1]
            + b"\x89ccollections\nOrderedDict\n)RtRs.")
    assert _unpickle.header("x.pt", _Idx, data) == (None, None)
    good = data.replace(pickle.dumps(offset, 2)[2:-1] + pickle.dumps(size, 2)[2:-1], b"K\x00K\x02\x85", 1)
    good = good.replace(pickle.dumps(stride, 2)[2:-1], b"K\x01\x85", 1)
    assert _unpickle.header("x.pt", _Idx, good)[0]["w"].shape == (2,)  # the same pickle, a tensor torch builds


# APPEND(S), SETITEM(S) and BUILD aimed at objects torch's loader refuses them on (it
# appends to lists only, sets items of dicts, OrderedDicts and Counters only, and builds
# only allowlisted types); the C unpickler calls `extend`, `__setitem__` or `__setstate__`
# of whatever is on its stack. Each pickle is made only of allowlisted names and opcodes
# torch's loader reads.
_NS = b"cargparse\nNamespace\n)\x81}X\x06\x00\x00\x00extendc__builtin__\nlist\nsb"  # Namespace(extend=list)
_DIVERGING = {
    "SETITEM on a numpy array": pickle.dumps(__import__("numpy").zeros(2), 2)[:-1] + b"K\x00K\x07s.",
    "SETITEMS on a defaultdict": (b"\x80\x02ccollections\ndefaultdict\nc__builtin__\nlist\n\x85R"
                                  b"(X\x01\x00\x00\x00aK\x01u."),
    "APPENDS on a bytearray": b"\x80\x02c__builtin__\nbytearray\n)R(K\x01K\x02e.",
    "SETITEM on a bytearray": b"\x80\x02c__builtin__\nbytearray\nK\x02\x85RK\x00K\x07s.",
    "APPENDS on a Namespace whose extend a BUILD set": b"\x80\x02" + _NS + b"(K\x01e.",
    # the Namespace is then dropped: {"a": Namespace} becomes {"a": 1}; no walk of the result sees it
    "APPENDS on a Namespace the pickle drops": (b"\x80\x02}(X\x01\x00\x00\x00a" + _NS
                                                 + b"(K\x01eX\x01\x00\x00\x00aK\x01u."),
    "APPEND on an OrderedDict whose append a BUILD set": (b"\x80\x02ccollections\nOrderedDict\n)R}X\x06\x00\x00\x00"
                                                          b"appendc__builtin__\nint\nsbK\x01a."),
    "BUILD on a numpy scalar": pickle.dumps(__import__("numpy").float64(1.5), 2)[:-1] + b"}b.",
}


@pytest.mark.parametrize("what", sorted(_DIVERGING))
def test_what_torchs_loader_refuses_to_append_set_or_build_is_refused(tmp_path, what):
    """Only allowlisted code runs either way, but the file must be refused as torch.load
    refuses it: the one pass hands it to torch's loader, whose refusal read_header reports."""
    data = _DIVERGING[what]
    pickle.loads(data)  # the C unpickler reads it
    with pytest.raises(pickle.UnpicklingError):
        _torch_reads(data)
    assert _unpickle.header("x.pt", _Index, data) == (None, None)
    with pytest.raises(UnsafeCheckpointError, match=r"refused to unpickle: the file asks torch's weights_only "
                                                    r"loader for what it refuses \(Can only "):
        read_header(_zip_with_pickle(tmp_path / "d.pt", data))


def test_an_omegaconf_container_goes_to_torchs_loader_and_comes_back_as_torch_reads_it(tmp_path):
    """A DictConfig (an item set after its BUILD refused; as written, the object torch reads).
    As a checkpoint's cfg it comes back as torch reads it; as the whole header, torch's loader
    reads it and read_header refuses it (only cfg/args may be OmegaConf configs)."""
    omegaconf = pytest.importorskip("omegaconf")
    as_cfg = pickle.dumps({"cfg": omegaconf.OmegaConf.create({"a": 1})}, 2)
    assert _unpickle.header("x.pt", _Index, as_cfg) == (None, None)
    header = read_header(_zip_with_pickle(tmp_path / "c.pt", as_cfg))
    assert type(header["cfg"]) is omegaconf.DictConfig and header == _torch_reads(as_cfg) == {"cfg": {"a": 1}}
    written = pickle.dumps(omegaconf.OmegaConf.create({"a": 1}), 2)
    assert _unpickle.header("x.pt", _Index, written) == (None, None)
    assert type(_torch_reads(written)) is omegaconf.DictConfig
    with pytest.raises(CheckpointLayoutError, match="its top level is an OmegaConf DictConfig; expected a dict"):
        read_header(_zip_with_pickle(tmp_path / "o.pt", written))
    data = written[:-1] + b"X\x01\x00\x00\x00bK\x02s."
    assert pickle.loads(data) == {"a": 1, "b": 2}
    with pytest.raises(pickle.UnpicklingError):
        _torch_reads(data)
    assert _unpickle.header("x.pt", _Index, data) == (None, None)
    with pytest.raises(UnsafeCheckpointError):
        read_header(_zip_with_pickle(tmp_path / "o2.pt", data))


@pytest.mark.parametrize("value", ["empty", "filled"])
def test_a_defaultdict_reads_as_torch_reads_it(tmp_path, value):
    """torch.save of a defaultdict: an empty one torch's loader reads (to the same object
    here), a filled one it refuses (SETITEMS), and so does read_header."""
    d = collections.defaultdict(list, {} if value == "empty" else {"a": [1]})
    path = tmp_path / "dd.pt"
    torch.save({"model": {}, "d": d}, path)
    _header._cached_header.cache_clear()
    if value == "filled":
        with pytest.raises(pickle.UnpicklingError):
            torch.load(path, weights_only=True)
        with pytest.raises(UnsafeCheckpointError):
            read_header(str(path))
        return
    with _allowlist.allowlisted():
        expected = torch.load(path, weights_only=True)
    header = read_header(str(path))
    assert type(header["d"]) is collections.defaultdict and header["d"].default_factory is list
    assert header == expected


def _a_bytearray():
    return bytearray()


def test_what_a_process_allowlisted_function_makes_is_vetted_even_when_dropped():
    """A function the process allowlisted (torch.serialization.add_safe_globals) may return
    anything; here a bytearray that APPENDS fills and a later SETITEM drops."""
    name = f"{_a_bytearray.__module__}\n{_a_bytearray.__qualname__}\n".encode()
    data = b"\x80\x02}(X\x01\x00\x00\x00ac" + name + b")R(K\x01eX\x01\x00\x00\x00aK\x01u."
    with torch.serialization.safe_globals([_a_bytearray]):
        with pytest.raises(pickle.UnpicklingError, match="Can only extend lists"):
            _torch_reads(data)
        assert _unpickle.header("x.pt", _Index, data) == (None, None)
        # unfilled, torch's loader reads it; the pass cannot tell, so it hands that on too
        plain = data.replace(b"(K\x01e", b"")
        assert _torch_reads(plain) == {"a": 1} and _unpickle.header("x.pt", _Index, plain) == (None, None)
