"""Archives that disagree with themselves, and small files that declare huge costs.

Each case is a real ``torch.save`` file rewritten by a raw zip writer (or re-saved with one
thing changed). Where torch's own reader has a verdict, ours is the same: refused where
``torch.load`` refuses, the same bytes where it accepts. Where torch's reader hands back
bytes it did not read (a deflate stream that stops early or runs on: miniz reports nothing
and returns its buffer), we refuse. Memory is measured in a fresh process (peak RSS).
"""

from __future__ import annotations

import json
import pickle
import pickletools
import struct
import subprocess
import sys
import textwrap
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

import metaseq_oneload as mo
from metaseq_oneload import CheckpointLayoutError
from metaseq_oneload._reading import read_header, storage_byte_offset


# --------------------------------------------------------------------------- files
def _base(tmp_path: Path) -> Path:
    """Two float32 storages of 256 bytes each, records data/0 and data/1, next to each other."""
    path = tmp_path / "base.pt"
    torch.save({"a.weight": torch.arange(64, dtype=torch.float32).reshape(8, 8),
                "b.weight": torch.arange(100, 164, dtype=torch.float32)}, path)
    return path


def _members(src: Path) -> list:
    with zipfile.ZipFile(src) as z:
        return [(i.filename, z.read(i.filename)) for i in z.infolist()]


def _deflate(data: bytes, zeros: int = 0) -> bytes:
    """``data`` then ``zeros`` zero bytes as one raw deflate stream (a 1 GiB stream never lies
    in memory here). After a full flush deflate refers to nothing before it, so every 16 MiB
    block of zeros that follows one compresses to the same bytes: compressed once and
    repeated (compressing 1 GiB at level 9 took 5-15 s of a test's time)."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    out = [c.compress(data)]
    if zeros:
        out.append(c.flush(zlib.Z_FULL_FLUSH))
        whole, rest = divmod(zeros, 16 << 20)
        if whole:
            out += [c.compress(bytes(16 << 20)) + c.flush(zlib.Z_FULL_FLUSH)] * whole
        out.append(c.compress(bytes(rest)))
    return b"".join(out) + c.flush()


def write_zip(dst: Path, members: list, fields: dict) -> Path:
    """A zip writer that writes whatever sizes it is told. ``fields`` maps a record's short
    name to: ``method``; ``raw`` (the bytes put in the file); ``csize``/``usize`` (both
    headers); ``cd_csize``/``cd_usize``/``lh_csize``/``lh_usize`` (one header only); ``zip64``
    (the central directory gives the sizes in a ZIP64 extra field)."""
    central = []
    with open(dst, "wb") as f:
        for name, data in members:
            fx = fields.get(name.split("/", 1)[1], {})
            method = fx.get("method", 0)
            raw = fx.get("raw", data if method == 0 else _deflate(data))
            crc, off, nb = zlib.crc32(data), f.tell(), name.encode()
            usize, csize = fx.get("usize", len(data)), fx.get("csize", len(raw))
            f.write(struct.pack("<4s2B4HL2L2H", b"PK\x03\x04", 20, 0, 0x800, method, 0, 0x21, crc,
                                fx.get("lh_csize", csize), fx.get("lh_usize", usize), len(nb), 0))
            f.write(nb + raw)
            central.append((nb, crc, fx.get("cd_csize", csize), fx.get("cd_usize", usize), off, method,
                            fx.get("zip64", False)))
        start = f.tell()
        for nb, crc, cs, us, off, method, z64 in central:
            extra = b""
            if z64:
                extra, cs, us = struct.pack("<HHQQ", 1, 16, us, cs), 0xFFFFFFFF, 0xFFFFFFFF
            f.write(struct.pack("<4s4B4HL2L5H2L", b"PK\x01\x02", 45 if z64 else 20, 3, 45 if z64 else 20, 0,
                                0x800, method, 0, 0x21, crc, cs, us, len(nb), len(extra), 0, 0, 0, 0, off))
            f.write(nb + extra)
        end = f.tell()
        f.write(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(central), len(central), end - start, start, 0))
    return dst


def _rewrite(tmp_path: Path, name: str, fields: dict, members=None) -> Path:
    base = _base(tmp_path)
    dst = tmp_path / "set" / f"{name}.pt"
    dst.parent.mkdir(exist_ok=True)
    return write_zip(dst, members or _members(base), fields)


def _record(tmp_path: Path, short: str) -> bytes:
    return dict(_members(_base(tmp_path)))[f"base/{short}"]


# --------------------------------------------------------------------------- verdicts
def _torch_verdict(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except RuntimeError as e:
        return f"refused: {str(e).splitlines()[0]}"


def _our_verdict(path: Path):
    try:
        return mo.load_state_dict(path)
    except CheckpointLayoutError as e:
        return f"refused: {e}"


def assert_same_verdict(path: Path) -> str:
    """torch.load and load_state_dict both refuse, or both give the same tensors."""
    theirs, ours = _torch_verdict(path), _our_verdict(path)
    if isinstance(theirs, str) or isinstance(ours, str):
        assert isinstance(theirs, str) and isinstance(ours, str), (theirs if isinstance(theirs, str) else "accepted",
                                                                   ours if isinstance(ours, str) else "accepted")
        assert path.name in ours, ours
        return ours
    assert sorted(theirs) == sorted(ours)
    for k in theirs:
        assert torch.equal(theirs[k], ours[k]), k
    return "accepted"


D0 = 256  # bytes of data/0
VARIANTS = {
    # sizes in the central directory that torch's reader (miniz) refuses when it opens the archive
    "stored-compressed-size-smaller": ({"data/0": {"cd_csize": D0 // 2}}, "refused"),
    # the record really holds 128 bytes: reading 256 would run into data/1's local header
    "stored-record-short-reads-into-the-next": (
        {"data/0": {"raw": "half", "csize": D0 // 2, "usize": D0}}, "refused"),
    "stored-size-larger": ({"data/0": {"cd_usize": 2 * D0}}, "refused"),
    "stored-compressed-size-zero": ({"data/0": {"cd_csize": 0}}, "refused"),
    "zip64-stored-record-short": ({"data/0": {"zip64": True, "raw": "half", "csize": D0 // 2, "usize": D0}},
                                  "refused"),
    "zip64-stored-size-larger": ({"data/0": {"zip64": True, "cd_usize": 2 * D0}}, "refused"),
    "pickle-compressed-size-smaller": ({"data.pkl": {"cd_csize": 100}}, "refused"),
    # a record of the size the directory says, shorter than its storage: torch.load refuses
    # it when it reads it ('record size ... does not match expected size')
    "stored-record-shorter-than-its-storage": ({"data/0": {"raw": "half", "csize": D0 // 2, "usize": D0 // 2}},
                                               "refused"),
    # the local header's sizes: torch (and every zip reader) takes the central directory's
    "local-sizes-smaller": ({"data/0": {"lh_csize": 1, "lh_usize": 1}}, "accepted"),
    "local-sizes-larger": ({"data/0": {"lh_csize": 1 << 20, "lh_usize": 1 << 20}}, "accepted"),
    "zip64-consistent": ({"data/0": {"zip64": True}}, "accepted"),
    "deflated": ({"data/0": {"method": 8}, "data/1": {"method": 8}}, "accepted"),
    "deflated-size-larger": ({"data/0": {"method": 8, "cd_usize": 2 * D0}}, "refused"),
    "deflated-size-smaller": ({"data/0": {"method": 8, "cd_usize": D0 // 2}}, "refused"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_record_whose_sizes_disagree_gets_torchs_verdict(variant, tmp_path):
    fields, expected = VARIANTS[variant]
    half = _record(tmp_path, "data/0")[: D0 // 2]
    fields = {k: {f: (half if v == "half" else v) for f, v in fx.items()} for k, fx in fields.items()}
    path = _rewrite(tmp_path, variant, fields)
    verdict = assert_same_verdict(path)
    assert verdict.startswith(expected), verdict
    if expected == "refused" and "directory entry gives" in verdict:
        # refused where torch's reader refuses the archive: when it is opened, so at inspect too
        with pytest.raises(CheckpointLayoutError, match="torch.load refuses the archive too"):
            mo.inspect(path)


def test_a_stored_record_shorter_than_its_directory_size_is_never_read_through(tmp_path):
    """The read the old code did: 256 bytes from data/0's start, half of them data/1's local
    header and data; torch refuses the archive, and so does every entry point here."""
    half = _record(tmp_path, "data/0")[: D0 // 2]
    path = _rewrite(tmp_path, "short", {"data/0": {"raw": half, "csize": D0 // 2, "usize": D0}})
    with pytest.raises(RuntimeError, match="invalid header or archive is corrupted"):
        torch.load(path, weights_only=True)
    for call in (lambda: read_header(str(path)), lambda: mo.inspect(path), lambda: mo.load_state_dict(path)):
        with pytest.raises(CheckpointLayoutError, match=r"record base/data/0 is stored uncompressed, yet its "
                                                        r"directory entry gives 128 bytes in the file and 256"):
            call()


# --------------------------------------------------------------------------- deflate
def _peak_rss(call: str, path: Path) -> dict:
    """Run ``call`` (an expression over ``mo`` and ``path``) in a fresh interpreter: its
    peak RSS growth in MiB, and the error it raised. (VmHWM, this process's own peak:
    ru_maxrss carries the parent's over fork and exec, so under a big pytest it reads +0;
    the modules a call uses are imported before the first measure.)"""
    code = textwrap.dedent(f"""
        import json, sys
        import torch
        import metaseq_oneload as mo
        import metaseq_oneload._reading, metaseq_oneload._loading, metaseq_oneload.formats
        def hwm():
            with open("/proc/self/status") as f:
                return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))
        path = sys.argv[1]
        before = hwm()
        error = None
        try:
            {call}
        except Exception as e:
            error = f"{{type(e).__name__}}: {{e}}"
        peak = hwm()
        print(json.dumps({{"rss_mib": (peak - before) / 1024, "error": error}}))
    """)
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_pickle_record_that_inflates_to_1_gib_is_refused_in_bounded_memory(tmp_path):
    """A 1 MB file whose data.pkl declares its 238 bytes but whose stream runs on to 1 GiB.
    Before: the whole stream was inflated, then its size compared (peak RSS +2049 MiB, 21 s).
    Now: inflating stops one byte past the declared size."""
    pkl = _record(tmp_path, "data.pkl")
    path = _rewrite(tmp_path, "bomb", {"data.pkl": {"method": 8, "raw": _deflate(pkl, 1 << 30), "usize": len(pkl)}})
    assert path.stat().st_size < 2 << 20
    for call in ("mo.inspect(path)", "mo.load_state_dict(path)"):
        got = _peak_rss(call, path)
        assert got["rss_mib"] < 128, got
        assert got["error"] and got["error"].startswith("CheckpointLayoutError"), got
        assert f"record base/data.pkl inflates to more than the {len(pkl)} bytes" in got["error"], got


def test_a_pickle_record_that_honestly_declares_1_gib_is_refused_before_it_is_inflated(tmp_path):
    """A 1 MB file whose data.pkl is a valid pickle and 1 GiB of zeros after its STOP, and
    says so in its directory entry (1032:1 is within what deflate can do). Before: accepted,
    inflated whole and then joined into a second copy (read_header: OK after 3.4 s, peak RSS
    +2293 MiB). A pickle is at most tens of MB: refused past max(64 MiB, 64 x its
    compressed size), before anything is inflated."""
    pkl = _record(tmp_path, "data.pkl")
    raw = _deflate(pkl, 1 << 30)
    path = _rewrite(tmp_path, "honest-bomb", {"data.pkl": {"method": 8, "raw": raw, "usize": len(pkl) + (1 << 30)}})
    assert path.stat().st_size < 2 << 20
    for call in ("mo.inspect(path)", "mo.load_state_dict(path)",
                 "__import__('metaseq_oneload._reading')._reading.read_header(path)"):
        got = _peak_rss(call, path)
        print(f"\n{call}: +{got['rss_mib']:.0f} MiB: {got['error']}")
        assert got["rss_mib"] < 128, got
        assert got["error"] and got["error"].startswith("CheckpointLayoutError"), got
        assert (f"record base/data.pkl declares {len(pkl) + (1 << 30)} bytes once inflated, from {len(raw)} "
                "compressed bytes") in got["error"], got


def test_a_deflated_pickle_record_below_the_cap_is_inflated_once(tmp_path):
    """A deflated data.pkl of a real size loads as torch.load gives it, and inflating it
    costs about its size once (no second copy by a join)."""
    members = _members(_base(tmp_path))
    pad = 48 << 20  # a 48 MiB pickle (random bytes after STOP: they deflate ~1:1)
    members = [(n, d + torch.randint(0, 256, (pad,), dtype=torch.uint8).numpy().tobytes()
                if n.endswith("data.pkl") else d) for n, d in members]
    path = _rewrite(tmp_path, "big-pickle", {"data.pkl": {"method": 8}}, members)
    assert assert_same_verdict(path) == "accepted"
    got = _peak_rss("__import__('metaseq_oneload._reading')._reading.read_header(path)", path)
    print(f"\nread_header of a 48 MiB deflated pickle: +{got['rss_mib']:.0f} MiB")
    assert got["error"] is None, got
    assert got["rss_mib"] < 48 + 32, got  # before: +96 (the pieces, then their join)


def test_a_record_declaring_more_than_deflate_can_produce_is_refused_at_inspect(tmp_path):
    """data/0 declares 1 GiB (and the pickle a storage of 1 GiB, so the sizes agree) from a
    stream of a hundred bytes: torch's reader would allocate the GiB, then fail. Before:
    inspect accepted it."""
    pkl = _record(tmp_path, "data.pkl")
    ops = list(pickletools.genops(pkl))
    i = next(j for j, (op, _, _) in enumerate(ops) if op.name == "BINPERSID")
    while ops[i][0].name != "TUPLE":
        i -= 1
    enc = pickle.encode_long((1 << 30) // 4)
    pkl = pkl[:ops[i - 1][2]] + b"\x8a" + bytes([len(enc)]) + enc + pkl[ops[i][2]:]
    members = [(n, pkl if n.endswith("data.pkl") else d) for n, d in _members(_base(tmp_path))]
    path = _rewrite(tmp_path, "declares", {"data/0": {"method": 8, "usize": 1 << 30}}, members)
    for call in (lambda: mo.inspect(path), lambda: mo.load_state_dict(path)):
        with pytest.raises(CheckpointLayoutError, match=r"record base/data/0 claims to inflate to 1073741824 "
                                                        r"bytes from \d+ compressed bytes, more than deflate"):
            call()


def test_a_storage_stream_that_ends_before_its_size_is_refused_not_read_as_garbage(tmp_path):
    """data/0's directory entry keeps 10 of its compressed bytes: torch's reader inflates
    what it can into a 256-byte buffer and returns it unfilled, without an error (its result
    is whatever memory held). Before: load_state_dict returned such bytes."""
    path = _rewrite(tmp_path, "early", {"data/0": {"method": 8, "cd_csize": 10}})
    with pytest.raises(CheckpointLayoutError, match=r"record base/data/0's compressed stream ends after \d+ of "
                                                    r"its 256 bytes"):
        mo.load_state_dict(path)


def test_a_storage_stream_that_runs_past_its_size_is_refused(tmp_path):
    """data/0 declares its 256 bytes; its stream goes on for 1 GiB more. torch's reader stops
    at the buffer's end and says nothing; a record that holds more than its entry says is
    damaged, and is refused, in bounded memory."""
    path = _rewrite(tmp_path, "runs-on", {"data/0": {"method": 8, "raw": _deflate(_record(tmp_path, "data/0"),
                                                                                 1 << 30)}})
    got = _peak_rss("mo.load_state_dict(path)", path)
    assert got["error"] and "record base/data/0 inflates to more than the 256 bytes" in got["error"], got
    assert got["rss_mib"] < 128, got


# --------------------------------------------------------------------------- declared sizes
def test_an_expanded_stride_0_tensor_is_refused_before_anything_is_allocated(tmp_path):
    """torch.zeros(4).expand(2**26, 4): 16 bytes stored, 1 GiB of elements. torch.load
    returns a view of the 16 bytes; before, load_state_dict allocated the whole tensor, and a
    copy of it (2**30 elements: +4104 MiB; 2-D 2**28 x 4: +8200 MiB)."""
    path = tmp_path / "expanded.pt"
    torch.save({"w": torch.arange(4.0).reshape(1, 4).expand(1 << 26, 4), "b": torch.ones(3)}, path)
    view = torch.load(path, weights_only=True)["w"]
    assert view.untyped_storage().nbytes() == 16 and view.stride() == (0, 1)
    pattern = (r"tensor w: shape \(67108864, 4\) stride \(0, 1\) is an expanded view whose 268435456 float32 "
               r"elements \(1073741824 bytes\) repeat the 16 bytes its record holds")
    with pytest.raises(CheckpointLayoutError, match=pattern):
        mo.inspect(path)
    got = _peak_rss("mo.load_state_dict(path)", path)
    assert got["error"] and got["error"].startswith("CheckpointLayoutError") and "expanded view" in got["error"], got
    assert got["rss_mib"] < 128, got


def test_an_expanded_view_that_needs_no_more_than_its_storage_still_loads(tmp_path):
    """What Hugging Face models save as position_ids: arange(n).expand(1, -1), stride 0 on a
    dimension of size 1: its elements are its storage's, and it loads as torch.load gives it."""
    path = tmp_path / "position_ids.pt"
    torch.save({"position_ids": torch.arange(16).expand((1, -1)), "w": torch.ones(2, 2)}, path)
    assert assert_same_verdict(path) == "accepted"


@pytest.mark.parametrize("name,tensor", [
    ("ones-1-expanded-to-4", lambda: torch.ones(1).expand(4)),
    ("bias-broadcast-2x4", lambda: torch.zeros(4).expand(2, 4)),
    ("row-repeated-1000x", lambda: torch.arange(64.0).reshape(1, 64).expand(1000, 64)),
])
def test_a_small_expanded_view_loads_as_torch_load_gives_it(name, tensor, tmp_path):
    """Expanded views whose elements need more bytes than their record holds, but little:
    torch.load gives each as a view of its storage. Before: refused at inspect ('is an
    expanded view'), whatever its size. Now refused only past max(64 MiB, 16 x the file's
    size); below it every entry point gives torch.load's values (a contiguous copy)."""
    path = tmp_path / f"{name}.pt"
    torch.save({"w": torch.randn(8, 4), "x": tensor()}, path)
    theirs = torch.load(path, weights_only=True)
    assert theirs["x"].untyped_storage().nbytes() < theirs["x"].numel() * theirs["x"].element_size()
    layout = mo.inspect(path)
    assert tuple(layout.parts[0].tensors["x"].shape) == tuple(theirs["x"].shape)
    assert assert_same_verdict(path) == "accepted"
    ours = mo.load_state_dict(path)
    assert ours["x"].dtype == theirs["x"].dtype and ours["x"].shape == theirs["x"].shape
    assert ours["x"].contiguous().numpy().tobytes() == theirs["x"].contiguous().numpy().tobytes()


def test_expanded_views_share_one_budget_per_file(tmp_path):
    """Three views of 32 MiB each (4 bytes stored apiece), in a file of a few KB: each is
    under 64 MiB, together they are 96 MiB of allocation: refused at the third."""
    path = tmp_path / "three.pt"
    torch.save({f"x{i}": torch.ones(1).expand(8 << 20) for i in range(3)}, path)
    with pytest.raises(CheckpointLayoutError, match=r"tensor x2: .* is an expanded view .* past the 67108864 bytes "
                                                    r"the expanded views of one file may take .*; 67108864 taken by "
                                                    r"the ones before it"):
        mo.inspect(path)


def test_a_storage_less_meta_tensor_of_10_to_the_12_elements_is_refused_at_inspect(tmp_path):
    """torch.save of a meta tensor writes no record (_rebuild_meta_tensor_no_storage).
    Before: inspect accepted it and load_state_dict died in the allocator ('you tried to
    allocate 4000000000000 bytes')."""
    path = tmp_path / "meta.pt"
    torch.save({"w": torch.empty(10 ** 12, device="meta"), "b": torch.ones(3)}, path)
    assert torch.load(path, weights_only=True)["w"].device.type == "meta"
    pattern = (r"meta\.pt: tensor w: saved without data \(a meta tensor: shape \(1000000000000,\), 1000000000000 "
               r"float32 elements, 4000000000000 bytes, and no record in the file\)")
    with pytest.raises(CheckpointLayoutError, match=pattern):
        mo.inspect(path)
    got = _peak_rss("mo.load_state_dict(path)", path)
    assert got["error"] and got["error"].startswith("CheckpointLayoutError") and "saved without data" in got["error"]
    assert got["rss_mib"] < 128, got


def test_a_meta_tensor_outside_the_model_leaves_its_tensors_readable_in_place(tmp_path):
    """A storage-less tensor beside the model (here in extra_state) is not the model's: the
    model's tensors keep their verified offsets and load as torch.load gives them."""
    path = tmp_path / "extra.pt"
    torch.save({"model": {"w": torch.arange(6.0).reshape(2, 3)},
                "extra_state": {"probe": torch.empty(10 ** 12, device="meta")}}, path)
    assert storage_byte_offset(read_header(str(path))["model"]["w"]) is not None
    sd = mo.load_state_dict(path)
    assert torch.equal(sd["w"], torch.arange(6.0).reshape(2, 3))
