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
from metaseq_oneload import _reading, _unpickle
from metaseq_oneload._reading import read_header


class _Index:
    """The archive of a pickle-only file: no storage records."""

    records: dict = {}
    folder = "x"
    why_not_range_readable = None


def _zip_with_pickle(path, data_pkl: bytes) -> str:
    """A torch.save archive whose data.pkl is replaced by ``data_pkl`` (stored, as torch writes)."""
    torch.save({"model": {}}, path)
    with zipfile.ZipFile(path) as z:
        members = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members:
            z.writestr(name, data_pkl if name.endswith("/data.pkl") else data)
    _reading._cached_header.cache_clear()
    return str(path)


def _torch_reads(data: bytes):
    """What torch's weights_only loader makes of a pickle (under our allowlist)."""
    with _reading._allowlisted():
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
    _reading._cached_header.cache_clear()
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
