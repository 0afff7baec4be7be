"""Issue 24: a load with ``verify="digest"`` checks every tensor it reads against the digest
recorded beside the set, in one process (the distributed cases: tests/distributed/
test_digest_load.py).

The attack each test makes real first: a bit flipped inside a tensor's bytes of a converted
output after convert recorded its digests is loaded as is by a plain load, and by
``verify=True`` (which compares the file with itself); only the digest check catches it."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil

import pytest
import torch

import metaseq_oneload as mo
from bench._synth import materialize, metaseq_lm, write_metaseq
from metaseq_oneload import _header, _zip
from metaseq_oneload._digest import LEAF, digest_tensor, tensor_bytes
from metaseq_oneload._digest_check import _HEAD, Hashing, Pieces, _decode, _encode, _records, check, stored_tensors
from metaseq_oneload._dist import Group
from metaseq_oneload._execute import read_stored
from metaseq_oneload._layout import StoredTensor
from metaseq_oneload._reading import RangeReader
from metaseq_oneload.formats import _index, discover
from tests.conftest import FIXTURES, needs_fixtures

EMBED = "decoder.embed_tokens.weight"


@pytest.fixture(autouse=True)
def _own_key(tmp_path, monkeypatch):
    """This user's index key in a folder of the test's own (never the real ~/.cache)."""
    monkeypatch.setenv("METASEQ_ONELOAD_INDEX_KEY", str(tmp_path / "keys" / "index-key"))


def synth_model():
    """A small metaseq decoder whose embedding spans 3 leaves (the last one short)."""
    return metaseq_lm(layers=2, dim=128, ffn=512, vocab=6002, positions=62)


def write_source(folder, shards: int = 3) -> str:
    """The synthetic model as metaseq flat shards (every tensor's bytes one run per shard)."""
    os.makedirs(folder, exist_ok=True)
    write_metaseq(os.path.join(folder, "src"), synth_model(), shards=shards)
    return os.path.join(folder, "src-model_part-0-shard0.pt")


def flip_bit(prefix_file: str, name: str, at: float = 0.5, part: int = 0) -> tuple:
    """Flip one bit inside stored tensor ``name``'s bytes (at fraction ``at`` of them) in the
    file that holds them; returns (file, byte offset in it)."""
    _header._cached_header.cache_clear()
    _zip.zip_index.cache_clear()
    layout = discover(prefix_file)
    t = layout.parts[part].tensors[name]
    size = torch.empty((), dtype=t.dtype).element_size()
    want = int(t.numel * at) * size
    pos = 0
    for e in t.extents:
        if pos <= want < pos + e.numel * size:
            where = e.byte_offset + want - pos
            with open(e.path, "r+b") as f:
                f.seek(where)
                b = f.read(1)
                f.seek(where)
                f.write(bytes([b[0] ^ 0x10]))
            _header._cached_header.cache_clear()
            _zip.zip_index.cache_clear()
            return e.path, where
        pos += e.numel * size
    raise AssertionError(f"{name}: byte {want} not found")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(source file, converted set's first file, its folder): convert recorded the digests."""
    root = tmp_path_factory.mktemp("digest_load")
    os.environ["METASEQ_ONELOAD_INDEX_KEY"] = str(root / "keys" / "index-key")
    try:
        src = write_source(root / "src")
        mo.convert(src, root / "out" / "ck", shards=2, progress=False)
    finally:
        os.environ.pop("METASEQ_ONELOAD_INDEX_KEY", None)
    return src, str(root / "out" / "ck-model_part-0-shard0.pt"), root / "out", root / "keys" / "index-key"


@pytest.fixture
def copy(converted, tmp_path, monkeypatch):
    """A copy of the converted set (its index still valid: same names, same bytes), with
    the key that signed it."""
    src, first, folder, key = converted
    monkeypatch.setenv("METASEQ_ONELOAD_INDEX_KEY", str(key))
    out = tmp_path / "copy"
    shutil.copytree(folder, out)
    return src, str(out / os.path.basename(first)), out


def test_the_index_records_every_stored_digest(copy):
    _, first, _ = copy
    layout = discover(first)
    assert layout.index is not None and len(layout.files[0]) == 2
    ts = stored_tensors(layout)
    assert ts and all(t.digest for t in ts)
    # and they are the digests of the bytes (the reference implementation, on torch's reading)
    full = materialize(synth_model())
    assert layout.parts[0].tensors[EMBED].digest == digest_tensor(EMBED, full[EMBED])


def test_a_clean_load_checks_every_tensor_it_reads(copy):
    src, first, _ = copy
    full = materialize(synth_model())
    loaded = mo.load_checkpoint(first, verify="digest")
    for k, v in full.items():
        assert torch.equal(loaded.model[k], v), k
    layout = discover(first)
    assert loaded.report.digests_checked == sum(1 for t in stored_tensors(layout) if t.nbytes)
    assert loaded.report.verified is False
    # read once: the check read nothing the plain load does not
    plain = mo.load_checkpoint(first)
    assert loaded.report.bytes_read == plain.report.bytes_read


def test_a_flipped_bit_is_loaded_by_plain_and_sum_loads_and_caught_by_the_digest(copy):
    src, first, _ = copy
    full = materialize(synth_model())
    path, where = flip_bit(first, EMBED, at=0.55)
    # the attack is real: a plain load returns the flipped weights...
    plain = mo.load_state_dict(first)
    assert not torch.equal(plain[EMBED], full[EMBED])
    assert all(torch.equal(plain[k], v) for k, v in full.items() if k != EMBED)
    # ...and verify=True compares the file with itself: it passes
    assert not torch.equal(mo.load_state_dict(first, verify=True)[EMBED], full[EMBED])
    with pytest.raises(mo.DigestError, match=rf"{EMBED} \(float32 \[6002, 128\]\): its bytes hash to "
                                             r"blake3:[0-9a-f]{64}, the index beside the set .* records blake3:") as e:
        mo.load_state_dict(first, verify="digest")
    msg = str(e.value)
    assert os.path.basename(path) in msg and "copy the set again" in msg
    # the byte ranges named hold the flipped byte
    spans = [tuple(map(int, s.split(".."))) for s in re.findall(r"bytes (\d+\.\.\d+)", msg)]
    assert any(a <= where < b for a, b in spans), (where, spans)


@pytest.mark.parametrize("flipped", [False, True])
def test_a_checked_load_reads_its_plain_tensors_as_one_list_of_runs_and_hashes_them(copy, monkeypatch, flipped):
    # a load hashing what it reads took the per-tensor path, 8 threads a tensor and a pool of
    # fills on top, where a plain one reads one list of runs in file order (1.7x warm at 2 GiB):
    # the runs now carry their extents to the hashing reader, and every byte is hashed once
    src, first, _ = copy
    full = materialize(synth_model())
    if flipped:
        flip_bit(first, EMBED, at=0.3)
    calls, real = [], RangeReader.read_runs

    def spy(self, runs, progress=None, sinks=None):
        calls.append((sum(out.numel() * out.element_size() for _, _, out in runs), sinks))
        return real(self, runs, progress, sinks)

    monkeypatch.setattr(RangeReader, "read_runs", spy)
    monkeypatch.setenv("METASEQ_ONELOAD_READ_THREADS", "4")  # a small set: read serially by default
    if flipped:
        with pytest.raises(mo.DigestError, match=rf"{EMBED} \(float32 \[6002, 128\]\): its bytes hash to"):
            mo.load_checkpoint(first, verify="digest")
        return
    plain = mo.load_checkpoint(first)
    calls_plain, calls[:] = list(calls), []
    loaded = mo.load_checkpoint(first, verify="digest")
    assert [n for n, _ in calls] == [n for n, _ in calls_plain] and sum(n for n, _ in calls) > 0, calls
    assert all(sinks is not None and all(s is not None for s in sinks) for _, sinks in calls)
    assert loaded.report.bytes_read == plain.report.bytes_read  # hashed as read: nothing read again
    assert loaded.report.digests_checked == sum(1 for t in stored_tensors(discover(first)) if t.nbytes)
    for k, v in full.items():
        assert torch.equal(loaded.model[k], v), k


def test_load_into_checks_too(copy):
    src, first, _ = copy
    flip_bit(first, "decoder.layers.1.fc2.weight", at=0.1)
    sd = mo.load_state_dict(first)
    module = torch.nn.Module()
    # a module that holds exactly the checkpoint's tensors, by name
    for name, t in sd.items():
        owner = module
        *path, leaf = name.split(".")
        for p in path:
            if not hasattr(owner, p):
                owner.add_module(p, torch.nn.Module())
            owner = getattr(owner, p)
        owner.register_buffer(leaf, torch.zeros_like(t))
    mo.load_into(module, first)  # the plain load takes the flipped bytes
    with pytest.raises(mo.DigestError, match=r"decoder\.layers\.1\.fc2\.weight .*its bytes hash to"):
        mo.load_into(module, first, verify="digest")


def test_an_edited_and_resigned_claim_is_caught(copy):
    src, first, folder = copy
    path = folder / "ck.oneload-index.json"
    d = json.loads(path.read_text())
    victim = "decoder.layers.0.fc1.weight"
    for t in d["parts"][0]["tensors"]:
        if t["name"] == victim:
            t["digest"] = digest_tensor(victim, torch.zeros(512, 128))
    d.pop("digest")
    d["digest"] = _index._digest(json.loads(json.dumps(d)))  # signed with this user's key
    path.write_text(json.dumps(d))
    _header._cached_header.cache_clear()
    assert discover(first).index is not None  # still accepted as a layout hint
    full = materialize(synth_model())
    assert torch.equal(mo.load_state_dict(first)[victim], full[victim])
    with pytest.raises(mo.DigestError, match=rf"{victim} .*records {digest_tensor(victim, torch.zeros(512, 128))}"):
        mo.load_state_dict(first, verify="digest")


def test_a_set_without_recorded_digests_is_refused_before_reading(tmp_path):
    src = write_source(tmp_path / "src")
    seen = []
    with pytest.raises(mo.DigestError, match=r"records no digest for any of its tensors, so its tensors cannot be "
                                             r"checked. Nothing was loaded. `metaseq-oneload convert` records"):
        mo.load_state_dict(src, verify="digest", progress=lambda done, total: seen.append(done))
    assert seen == []


@pytest.mark.parametrize("bad", ["sha256", "Digest", 2])
def test_verify_takes_false_true_or_digest(bad):
    with pytest.raises(mo.OptionError, match=r"expected False, True .* or \"digest\""):
        mo.load_state_dict("/nonexistent", verify=bad)


@needs_fixtures
def test_an_export_hf_folder_is_checked_against_its_safetensors_metadata(tmp_path):
    out = tmp_path / "hf"
    mo.export_hf(FIXTURES / "mp2_ddp", out, max_shard_size="30KB")
    got = mo.load_checkpoint(out, verify="digest")
    layout = discover(str(out))
    assert len(layout.all_files) > 1 and got.report.digests_checked == len(stored_tensors(layout))
    name = "model.decoder.layers.0.fc1.weight"
    path, _ = flip_bit(str(out), name, at=0.5)
    with pytest.raises(mo.DigestError, match=rf"{name} .*its bytes hash to .*the set's own metadata .*"
                                             rf"{os.path.basename(path)} bytes"):
        mo.load_state_dict(out, verify="digest")


# --------------------------------------------------------------------------- the pieces


def _stored(n_elem: int, dtype=torch.float16) -> tuple:
    t = torch.randn(n_elem).to(dtype)
    st = StoredTensor("w", 0, dtype, (n_elem,), ())  # (no extents: fed directly)
    return t, st


def test_pieces_from_several_holders_cut_off_leaf_combine_in_any_order():
    t, st = _stored(1_900_001)  # 3.6 MiB: 4 leaves, the last one short
    data = tensor_bytes(t)
    rng = random.Random(5)
    cuts = sorted(rng.sample(range(2, len(data), 2), 9))  # element boundaries, none on a leaf
    assert all(c % LEAF for c in cuts)
    ranges = list(zip([0] + cuts, cuts + [len(data)]))
    holders = [Pieces(st) for _ in range(3)]
    rng.shuffle(ranges)
    for k, (a, b) in enumerate(ranges):
        holders[k % 3].add_range(a, data[a:b])
    one = Pieces(st)  # one holder of every range joins fragments as they complete a leaf
    for a, b in ranges:
        one.add_range(a, data[a:b])
    assert not one.frags and sorted(one.leaves) == list(range(4))
    blob = b"".join(_encode({0: h}) for h in holders)
    got, seen = _decode(blob, lambda tid: True, [st])
    assert seen == {0}
    p = got[0]
    p.join()
    assert p.missing() == [] and not p.conflicts
    from metaseq_oneload._digest import tensor_digest

    assert tensor_digest("w", st.dtype, st.shape, p.leaves) == digest_tensor("w", t)


def test_a_record_cut_short_is_refused_by_a_rank_that_only_routes_or_counts_it():
    # A blob whose last record claims more than the blob holds: the rank that forwards it
    # (routing, records whole) and a rank that decodes nothing of it (keep refuses) must not
    # pass it on or count it as seen.
    t, st = _stored(1_200_000)
    p = Pieces(st)
    p.add_range(0, tensor_bytes(t))
    blob = _encode({0: p})
    for cut in (1, 20, len(blob) - _HEAD.size - 1):
        short = blob[:-cut]
        with pytest.raises(RuntimeError, match="runs past the end"):
            list(_records(short))
        with pytest.raises(RuntimeError, match="runs past the end"):
            _decode(short, lambda tid: False, [st])


def test_a_leaf_read_twice_that_differs_is_a_conflict_and_a_gap_is_missing():
    t, st = _stored(1_200_000)
    data = bytearray(tensor_bytes(t))
    p = Pieces(st)
    p.add_range(0, bytes(data[:LEAF + 10]))
    p.add_range(LEAF + 200, bytes(data[LEAF + 200: LEAF + 300]))
    data[5] ^= 1
    data[LEAF + 250] ^= 1
    p.add_range(0, bytes(data[:LEAF]))  # the same leaf read again (whole), differing
    p.add_range(LEAF + 200, bytes(data[LEAF + 200:]))  # and the same fragment bytes, differing
    p.join()
    assert p.conflicts == {0, 1}
    assert p.missing() == [(LEAF + 10, LEAF + 200)]


def test_the_checker_reads_what_no_rank_read(copy):
    """A stored tensor read only in part is completed by its checker: every leaf hashed once."""
    src, first, _ = copy
    layout = discover(first)
    with RangeReader() as reader:
        hashing = Hashing(reader, layout)
        t = layout.parts[0].tensors[EMBED]
        half = t.numel // 2 + 3
        read_stored(t, 0, torch.empty(half, dtype=t.dtype), hashing)
        before = reader.bytes_read
        error, checked = check(Group(None), Group(None), layout, hashing, [0], reader, first)
        assert error is None and checked == 1
        assert reader.bytes_read - before == t.nbytes - half * 4
    # and a claim that does not hold is still caught that way
    bad = dataclasses.replace(t, digest=digest_tensor(EMBED, torch.zeros(t.shape)))
    part = dataclasses.replace(layout.parts[0], tensors={**layout.parts[0].tensors, EMBED: bad})
    lay2 = dataclasses.replace(layout, parts=(part,))
    with RangeReader() as reader:
        hashing = Hashing(reader, lay2)
        read_stored(bad, 0, torch.empty(10, dtype=t.dtype), hashing)
        error, _ = check(Group(None), Group(None), lay2, hashing, [0], reader, first)
    assert isinstance(error, mo.DigestError) and EMBED in str(error)


class _Grid:
    """Ranks (d, m) of a dp x mp grid as threads of this process: each group's collectives
    (exchange_bytes, all_gather_json) meet at a barrier and swap through a shared dict, so
    that check's routing runs as on real ranks, in any grid."""

    def __init__(self, dp: int, mp: int):
        import threading

        self.box: dict = {}
        self.barriers = {("dp", m): threading.Barrier(dp) for m in range(mp)}
        self.barriers.update({("mp", d): threading.Barrier(mp) for d in range(dp)})

    def group(self, kind: str, d: int, m: int):
        grid = self

        class G:
            active, calls = True, 0
            key = (kind, m) if kind == "dp" else (kind, d)
            rank = d if kind == "dp" else m
            size = grid.barriers[key].parties

            def at(self, step):
                pass

            def _swap(self, value):
                self.calls += 1
                grid.box[(self.key, self.calls, self.rank)] = value
                grid.barriers[self.key].wait(timeout=30)
                out = [grid.box[(self.key, self.calls, r)] for r in range(self.size)]
                grid.barriers[self.key].wait(timeout=30)
                return out

            def exchange_bytes(self, payloads):
                sent = self._swap(list(payloads))
                return [sent[s][self.rank] for s in range(self.size)]

            def all_gather_json(self, obj):
                return self._swap(obj)

        return G()


def test_leaves_reach_their_checker_when_data_parallel_groups_see_the_files_differently(copy):
    # dp=2 x mp=2, rank (dp 1, mp 1) blind: model-parallel rank 1's group has one reader, rank
    # 0's two. Routed over dp first with the sender's readers, a record hashed on (0, 1) landed
    # on (0, 0), which does not check it (a good set refused), and one hashed on mp rank 0
    # landed on the blind rank, which checks nothing (a tensor counted and never checked)
    import threading

    _, first, _ = copy
    layout = discover(first)
    tensors = stored_tensors(layout)
    grid, results = _Grid(2, 2), {}

    def rank(d: int, m: int) -> None:
        blind = (d, m) == (1, 1)
        hashing = None
        if not blind:  # every rank that sees the files read every tensor (as the exchange's readers may)
            hashing = Hashing(RangeReader(read_threads=1), layout)
            for t in tensors:
                read_stored(t, 0, torch.empty(t.numel, dtype=t.dtype), hashing)
        readers = [0] if m == 1 else [0, 1]
        results[(d, m)] = check(grid.group("dp", d, m), grid.group("mp", d, m), None if blind else layout,
                                hashing, readers, RangeReader(read_threads=1), first)

    threads = [threading.Thread(target=rank, args=(d, m)) for d in range(2) for m in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 4, results
    n = sum(1 for t in tensors if t.nbytes)
    for where, (error, checked) in results.items():
        assert error is None and checked == n, (where, error, checked)
