"""Every byte the engine reads is where ``torch.load`` finds it, whatever valid zip layout
the file has: each corpus file re-stored with Python's zipfile (stored, reordered, ZIP64,
data descriptors, deflated) and with a hand-written writer (extra fields in the local
headers only, ZIP64 in the central directory), then read by the engine and by torch.load.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

import metaseq_oneload as mo
from metaseq_oneload._reading import RangeReader, range_readable, read_header, storage_byte_offset
from tests import corpus

REPO = Path(__file__).resolve().parents[2]
CORPUS_ROOTS = (REPO / "tests" / "fixtures" / "metaseq", REPO / "tests" / "fixtures" / "fairseq")


def _is_zip(p: Path) -> bool:
    with open(p, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


# Every checkpoint file of the real sets: not the reference logits, not the text pointers
# (checkpoint_last-*.pt files that name another file).
CORPUS = sorted(p for root in CORPUS_ROOTS if root.is_dir() for p in root.rglob("*.pt")
                if p.name != "reference_logits.pt" and _is_zip(p))
SETS = sorted({p.parent for p in CORPUS})
# What the corpus manifests declare no checkpoint (metaseq's FasterTransformer export):
# discovery must refuse it in every layout; every other set must be inspected.
REFUSED = {e.folder for e in corpus.entries() if e.refused}


def _members(src) -> list:
    with zipfile.ZipFile(src) as z:
        return [(i.filename, z.read(i.filename)) for i in z.infolist()]


# --------------------------------------------------------------------------- writers
def restore_zipfile(src, dst, *, compression=zipfile.ZIP_STORED, reverse=False, drop=()) -> None:
    members = [(n, d) for n, d in _members(src) if n.split("/", 1)[1] not in drop]
    with zipfile.ZipFile(dst, "w", compression) as z:
        for name, data in (members[::-1] if reverse else members):
            z.writestr(name, data)


def restore_zip64_local(src, dst) -> None:
    """Python's zipfile with ZIP64 forced: a ZIP64 extra field in every local header."""
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as z:
        for name, data in _members(src):
            with z.open(zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0)), "w", force_zip64=True) as w:
                w.write(data)


class _Unseekable(io.RawIOBase):
    """A pipe-like sink: zipfile then writes a data descriptor after every record."""

    def __init__(self, f):
        self.f = f

    def writable(self):
        return True

    def seekable(self):
        return False

    def tell(self):
        raise OSError("unseekable")

    def write(self, b):
        return self.f.write(b)


def restore_data_descriptors(src, dst) -> None:
    with open(dst, "wb") as f, zipfile.ZipFile(_Unseekable(f), "w", zipfile.ZIP_STORED) as z:
        for name, data in _members(src):
            z.writestr(name, data)


def write_zip(dst, members, *, local_extra=lambda i: b"", zip64=False) -> None:
    """A minimal zip writer: extra fields in the local headers that the central directory
    does not repeat (the APPNOTE allows it), and optionally ZIP64 everywhere."""
    central = []
    with open(dst, "wb") as f:
        for i, (name, data) in enumerate(members):
            off, crc, n, nb = f.tell(), zlib.crc32(data), len(data), name.encode()
            extra = local_extra(i)
            if zip64:
                extra = struct.pack("<HHQQ", 1, 16, n, n) + extra
            size = 0xFFFFFFFF if zip64 else n
            f.write(struct.pack("<4s2B4HL2L2H", b"PK\x03\x04", 45 if zip64 else 20, 0, 0x800, 0, 0, 0x21, crc,
                                size, size, len(nb), len(extra)))
            f.write(nb + extra + data)
            central.append((nb, crc, n, off))
        cd_start = f.tell()
        for nb, crc, n, off in central:
            extra = struct.pack("<HHQQQ", 1, 24, n, n, off) if zip64 else b""
            size, hoff = (0xFFFFFFFF, 0xFFFFFFFF) if zip64 else (n, off)
            f.write(struct.pack("<4s4B4HL2L5H2L", b"PK\x01\x02", 45 if zip64 else 20, 3, 45 if zip64 else 20, 0,
                                0x800, 0, 0, 0x21, crc, size, size, len(nb), len(extra), 0, 0, 0, 0, hoff))
            f.write(nb + extra)
        cd_end = f.tell()
        count, cd_size = len(central), cd_end - cd_start
        if zip64:
            f.write(struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, cd_size, cd_start))
            f.write(struct.pack("<4sLQL", b"PK\x06\x07", 0, cd_end, 1))
            f.write(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0))
        else:
            f.write(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, cd_size, cd_start, 0))


def _padding(i: int) -> bytes:
    n = (i * 7) % 61  # lengths that torch's 64-byte alignment never produces
    return struct.pack("<HH", 0xCAFE, n) + bytes(n)


def restore_local_extras(src, dst) -> None:
    write_zip(dst, _members(src), local_extra=_padding)


def restore_zip64_central(src, dst) -> None:
    write_zip(dst, _members(src), local_extra=_padding, zip64=True)


LAYOUTS = {
    "zipfile": restore_zipfile,
    "zipfile-reordered": lambda s, d: restore_zipfile(s, d, reverse=True),
    # as older torch wrote it: without .format_version torch's meta load reports each
    # record's true offset instead of computing one
    "no-format-version": lambda s, d: restore_zipfile(s, d, reverse=True, drop=(".format_version",)),
    "zip64-local": restore_zip64_local,
    "data-descriptors": restore_data_descriptors,
    "local-extras": restore_local_extras,
    "zip64-central": restore_zip64_central,
    "deflated": lambda s, d: restore_zipfile(s, d, compression=zipfile.ZIP_DEFLATED),
}
IN_PLACE = {k for k in LAYOUTS if k != "deflated"}


# --------------------------------------------------------------------------- comparing
def _walk(obj, path=()):
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, path + (str(k),))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(v, path + (str(i),))
    elif isinstance(obj, argparse.Namespace):
        yield from _walk(vars(obj), path)


def _torch_load(path):
    return torch.load(path, map_location="cpu", weights_only=False)  # our own corpus files


def _storage_bytes(t: torch.Tensor) -> bytes:
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy().tobytes()


def assert_engine_bytes_match(path, ref: dict, *, in_place: bool) -> int:
    """Every tensor's storage as the engine locates it (read_header + storage_byte_offset)
    equals torch.load's bytes; returns how many tensors were compared."""
    header = read_header(str(path))
    ours, theirs = list(_walk(header)), list(_walk(ref))
    assert [p for p, _ in ours] == [p for p, _ in theirs]
    assert range_readable(str(path)) == in_place
    fd = os.open(path, os.O_RDONLY)
    try:
        for (p, h), (_, r) in zip(ours, theirs):
            geometry = (h.dtype, h.shape, h.stride(), h.storage_offset())
            assert geometry == (r.dtype, r.shape, r.stride(), r.storage_offset())
            off = storage_byte_offset(h)
            if not in_place or not h.is_contiguous():
                assert off is None, p  # read through torch.load, never guessed
                continue
            assert off is not None, f"{path}: {'.'.join(p)} has no verified offset"
            base = off - h.storage_offset() * h.element_size()
            want = _storage_bytes(r)
            assert os.pread(fd, len(want), base) == want, f"{path}: {'.'.join(p)}: the engine reads other bytes"
    finally:
        os.close(fd)
    return len(ours)


_REFS: dict = {}


def _reference(src: Path) -> dict:
    if src not in _REFS:
        _REFS[src] = _torch_load(src)
    return _REFS[src]


def test_the_corpus_is_there():
    assert len(CORPUS) >= 18, CORPUS  # 12 metaseq + 6 fairseq files at least
    assert {root.name for root in CORPUS_ROOTS if any(p.is_relative_to(root) for p in CORPUS)} == {"metaseq", "fairseq"}
    assert REFUSED <= set(SETS) and len(REFUSED) < len(SETS) // 4, REFUSED  # the exceptions are few and named


# Every file is re-stored with Python's zipfile and with ZIP64 plus local-only extra fields;
# the other layouts rotate over the corpus (each lands on every eighth file or so), which
# keeps the test fast as the corpus grows while every layout meets every kind of set.
ALWAYS = ("zipfile", "zip64-central")
ROTATING = [k for k in LAYOUTS if k not in ALWAYS]


def _layouts_for(i: int) -> tuple:
    return ALWAYS + (ROTATING[i % len(ROTATING)],)


def test_every_layout_meets_the_corpus():
    used = {k for i in range(len(CORPUS)) for k in _layouts_for(i)}
    assert used == set(LAYOUTS)


@pytest.mark.parametrize("i", range(len(CORPUS)), ids=[str(p.relative_to(REPO / "tests" / "fixtures")) for p in CORPUS])
def test_engine_bytes_equal_torch_load_in_other_zip_layouts(i, tmp_path):
    src = CORPUS[i]
    ref = _reference(src)
    compared = assert_engine_bytes_match(src, ref, in_place=True)
    assert compared > 0
    for layout in _layouts_for(i):
        write = LAYOUTS[layout]
        dst = tmp_path / layout / src.name
        dst.parent.mkdir()
        write(src, dst)
        assert assert_engine_bytes_match(dst, ref, in_place=layout in IN_PLACE) == compared, layout


def test_each_layout_is_one_torch_load_reads_and_torch_meta_offsets_get_wrong(tmp_path):
    """The premise: torch.load reads every layout; torch's own meta-load offsets (which the
    engine no longer uses) point elsewhere in all but torch's own layout."""
    src = REPO / "tests" / "fixtures" / "metaseq" / "singleton" / "checkpoint_2_consolidated.pt"
    ref = _reference(src)
    for layout, write in LAYOUTS.items():
        dst = tmp_path / f"{layout}.pt"
        write(src, dst)
        got = _torch_load(dst)
        for (p, a), (_, b) in zip(_walk(got), _walk(ref)):
            assert torch.equal(a, b), (layout, p)
        if layout in IN_PLACE - {"no-format-version"}:
            with torch.serialization.safe_globals([argparse.Namespace]):
                meta = torch.load(dst, map_location="meta", weights_only=True)
            header = read_header(str(dst))
            wrong = sum(int(m.untyped_storage()._checkpoint_offset)
                        != storage_byte_offset(h) - h.storage_offset() * h.element_size()
                        for (_, m), (_, h) in zip(_walk(meta), _walk(header)) if h.is_contiguous())
            assert wrong > 30, (layout, wrong)  # 36 of the 37 model tensors, and more


def _restore_set(src_dir: Path, dst_dir: Path, write) -> Path:
    dst_dir.mkdir(parents=True)
    for p in src_dir.iterdir():
        if p in CORPUS:
            write(p, dst_dir / p.name)
        elif p.is_file():
            shutil.copy(p, dst_dir / p.name)
    return dst_dir


def _layout_extents(layout):
    for part in layout.parts:
        for t in part.tensors.values():
            for ext in t.extents:
                yield t, ext


SET_LAYOUTS = ("zipfile-reordered", "zip64-central", "deflated")


@pytest.mark.parametrize("j", range(len(SETS)), ids=[f"{p.parent.name}/{p.name}" for p in SETS])
def test_inspect_extents_read_what_torch_load_reads(j, tmp_path):
    """The layouts inspect builds (flat parameters unflattened across shards included): every
    extent the RangeReader reads equals torch.load's elements at the same place. One layout
    per set, in rotation."""
    set_dir, layout_name = SETS[j], SET_LAYOUTS[j % len(SET_LAYOUTS)]
    first = min(p for p in CORPUS if p.parent == set_dir)
    restored = _restore_set(set_dir, tmp_path / set_dir.name, LAYOUTS[layout_name])
    if set_dir in REFUSED:  # no checkpoint, by the manifest: refused alike, whatever the zip layout
        for p in (first, restored / first.name):
            with pytest.raises(mo.CheckpointLayoutError, match=r"not a model checkpoint"):
                mo.inspect(p)
        return
    layout = mo.inspect(restored / first.name)
    objects: dict = {}
    n = 0
    with RangeReader() as reader:
        for t, ext in _layout_extents(layout):
            assert (ext.byte_offset is not None) == (layout_name in IN_PLACE), ext
            obj = objects.get(ext.path)
            if obj is None:
                obj = objects[ext.path] = _torch_load(ext.path)
            for part in ext.key.split("\x00"):
                obj = obj[part]
            want = obj.reshape(-1)[ext.elem_offset: ext.elem_offset + ext.numel]
            got = torch.empty(ext.numel, dtype=t.dtype)
            reader.read_extent(ext, 0, got, t.dtype)
            assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)), (t.name, ext)
            n += 1
    assert n > 0


@pytest.mark.parametrize("name, layout_name", [("metaseq/singleton", "zipfile-reordered"),
                                               ("metaseq/fsdp_dp3", "zip64-central"),
                                               ("fairseq/mp2", "local-extras"),
                                               ("metaseq/mp2_dp2", "deflated")])
def test_verify_calls_a_restored_copy_identical(name, layout_name, tmp_path):
    src = REPO / "tests" / "fixtures" / name
    restored = _restore_set(src, tmp_path / "copy", LAYOUTS[layout_name])
    report = mo.verify(src, restored)
    assert report.identical and report.match, report.largest(3)
    assert report.elements > 0 and not any(d.mismatched for d in report.diffs)


def test_every_dtype_view_and_tie_torch_save_writes(tmp_path):
    """Beyond the corpus: every dtype (float8 and uint16 are saved as untyped bytes), views
    into a larger storage, ties, empty and 0-d tensors, in every layout."""
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.bool, torch.int8, torch.uint8,
              torch.int16, torch.int32, torch.int64, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2,
              torch.uint16, torch.uint32]
    g = torch.Generator().manual_seed(0)
    sd = {str(d): (torch.randn(3, 5, generator=g) * 10).to(d) for d in dtypes}
    base = torch.arange(40.0)
    sd.update(slice=base[5:9], strided=base.reshape(8, 5)[:, 1:3], tied=base, empty=torch.empty(0, 3),
              scalar=torch.tensor(3.0), nested={"list": [torch.ones(2), (torch.zeros(3),)]})
    src = tmp_path / "dtypes.pt"
    torch.save({"model": sd}, src)
    ref = _torch_load(src)
    n = assert_engine_bytes_match(src, ref, in_place=True)
    for layout, write in LAYOUTS.items():
        dst = tmp_path / f"{layout}.pt"
        write(src, dst)
        assert assert_engine_bytes_match(dst, ref, in_place=layout in IN_PLACE) == n, layout


def test_convert_of_a_restored_set_equals_the_source(tmp_path):
    src = REPO / "tests" / "fixtures" / "metaseq" / "mp2_dp2"
    restored = _restore_set(src, tmp_path / "copy", LAYOUTS["zip64-central"])
    out = tmp_path / "out"
    out.mkdir()
    mo.convert(restored, out / "checkpoint_2", model_parallel=1, shards=1, progress=False)
    report = mo.verify(src, out)
    assert report.match and report.elements > 0, report.largest(3)
