"""Headers that claim more (or other) bytes than the file holds are refused where the header
is read, naming the file and the tensor, before anything is allocated or written: a storage
record of the wrong size, a tensor reaching past its storage, absurd element counts, and
archives torch cannot read or could read two ways. Each case is a real checkpoint of the
corpus with one thing changed; every failing call leaves the files as they were.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import pickle
import pickletools
import re
import resource
import shutil
import time
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import metaseq_oneload as mo
from metaseq_oneload import CheckpointLayoutError
from metaseq_oneload._reading import read_header

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SINGLETON = FIXTURES / "metaseq" / "singleton" / "checkpoint_2_consolidated.pt"
SHARD = FIXTURES / "metaseq" / "fsdp_dp3" / "checkpoint_2-model_part-0-shard1.pt"


def _digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@contextlib.contextmanager
def unchanged(folder: Path):
    before = _digest(folder)
    yield
    assert _digest(folder) == before, "a failing call changed the user's files"


def refused(call, path: Path, *patterns: str) -> str:
    """``call()`` raises CheckpointLayoutError whose message names ``path`` and matches every
    pattern; the folder is unchanged."""
    with unchanged(path.parent), pytest.raises(CheckpointLayoutError) as info:
        call()
    msg = str(info.value)
    assert path.name in msg, msg
    for p in patterns:
        assert re.search(p, msg), (p, msg)
    return msg


def _members(src) -> list:
    with zipfile.ZipFile(src) as z:
        return [(i.filename, z.read(i.filename)) for i in z.infolist()]


def restore(src, dst, *, replace=None, method=zipfile.ZIP_STORED, duplicate=None) -> Path:
    """``src`` re-stored with Python's zipfile, records changed by ``replace``
    ({short name: bytes}), optionally one record written twice."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(dst, "w", method) as z, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about the duplicate we ask for
        for name, data in _members(src):
            short = name.split("/", 1)[1]
            data = (replace or {}).get(short, data)
            z.writestr(name, data)
            if short == duplicate:
                z.writestr(name, data[::-1])
    return dst


def _set_copy(src: Path, tmp_path: Path) -> Path:
    """A writable copy of the set ``src`` belongs to (the checkpoint files only)."""
    out = tmp_path / src.parent.name
    out.mkdir()
    prefix = src.name.split("-model_part")[0].split("_consolidated")[0]
    for p in src.parent.glob(prefix + "*.pt"):
        shutil.copy(p, out / p.name)
    return out


def _record(src, short):
    return dict((n.split("/", 1)[1], d) for n, d in _members(src))[short]


# --------------------------------------------------------------------------- 2: record size
@pytest.mark.parametrize("change, size", [("shorter", 4352), ("longer", 8704 + 64)])
def test_a_storage_record_of_the_wrong_size_is_refused(change, size, tmp_path):
    data = _record(SINGLETON, "data/0")  # decoder.embed_tokens.weight, 64 x 34 float32
    assert len(data) == 8704
    data = data[:size] if change == "shorter" else data + bytes(size - len(data))
    bad = restore(SINGLETON, tmp_path / "set" / SINGLETON.name, replace={"data/0": data})
    with pytest.raises(RuntimeError, match="does not match expected size"):
        torch.load(bad, weights_only=False)  # torch.load refuses it as well
    for call in (lambda: read_header(str(bad)), lambda: mo.inspect(bad), lambda: mo.load_state_dict(bad)):
        refused(call, bad, r"tensor model\.decoder\.embed_tokens\.weight", rf"holds {size} bytes",
                r"2176 float32 elements \(8704 bytes\)")


# --------------------------------------------------------------------------- 3: tensor bounds
@contextlib.contextmanager
def saved_as(target: torch.Tensor, size, stride, offset):
    """torch.save writes ``target`` with this size/stride/offset over its real storage (what
    an edited or damaged header holds; torch's writer never produces it)."""
    original = torch.Tensor.__reduce_ex__

    def reduce_ex(self, proto):
        if self is target:
            return (torch._utils._rebuild_tensor_v2,
                    (self._typed_storage(), offset, tuple(size), tuple(stride), False, collections.OrderedDict()))
        return original(self, proto)

    torch.Tensor.__reduce_ex__ = reduce_ex
    try:
        yield
    finally:
        torch.Tensor.__reduce_ex__ = original


def _resave(src: Path, dst: Path, key: str, size, stride, offset) -> Path:
    obj = torch.load(src, map_location="cpu", weights_only=False)
    t = obj["model"][key]
    with saved_as(t, size, stride, offset):
        torch.save(obj, dst)
    return dst


PAST = [
    # a weight one row longer than its storage
    (SINGLETON, "decoder.layers.0.fc1.weight", lambda t: ((t.shape[0] + 1, t.shape[1]), t.stride(), 0)),
    # a flat parameter shifted by one element: its last element lies past the storage
    (SHARD, "decoder.layers.0.flat_param_0", lambda t: (t.shape, t.stride(), 1)),
]


@pytest.mark.parametrize("src, key, geometry", PAST, ids=["weight", "flat_param"])
def test_a_tensor_reaching_past_its_storage_is_refused(src, key, geometry, tmp_path):
    folder = _set_copy(src, tmp_path)
    t = read_header(str(src))["model"][key]
    size, stride, offset = geometry(t)
    bad = _resave(src, folder / src.name, key, size, stride, offset)
    with pytest.raises(RuntimeError, match="not resizable"):
        torch.load(bad, weights_only=False)
    pattern = (rf"tensor model\.{re.escape(key)}: shape {re.escape(str(tuple(size)))} .* reaches element "
               rf"{t.numel() + 1 if offset else t.numel() + t.shape[-1]} of a storage of {t.numel()} float32")
    refused(lambda: mo.inspect(folder), bad, pattern)
    refused(lambda: mo.load_state_dict(folder), bad, pattern)
    out = tmp_path / "out"
    out.mkdir()
    with unchanged(out):  # convert: this error, not torch's raw RuntimeError, and nothing written
        refused(lambda: mo.convert(folder, out / "converted", model_parallel=1), bad, pattern)


def test_a_legacy_file_with_a_tensor_past_its_storage_is_refused(tmp_path):
    """Pre-1.6 files are read whole by torch; its own size check speaks, as our error."""
    folder = _set_copy(SINGLETON, tmp_path)
    obj = torch.load(SINGLETON, map_location="cpu", weights_only=False)
    t = obj["model"]["decoder.layers.0.fc1.weight"]
    bad = folder / SINGLETON.name
    with saved_as(t, (t.shape[0] + 1, t.shape[1]), t.stride(), 0):
        torch.save(obj, bad, _use_new_zipfile_serialization=False)
    for call in (lambda: mo.inspect(folder), lambda: mo.load_state_dict(folder)):
        refused(call, bad, r"a tensor's header and its stored bytes disagree")


# --------------------------------------------------------------------------- 11: absurd counts
def _with_storage_numel(pkl: bytes, numel: int) -> bytes:
    """The pickle with the element count of its first storage reference replaced: the int
    pushed just before the TUPLE that BINPERSID consumes (protocol 2 has no frames, so the
    opcode may change length)."""
    ops = list(pickletools.genops(pkl))
    i = next(j for j, (op, _, _) in enumerate(ops) if op.name == "BINPERSID")
    while ops[i][0].name != "TUPLE":
        i -= 1
    op, _, pos = ops[i - 1]
    assert op.name.startswith("BININT") or op.name.startswith("LONG"), op.name
    end = ops[i][2]
    enc = pickle.encode_long(numel)
    return pkl[:pos] + b"\x8a" + bytes([len(enc)]) + enc + pkl[end:]


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_storage_declaring_10_to_the_12_elements_fails_at_inspect(tmp_path):
    pkl = _with_storage_numel(_record(SINGLETON, "data.pkl"), 10 ** 12)
    bad = restore(SINGLETON, tmp_path / "set" / SINGLETON.name, replace={"data.pkl": pkl})
    rss, t0 = _rss_mb(), time.perf_counter()
    for call in (lambda: mo.inspect(bad), lambda: mo.load_state_dict(bad)):
        refused(call, bad, r"tensor model\.decoder\.embed_tokens\.weight", r"holds 8704 bytes",
                r"declares 1000000000000 float32 elements \(4000000000000 bytes\)")
    assert time.perf_counter() - t0 < 30
    assert _rss_mb() - rss < 512  # nothing of the 4 TB was allocated


def test_a_shape_of_10_to_the_12_elements_fails_at_inspect(tmp_path):
    folder = _set_copy(SINGLETON, tmp_path)
    key = "decoder.embed_tokens.weight"
    bad = _resave(SINGLETON, folder / SINGLETON.name, key, (10 ** 6, 10 ** 6), (10 ** 6, 1), 0)
    rss = _rss_mb()
    refused(lambda: mo.inspect(folder), bad, rf"tensor model\.{re.escape(key)}: shape \(1000000, 1000000\)",
            r"reaches element 1000000000000 of a storage of 2176 float32")
    assert _rss_mb() - rss < 512


# --------------------------------------------------------------------------- 1: archives read two ways
def test_a_record_compressed_with_a_method_torch_cannot_read_is_refused(tmp_path):
    bad = restore(SINGLETON, tmp_path / "set" / SINGLETON.name, method=zipfile.ZIP_BZIP2)
    refused(lambda: mo.inspect(bad), bad, r"compressed with zip method 12 \(bzip2\)", r"ZIP_STORED")


def test_a_deflated_archive_is_read_whole_not_in_place(tmp_path):
    good = restore(SINGLETON, tmp_path / "set" / SINGLETON.name, method=zipfile.ZIP_DEFLATED)
    layout = mo.inspect(good)
    assert layout.files[0][0].format == "zip-packed"
    assert all(e.byte_offset is None for p in layout.parts for t in p.tensors.values() for e in t.extents)
    sd = mo.load_state_dict(good)
    ref = torch.load(SINGLETON, weights_only=False)["model"]
    assert torch.equal(sd["decoder.layers.0.fc1.weight"], ref["decoder.layers.0.fc1.weight"])


def test_two_records_of_one_name_are_refused(tmp_path):
    bad = restore(SINGLETON, tmp_path / "set" / SINGLETON.name, duplicate="data/3")
    refused(lambda: mo.inspect(bad), bad, r"two records named checkpoint_2_consolidated/data/3")


def test_a_central_directory_pointing_at_the_wrong_bytes_is_refused(tmp_path):
    bad = restore(SINGLETON, tmp_path / "set" / SINGLETON.name)
    raw = bytearray(bad.read_bytes())
    with zipfile.ZipFile(bad) as z:
        info, at = z.getinfo("checkpoint_2_consolidated/data/5"), z.start_dir
    # its central directory entry: the local-header offset moved 8 bytes into the record's data
    name = info.filename.encode()
    while raw[at + 46: at + 46 + len(name)] != name:
        at = raw.index(b"PK\x01\x02", at + 4)
    raw[at + 42: at + 46] = (info.header_offset + 8).to_bytes(4, "little")
    bad.write_bytes(bytes(raw))
    refused(lambda: mo.inspect(bad), bad,
            r"places checkpoint_2_consolidated/data/5 at byte \d+, which holds no local file header")


# --------------------------------------------------------------------------- the reader's own guard
def test_a_read_outside_every_storage_record_is_refused():
    """Whatever computed an extent, the reader reads only inside one verified storage record:
    one element too many, or the bytes of a zip header, raise instead of loading garbage."""
    from metaseq_oneload._reading import Extent, RangeReader, key_path, storage_byte_offset

    t = read_header(str(SINGLETON))["model"]["decoder.embed_tokens.weight"]
    off = storage_byte_offset(t)
    key = key_path("model", "decoder.embed_tokens.weight")
    with RangeReader() as reader:
        out = torch.empty(t.numel(), dtype=t.dtype)
        reader.read_extent(Extent(str(SINGLETON), key, 0, t.numel(), off), 0, out, t.dtype)
        for ext in (Extent(str(SINGLETON), key, 0, t.numel() + 1, off), Extent(str(SINGLETON), key, 0, 4, 0)):
            with pytest.raises(CheckpointLayoutError, match=r"checkpoint_2_consolidated\.pt: asked to read bytes "
                                                            r"\d+\.\.\d+, which do not lie inside one tensor record"):
                reader.read_extent(ext, 0, torch.empty(ext.numel, dtype=t.dtype), t.dtype)
    ref = torch.load(SINGLETON, weights_only=False)["model"]["decoder.embed_tokens.weight"]
    assert torch.equal(out, ref.reshape(-1))


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_listing_the_storages_runs_nothing_of_the_pickle(tmp_path):
    """The storage references are listed by replaying the pickle with stubs: a payload that
    torch's allowlist refuses is not run by the listing either (it runs under trust_pickle
    only, as documented)."""
    from metaseq_oneload._header import _storage_refs

    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.zeros(3)}, "x": _Payload(marker)}, path)
    refs = _storage_refs(_record(path, "data.pkl"), str(path))
    assert [(r.key, r.dtype, r.numel) for r in refs] == [("0", torch.float32, 3)]
    assert not marker.exists()
