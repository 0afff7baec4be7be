"""A header read is one pass of the C unpickler (metaseq_oneload._unpickle) that builds what
the layout needs: the model's meta tensors, metadata, cfg. The optimizer state's tensors are
built only when something uses them, yet its records and bounds are checked with the rest;
every tensor is what torch's own meta load gives, at the offset the archive holds; what the
allowlist refuses is refused before its module is even imported (issue 15)."""

from __future__ import annotations

import argparse
import copy
import os
import pickle
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import metaseq_oneload as mo
from metaseq_oneload import CheckpointLayoutError, UnsafeCheckpointError
from metaseq_oneload import _header, _unpickle, _zip
from metaseq_oneload._reading import read_header, storage_byte_offset

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PARAMS = 200  # optimizer entries: 3 tensors each, 600 against the model's 3


def _with_optimizer(path: Path) -> dict:
    g = torch.Generator().manual_seed(0)
    obj = {
        "model": {f"decoder.w{i}": torch.randn(4, 3, generator=g) for i in range(3)},
        "cfg": {"model": argparse.Namespace(arch="x"), "common": {"model_parallel_size": 1}},
        "last_optimizer_state": {
            "state": {i: {"step": torch.tensor(5.0), "exp_avg": torch.randn(7, generator=g),
                          "exp_avg_sq": torch.rand(7, generator=g)} for i in range(PARAMS)},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.98), "params": list(range(PARAMS))}],
        },
    }
    torch.save(obj, path)
    return obj


@pytest.fixture
def builds(monkeypatch) -> list:
    """Every meta tensor a header read builds (one per distinct tensor of the pickle)."""
    built: list = []
    real = _unpickle._Stub.tensor

    def counting(self):
        if self._tensor is None:
            built.append(self)
        return real(self)

    monkeypatch.setattr(_unpickle._Stub, "tensor", counting)
    _header._cached_header.cache_clear()
    yield built
    _header._cached_header.cache_clear()


def _bytes_at(path: Path, t: torch.Tensor) -> torch.Tensor:
    with open(path, "rb") as f:
        f.seek(storage_byte_offset(t))
        raw = f.read(t.numel() * t.element_size())
    return torch.frombuffer(bytearray(raw), dtype=t.dtype).reshape(t.shape)


def test_a_header_read_builds_the_model_not_the_optimizer(tmp_path, builds):
    path = tmp_path / "checkpoint_1.pt"
    saved = _with_optimizer(path)
    header = read_header(str(path))
    assert len(builds) == 3  # the model's three, none of the optimizer's 600
    assert sorted(header["model"]) == sorted(saved["model"])
    assert header["cfg"]["model"].arch == "x"
    los = header["last_optimizer_state"]
    # what discovery asks of it builds nothing
    assert "state" in los and len(los) == 2 and len(builds) == 3
    layout = mo.inspect(path)
    assert layout.kind == "singleton" and len(builds) == 3
    # the optimizer paths read it as a mapping of meta tensors, built on first use, all at once
    entry = los["state"][7]
    assert len(builds) == 3 + 3 * PARAMS
    for k, v in saved["last_optimizer_state"]["state"][7].items():
        assert entry[k].device.type == "meta" and entry[k].dtype == v.dtype and entry[k].shape == v.shape
        assert torch.equal(_bytes_at(path, entry[k]), v), k
    assert los["param_groups"] == saved["last_optimizer_state"]["param_groups"]
    # copies and pickles are plain dicts of the same tensors
    assert type(copy.deepcopy(los)) is dict and type(copy.copy(los)) is dict
    again = pickle.loads(pickle.dumps(los))
    assert type(again) is dict and again["param_groups"] == los["param_groups"]
    for name, t in saved["model"].items():
        assert torch.equal(_bytes_at(path, header["model"][name]), t), name


def test_the_optimizer_records_are_checked_though_not_built(tmp_path, builds):
    """Laziness skips building, never checking: a wrong-sized optimizer record fails the
    header read itself, naming the tensor."""
    good = tmp_path / "good.pt"
    _with_optimizer(good)
    with zipfile.ZipFile(good) as z:
        members = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    # the last storage torch.save wrote belongs to the optimizer's last entry
    last = max((n for n, _ in members if "/data/" in n), key=lambda n: int(n.rsplit("/", 1)[1]))
    bad = tmp_path / "set" / "bad.pt"
    bad.parent.mkdir()
    with zipfile.ZipFile(bad, "w", zipfile.ZIP_STORED) as z:
        for name, data in members:
            z.writestr(name, data + bytes(4) if name == last else data)
    with pytest.raises(CheckpointLayoutError, match=rf"bad\.pt: tensor last_optimizer_state\.state\.{PARAMS - 1}\.\w+: "
                                                     r"its storage record \S+ holds \d+ bytes"):
        read_header(str(bad))
    with pytest.raises(CheckpointLayoutError, match="holds"):
        mo.inspect(bad)


def _walk(obj, path=()):
    if isinstance(obj, torch.Tensor):
        yield ".".join(path), obj
        return
    if isinstance(obj, argparse.Namespace):
        obj = vars(obj)
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(
        obj, (list, tuple)) else ()
    for k, v in items:
        yield from _walk(v, path + (str(k),))


ZIPS = sorted(p for p in FIXTURES.rglob("*.pt") if p.read_bytes()[:4] == b"PK\x03\x04")


@pytest.mark.skipif(not ZIPS, reason="tests/fixtures holds no zip checkpoints")
def test_every_corpus_header_is_what_torchs_meta_load_gives():
    """For every zip checkpoint of the corpus, the one pass and torch's loader (with the checks
    it always had) agree on every tensor: name, dtype, shape, stride, storage offset, type,
    requires_grad, storage size and the verified byte offset."""
    fast = 0
    for p in ZIPS:
        key = _zip.stat_key(str(p))
        index = _zip.zip_index(key)
        fd = os.open(p, os.O_RDONLY)
        try:
            data = _zip.record_bytes(fd, index.records["data.pkl"], str(p))
        finally:
            os.close(fd)
        ours, problem = _unpickle.header(str(p), index, data)
        assert problem is None, (p, problem)
        if ours is None:  # a tensor subclass or one with attributes: torch's loader reads it
            continue
        fast += 1
        theirs = _header._load_with_torch(str(p), trust_pickle=False, map_location="meta")
        _header.check_zip(str(p), theirs, index, data)
        a, b = list(_walk(ours)), list(_walk(theirs))
        assert [n for n, _ in a] == [n for n, _ in b], p
        for (n, x), (_, y) in zip(a, b):
            assert (type(x), x.dtype, x.shape, x.stride(), x.storage_offset(), x.requires_grad,
                    x.untyped_storage().nbytes()) == (type(y), y.dtype, y.shape, y.stride(), y.storage_offset(),
                                                      y.requires_grad, y.untyped_storage().nbytes()), (p, n)
            assert storage_byte_offset(x) == storage_byte_offset(y), (p, n)
    assert fast >= len(ZIPS) - 2, (fast, len(ZIPS))


def test_a_tensor_with_attributes_is_read_by_torchs_loader(tmp_path):
    t = torch.arange(6.0)
    t.note = "kept"  # torch.save writes _rebuild_from_type_v2, which the one pass hands on
    path = tmp_path / "attr.pt"
    torch.save({"model": {"w": t}}, path)
    index = _zip.zip_index(_zip.stat_key(str(path)))
    with zipfile.ZipFile(path) as z:
        data = z.read(f"{index.folder}/data.pkl")
    assert _unpickle.header(str(path), index, data) == (None, None)
    w = read_header(str(path))["model"]["w"]
    assert w.device.type == "meta" and w.note == "kept"
    assert torch.equal(_bytes_at(path, w), t)


def test_a_refused_global_is_never_imported(tmp_path, monkeypatch):
    """The allowlist is checked on the name: the module a refused global names is not
    imported (importing it would run its top level), by the one pass or the fallback."""
    marker = tmp_path / "imported"
    (tmp_path / "oneload_evil_mod.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "def payload():\n    return 'ran'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import oneload_evil_mod

    class Carrier:
        def __reduce__(self):
            return (oneload_evil_mod.payload, ())

    path = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.zeros(2)}, "extra_state": Carrier()}, path)
    del sys.modules["oneload_evil_mod"]
    marker.unlink()
    index = _zip.zip_index(_zip.stat_key(str(path)))
    with zipfile.ZipFile(path) as z:
        data = z.read(f"{index.folder}/data.pkl")
    assert _unpickle.header(str(path), index, data) == (None, None)
    with pytest.raises(UnsafeCheckpointError, match=r"refused to unpickle: the file needs oneload_evil_mod\.payload"):
        read_header(str(path))
    assert not marker.exists() and "oneload_evil_mod" not in sys.modules


def test_the_deferred_optimizer_state_is_a_dict_every_way_in(tmp_path, builds):
    """Code that walks a header with isinstance(x, dict) and any dict idiom sees the built
    tensors, never a placeholder."""
    path = tmp_path / "checkpoint_1.pt"
    saved = _with_optimizer(path)
    ways = [lambda d: dict(d), lambda d: {**d}, lambda d: list(d.values()), lambda d: list(d.items()),
            lambda d: d["state"], lambda d: d.get("state"), lambda d: [d[k] for k in d], lambda d: d == {},
            lambda d: repr(d), lambda d: copy.deepcopy(d), lambda d: pickle.dumps(d),
            lambda d: {}.update(d)]
    for way in ways:
        _header._cached_header.cache_clear()
        builds.clear()
        los = read_header(str(path))["last_optimizer_state"]
        assert isinstance(los, dict) and len(builds) == 3
        way(los)
        assert len(builds) == 3 + 3 * PARAMS
        assert all(type(t) is torch.Tensor for _, t in _walk(dict(los)))
    assert len(list(_walk(dict(los)))) == 3 * PARAMS
    want = saved["last_optimizer_state"]["state"][PARAMS - 1]["exp_avg_sq"]
    assert torch.equal(_bytes_at(path, los["state"][PARAMS - 1]["exp_avg_sq"]), want)


def test_what_the_one_pass_finds_wrong_stands_whatever_the_fallback_says(tmp_path, monkeypatch):
    """The one pass hands a file it finds wrong to torch's loader and the old checks, for
    their wording; if those let it through (here: checks switched off), its finding stands."""
    import collections

    t = torch.arange(3.0)
    original = torch.Tensor.__reduce_ex__

    def reduce_ex(self, proto):  # a header that claims 5 elements of a 3-element storage
        if self is t:
            return (torch._utils._rebuild_tensor_v2,
                    (self._typed_storage(), 0, (5,), (1,), False, collections.OrderedDict()))
        return original(self, proto)

    path = tmp_path / "past.pt"
    monkeypatch.setattr(torch.Tensor, "__reduce_ex__", reduce_ex)
    torch.save({"model": {"w": t}}, path)
    monkeypatch.setattr(torch.Tensor, "__reduce_ex__", original)
    _header._cached_header.cache_clear()
    with pytest.raises(CheckpointLayoutError, match=r"past\.pt: tensor model\.w: shape \(5,\) .* reaches element 5 "
                                                     r"of a storage of 3 float32"):
        read_header(str(path))  # the old checks' words
    monkeypatch.setattr(_header, "check_zip", lambda *a: None)
    _header._cached_header.cache_clear()
    with pytest.raises(CheckpointLayoutError, match=r"past\.pt: a tensor reaches element 5 of a storage of 3 elements"):
        read_header(str(path))
    _header._cached_header.cache_clear()


def test_a_build_aimed_at_a_tensor_cannot_change_it_after_its_checks(tmp_path, monkeypatch):
    """BUILD with slot state sets attributes: aimed at the one pass's tensor record it could
    put any object where the tensor goes, after the builder's checks. The record refuses;
    torch's loader judges the file."""
    import collections

    t = torch.arange(3.0)
    original = torch.Tensor.__reduce_ex__

    def reduce_ex(self, proto):
        if self is t:
            return (torch._utils._rebuild_tensor_v2,
                    (self._typed_storage(), 0, (3,), (1,), False, collections.OrderedDict()),
                    (None, {"_tensor": "not a tensor"}))
        return original(self, proto)

    path = tmp_path / "built.pt"
    monkeypatch.setattr(torch.Tensor, "__reduce_ex__", reduce_ex)
    torch.save({"model": {"w": t}}, path)
    monkeypatch.setattr(torch.Tensor, "__reduce_ex__", original)
    index = _zip.zip_index(_zip.stat_key(str(path)))
    with zipfile.ZipFile(path) as z:
        data = z.read(f"{index.folder}/data.pkl")
    assert b"_tensor" in data  # the BUILD is there
    assert _unpickle.header(str(path), index, data) == (None, None)
    _header._cached_header.cache_clear()
    # torch's loader judges the file: it refuses it (the torch this suite runs on: set_()
    # rejects the state), said as this file's damage, or it gives the tensor, unchanged.
    # Any other exception, or anything else where the tensor goes, fails the test.
    try:
        w = read_header(str(path))["model"]["w"]
    except CheckpointLayoutError as e:
        assert str(e).startswith(f"{path}: "), e
        return
    assert type(w) is torch.Tensor and w.device.type == "meta" and w.shape == (3,) and w.dtype == torch.float32
    assert torch.equal(_bytes_at(path, w), t)


class _Index:
    """The archive of a pickle-only file: no storage records."""

    records: dict = {}
    folder = "x"
    why_not_range_readable = None


# BUILD aimed at a global itself: with slot state it sets the class's attributes, with a dict
# it fills the object's __dict__; the C unpickler does either to whatever is on its stack.
# The globals are the process's own objects, so each would change every later load.
_BUILD_ON_GLOBALS = {
    "class": (b"\x80\x02cargparse\nNamespace\nN}X\x03\x00\x00\x00fooK\x01s\x86b.",
              lambda: getattr(argparse.Namespace, "foo", None)),
    "function": (b"\x80\x02ctorch.serialization\n_get_layout\n}X\x03\x00\x00\x00fooK\x01sb.",
                 lambda: getattr(torch.serialization._get_layout, "foo", None)),
    "storage class": (b"\x80\x02ctorch\nFloatStorage\n}X\x06\x00\x00\x00_dtypectorch\nint8\nsb.",
                      lambda: torch._weights_only_unpickler._get_allowed_globals()["torch.FloatStorage"].__dict__.get(
                          "_dtype") is not torch.float32 or None),
}


@pytest.mark.parametrize("target", sorted(_BUILD_ON_GLOBALS))
def test_a_build_aimed_at_a_global_changes_nothing_of_the_process(target):
    pkl, changed = _BUILD_ON_GLOBALS[target]
    assert changed() is None
    assert _unpickle.header("x.pt", _Index, pkl) == (None, None)
    assert changed() is None


def test_allowlisted_classes_come_back_as_themselves():
    import collections

    obj, problem = _unpickle.header("x.pt", _Index, pickle.dumps(
        {"cfg": argparse.Namespace(a=1, b=[2]), "c": collections.Counter(a=3), "o": collections.OrderedDict(z=1)},
        protocol=2))
    assert problem is None
    assert type(obj["cfg"]) is argparse.Namespace and vars(obj["cfg"]) == {"a": 1, "b": [2]}
    assert type(obj["c"]) is collections.Counter and obj["c"]["a"] == 3
    assert type(obj["o"]) is collections.OrderedDict
