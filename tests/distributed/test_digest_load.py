"""Issue 24: ``verify="digest"`` on real gloo ranks. Every strategy that splits a load's reads
between ranks (flat shards cut tensors at offsets that are no leaf boundary; broadcast,
scatter, the read-once exchange; model-parallel parts merged or split) combines each stored
tensor's leaves into the recorded digest, and a bit flipped in a converted output after
convert recorded its digests raises :class:`DigestError` on every rank, naming the tensors
and their files. One process group of 4 ranks serves every case (the default group, then a 2 x 2 grid)."""

from __future__ import annotations

import os

import pytest
import torch

import metaseq_oneload as mo
from bench._synth import materialize, metaseq_lm, write_metaseq
from tests.distributed.harness import run_ranks
from tests.distributed.workers import make_groups

EMBED = "decoder.embed_tokens.weight"
FC2 = "decoder.layers.1.fc2.weight"


def _model():
    return metaseq_lm(layers=2, dim=128, ffn=512, vocab=6002, positions=62)


def _outcome(fn) -> list:
    """[error type or "ok", message or digests checked]."""
    try:
        return ["ok", fn()]
    except mo.OneloadError as e:
        return [type(e).__name__, str(e)]


def _flat_equal(a, b) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def one_group(good: str, bad: str, good_mp2: str, bad_mp2: str) -> list:
    """(collective over the default group) The cases of a load onto one data-parallel group."""
    full = materialize(_model())
    out = []
    for strategy in ("auto", "broadcast", "parallel", "reshard"):
        def clean():
            got = mo.load_checkpoint(good, strategy=strategy, verify="digest")
            assert all(torch.equal(got.model[k], v) for k, v in full.items()), strategy
            return got.report.digests_checked
        out.append([f"unflat {strategy}", _outcome(clean),
                    _outcome(lambda: mo.load_state_dict(bad, strategy=strategy, verify="digest"))])
    for strategy in ("auto", "broadcast", "parallel"):  # reshard, scatter, exchange of flat shards
        def clean_flat():
            got = mo.load_checkpoint(good, strategy=strategy, flat=True, verify="digest")
            assert _flat_equal(got.model, mo.load_state_dict(good, strategy=strategy, flat=True)), strategy
            return got.report.digests_checked
        out.append([f"flat {strategy}", _outcome(clean_flat),
                    _outcome(lambda: mo.load_state_dict(bad, strategy=strategy, flat=True, verify="digest"))])

    def merged():  # two saved model-parallel parts merged on every rank
        got = mo.load_checkpoint(good_mp2, verify="digest")
        assert all(torch.equal(got.model[k], v) for k, v in full.items())
        return got.report.digests_checked
    out.append(["mp2 merged", _outcome(merged), _outcome(lambda: mo.load_state_dict(bad_mp2, verify="digest"))])
    # the attack is real on these ranks too: a plain load takes the flipped bytes
    plain = mo.load_state_dict(bad)
    out.append(["plain takes the flip", [not torch.equal(plain[n], full[n]) for n in (EMBED, FC2)]])
    return out


def grid2x2(rank: int, world: int, good: str, bad: str, good_mp2: str, bad_mp2: str) -> list:
    """(collective over a 2 x 2 grid) Model-parallel parts split and kept."""
    dp, mpg, _, _, _ = make_groups(rank, world, 2)
    out = []
    for label, g, b in (("mp1 split onto 2 parts", good, bad), ("mp2 own parts", good_mp2, bad_mp2)):
        for strategy in ("auto", "broadcast"):
            def clean():
                got = mo.load_checkpoint(g, process_group=dp, model_parallel_group=mpg, strategy=strategy,
                                         verify="digest")
                plain = mo.load_state_dict(g, process_group=dp, model_parallel_group=mpg, strategy=strategy)
                assert _flat_equal(got.model, plain)
                return got.report.digests_checked
            out.append([f"{label} {strategy}", _outcome(clean),
                        _outcome(lambda: mo.load_state_dict(b, process_group=dp, model_parallel_group=mpg,
                                                            strategy=strategy, verify="digest"))])
    return out


def _flip(first: str, name: str, at: float, part: int = 0) -> str:
    from tests.unit.test_digest_load import flip_bit

    return os.path.basename(flip_bit(first, name, at=at, part=part)[0])


@pytest.fixture
def sets(tmp_path, monkeypatch):
    """Converted sets (MP 1 x 2 flat shards; MP 2 unflattened) and copies with bits flipped."""
    import shutil

    monkeypatch.setenv("METASEQ_ONELOAD_INDEX_KEY", str(tmp_path / "keys" / "index-key"))
    os.makedirs(tmp_path / "src")
    write_metaseq(str(tmp_path / "src" / "src"), _model(), shards=3)
    src = str(tmp_path / "src" / "src-model_part-0-shard0.pt")
    mo.convert(src, tmp_path / "a" / "ck", shards=2, progress=False)
    mo.convert(src, tmp_path / "b" / "ck", model_parallel=2, shards=1, progress=False)
    shutil.copytree(tmp_path / "a", tmp_path / "a_bad")
    shutil.copytree(tmp_path / "b", tmp_path / "b_bad")
    a_bad = str(tmp_path / "a_bad" / "ck-model_part-0-shard0.pt")
    b_bad = str(tmp_path / "b_bad" / "ck-model_part-0.pt")
    files = {EMBED: _flip(a_bad, EMBED, 0.55), FC2: _flip(a_bad, FC2, 0.3)}
    mp2_file = _flip(b_bad, FC2, 0.7, part=1)
    return (str(tmp_path / "a" / "ck-model_part-0-shard0.pt"), a_bad, str(tmp_path / "b" / "ck-model_part-0.pt"),
            b_bad), files, mp2_file


def _assert_caught(rows, files, mp2_file):
    for row in rows:
        label, clean, flipped = row
        assert clean[0] == "ok" and clean[1] > 0, row
        assert flipped[0] == "DigestError", row
        if label.startswith("mp2"):
            assert f"{FC2} (model part 1)" in flipped[1] and mp2_file in flipped[1], row
        else:
            for name, f in files.items():
                if name in flipped[1]:
                    assert f in flipped[1], row
            assert EMBED in flipped[1] or FC2 in flipped[1], row
        assert "its bytes hash to" in flipped[1] and "copy the set again" in flipped[1], row


def routed(rank: int, world: int, good: str, *_) -> list:
    """(collective over the default group) exchange_bytes between the 4 ranks, then a flat
    load's digest check: which tensors' leaves reached this rank, and which it checked."""
    from metaseq_oneload import _digest_check
    from metaseq_oneload._dist import Group

    group = Group(torch.distributed.group.WORLD)
    sent = [b"" if d == rank else f"{rank}>{d};".encode() * (1 + rank + d) for d in range(world)]
    received = group.exchange_bytes(sent)
    decoded, real = [], _digest_check._decode

    def spy(blob, keep, tensors):
        got, seen = real(blob, keep, tensors)
        decoded.append([sorted(seen), sorted(got)])
        return got, seen

    _digest_check._decode = spy
    try:
        checked = mo.load_checkpoint(good, flat=True, verify="digest").report.digests_checked
    finally:
        _digest_check._decode = real
    return [[r.decode() for r in received], checked, decoded]


def both(rank: int, world: int, *paths) -> list:
    return [one_group(*paths), grid2x2(rank, world, *paths), routed(rank, world, *paths)]


def test_digest_checked_loads_on_4_ranks(sets, tmp_path):
    paths, files, mp2_file = sets
    results = run_ranks(4, both, *paths, tmp_path=tmp_path, timeout=240)
    # each rank got from every other exactly what that one addressed to it, and nothing from itself
    for rank, (_, _, (received, _, _)) in enumerate(results):
        assert received == ["" if s == rank else f"{s}>{rank};" * (1 + s + rank) for s in range(4)], received
    # a flat load's check: each stored tensor's leaves reach only the rank that checks it (they
    # went to every rank before: 35 MB each for 2 GiB on 4 ranks), and every tensor is checked once
    checked_by = [t for _, _, (_, _, decoded) in results for seen, got in decoded for t in got]
    for _, _, (_, checked, decoded) in results:
        assert [seen for seen, _ in decoded] == [got for _, got in decoded], decoded
        assert checked == len(checked_by) == len(set(checked_by)) > 0
    for rows, grid, _ in results:
        assert rows[-1] == ["plain takes the flip", [True, True]]
        _assert_caught(rows[:-1], files, mp2_file)
        _assert_caught(grid, files, mp2_file)
        # every rank tells the same story
        assert [r[0] for r in rows + grid] == [r[0] for r in results[0][0] + results[0][1]]
    # a load onto one data-parallel group reads every stored tensor: both flips are named
    for row in results[0][0]:
        if row[0].startswith(("unflat", "flat")):
            assert EMBED in row[2][1] and FC2 in row[2][1], row
