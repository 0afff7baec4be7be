"""The fixed cost of a small load (issue 26, item 3), pinned by counts of things done, not by
times (bench/fixed_cost.py measures those): a single-process load of a small checkpoint
starts no thread, and a DCP folder's items are each parsed once, when the folder is described
(the reads take the spans that checked, not a parse of every item again per reading thread).
Each compares with torch's own reading of the same files."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import metaseq_oneload as mo
from metaseq_oneload import _dcp_items, _engine


def _weights() -> dict:
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.{k}": torch.rand(*shape, generator=g)
            for i in range(3) for k, shape in (("weight", (64, 128)), ("bias", (64,)), ("norm", (128,)))}


def _started_threads(monkeypatch) -> list:
    """The names of the threads started from here on (Thread.start counted, then run)."""
    names: list = []
    start = threading.Thread.start

    def counted(self, *a, **k):
        names.append(self.name)
        return start(self, *a, **k)

    monkeypatch.setattr(threading.Thread, "start", counted)
    return names


@pytest.fixture
def dcp_folder(tmp_path):
    import torch.distributed.checkpoint as dcp

    sd = _weights()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(sd, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    return tmp_path / "ck", sd


def test_a_small_single_process_load_starts_no_thread(tmp_path, monkeypatch):
    sd = _weights()
    torch.save(sd, tmp_path / "small.pt")
    assert sum(t.numel() * t.element_size() for t in sd.values()) < _engine.SERIAL_READ_BYTES
    monkeypatch.delenv("METASEQ_ONELOAD_READ_THREADS", raising=False)
    started = _started_threads(monkeypatch)
    got = mo.load_state_dict(tmp_path / "small.pt", no_dist=True)
    assert started == []
    # a thread count the user set is taken as it is, small loads included
    monkeypatch.setenv("METASEQ_ONELOAD_READ_THREADS", "4")
    again = mo.load_state_dict(tmp_path / "small.pt", no_dist=True)
    assert any(name.startswith("oneload-") for name in started)
    assert all(torch.equal(again[k], got[k]) for k in got)
    ref = torch.load(tmp_path / "small.pt", weights_only=True)
    assert list(got) == list(ref) and all(torch.equal(got[k], ref[k]) for k in ref)


def test_a_load_over_the_serial_size_still_reads_on_the_pool(tmp_path, monkeypatch):
    n = _engine.SERIAL_READ_BYTES // 4 + 1024  # fp32 elements: just over the serial size
    sd = {"big": torch.arange(n, dtype=torch.float32), "small": torch.ones(3)}
    torch.save(sd, tmp_path / "big.pt")
    monkeypatch.setenv("METASEQ_ONELOAD_READ_THREADS", "4")
    started = _started_threads(monkeypatch)
    got = mo.load_state_dict(tmp_path / "big.pt", no_dist=True)
    assert any(name.startswith("oneload-") for name in started), started
    assert torch.equal(got["big"], sd["big"]) and torch.equal(got["small"], sd["small"])


def test_each_dcp_item_is_parsed_once_per_load(dcp_folder, monkeypatch):
    """Describing the folder checks every item (its archive, its pickle); the reads that
    follow are checked against those spans, not by parsing the items again."""
    import torch.distributed.checkpoint as dcp

    folder, sd = dcp_folder
    parsed: list = []  # the item's archive, each time one is parsed
    pickles: list = []  # its pickle, each time one is read (by either reader)
    archive, header, plain = _dcp_items._archive, _dcp_items.header, _dcp_items._plain_tensor

    def counted_archive(key, offset, length, label):
        parsed.append(label)
        return archive.__wrapped__(key, offset, length, label)

    def counted_header(label, *a, **k):
        pickles.append(("general", label))
        return header(label, *a, **k)

    def counted_plain(data):
        got = plain(data)
        if got is not None:  # (else the general reader reads it, counted there)
            pickles.append(("plain", got[1]))
        return got

    monkeypatch.setattr(_dcp_items, "_archive", counted_archive)
    monkeypatch.setattr(_dcp_items, "header", counted_header)
    monkeypatch.setattr(_dcp_items, "_plain_tensor", counted_plain)
    monkeypatch.setenv("METASEQ_ONELOAD_READ_THREADS", "4")
    got = mo.load_state_dict(folder, no_dist=True)
    assert len(parsed) == len(sd) == len(set(parsed))
    assert len(pickles) == len(sd)
    # torch.save's pickle of one tensor, each of them: read without the general reader
    assert {how for how, _ in pickles} == {"plain"}
    ref = {k: torch.empty_like(v) for k, v in sd.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(ref, checkpoint_id=str(folder), no_dist=True)
    assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)


_FRESH = """
import sys, torch
import metaseq_oneload as mo
sd = mo.load_state_dict(sys.argv[1], no_dist=True)
ref = torch.load(sys.argv[1], weights_only=True)
assert sd.keys() == ref.keys() and all(torch.equal(sd[k], ref[k]) for k in ref)
print(" ".join(m for m in sys.argv[2:] if m in sys.modules))
"""
# What a plain load needs none of. omegaconf costs a fresh process 130-190 ms (more than a
# warm 256 MiB load); the package's own are a few ms each (Hydra's schema, the digest check's
# BLAKE3 and claims, the optimizer's readers, statistics' fractions and decimal): a frozen
# dataclass costs CPython 3.11 about 0.6 ms to create, and a script's first load pays each.
_NOT_FOR_A_PLAIN_LOAD = ("omegaconf", "yaml", "hydra", "statistics", "metaseq_oneload._hydra",
                         "metaseq_oneload._digest_check", "metaseq_oneload._optim_into")


def test_a_plain_load_in_a_fresh_process_does_not_import_what_it_does_not_use(tmp_path):
    """A checkpoint that holds no omegaconf object must not pay omegaconf's import, nor a
    plain load the modules of Hydra, digests and optimizers (``_NOT_FOR_A_PLAIN_LOAD``). One
    that does hold omegaconf objects still loads (tests/unit/test_trust_cfg.py, the fairseq
    and metaseq fixtures)."""
    import subprocess
    import sys

    path = tmp_path / "plain.pt"
    torch.save(_weights(), path)
    out = subprocess.run([sys.executable, "-c", _FRESH, str(path), *_NOT_FOR_A_PLAIN_LOAD], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "", f"a plain load imported {out.stdout.strip()}"
