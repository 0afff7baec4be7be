"""Checkpoints are pickles: refuse anything outside the allowlist, run nothing."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch

import metaseq_oneload as mo
from metaseq_oneload import UnsafeCheckpointError


class _Payload:
    """Unpickling this runs a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def evil_checkpoint(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "checkpoint_evil.pt"
    torch.save({"model": {"w": torch.zeros(3)}, "cfg": {"common": {}}, "extra_state": _Payload(marker)}, path)
    return path, marker


def test_code_in_the_pickle_is_refused_and_never_runs(tmp_path):
    path, marker = evil_checkpoint(tmp_path)
    with pytest.raises(UnsafeCheckpointError, match=r"refused to unpickle: the file needs (posix|os)\.system.*trust_pickle=True"):
        mo.inspect(path)
    with pytest.raises(UnsafeCheckpointError):
        mo.load_state_dict(path)
    assert not marker.exists()


def test_cli_refuses_without_traceback(tmp_path):
    path, marker = evil_checkpoint(tmp_path)
    r = subprocess.run([sys.executable, "-m", "metaseq_oneload", "inspect", str(path)],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "refused to unpickle" in r.stderr and "--trust-pickle" in r.stderr
    assert "Traceback" not in r.stderr
    assert not marker.exists()


def test_trust_pickle_is_the_explicit_opt_in(tmp_path):
    path, marker = evil_checkpoint(tmp_path)
    layout = mo.inspect(path, trust_pickle=True)
    assert marker.exists()  # it ran: that is what the flag is documented to allow
    assert layout.kind == "singleton"


def test_the_allowlist_covers_what_checkpoints_carry(tmp_path):
    from omegaconf import OmegaConf
    import numpy as np

    path = tmp_path / "checkpoint_ok.pt"
    torch.save({
        "model": {"decoder.fc1.weight": torch.ones(2, 2)},
        "args": argparse.Namespace(arch="x", model_parallel_size=1),
        "cfg": OmegaConf.create({"common": {"model_parallel_size": 1}, "checkpoint": {"checkpoint_shard_count": 1}}),
        "extra_state": {"best": np.float64(1.5), "arr": np.arange(3)},
    }, path)
    layout = mo.inspect(path)
    assert layout.cfg.model_parallel_size == 1 and layout.flavor == "fairseq"


def test_allowlisting_does_not_leak_or_clobber_the_process_allowlist(tmp_path):
    class Mine:
        pass

    torch.serialization.add_safe_globals([Mine])
    try:
        path = tmp_path / "x.pt"
        torch.save({"model": {"w": torch.zeros(1)}, "args": argparse.Namespace(a=1)}, path)
        mo.inspect(path)
        allowed = torch.serialization.get_safe_globals()
        assert Mine in allowed and argparse.Namespace not in allowed
    finally:
        torch.serialization.clear_safe_globals()
