"""Settings are agreed, not sensed (#22, item 5), on 2 real gloo ranks: ranks whose
environments differ in a setting that decides which collectives a rank enters
(``METASEQ_ONELOAD_SHM``, ``METASEQ_ONELOAD_SHM_DIR``) all raise an OptionError naming the
variable and the ranks on each side, within seconds (not a collective's timeout), before
any file of the checkpoint is opened; ranks that agree load as before."""

from __future__ import annotations

import re

from tests.conftest import FIXTURES, needs_fixtures
from tests.distributed.harness import run_ranks

pytestmark = needs_fixtures


def _loads_with_settings(rank, world, scenarios, folder):
    """(every rank) For each scenario (variable -> one value per rank), set this rank's
    environment, load ``folder`` collectively, and say what happened and what was opened."""
    import builtins
    import os
    import time

    import torch.distributed as dist

    import metaseq_oneload as mo
    from metaseq_oneload import OptionError

    opened = []
    real_os_open, real_open = os.open, builtins.open

    def spy_os_open(path, *a, **k):
        if str(path).startswith(folder):
            opened.append(str(path))
        return real_os_open(path, *a, **k)

    def spy_open(file, *a, **k):
        if isinstance(file, (str, os.PathLike)) and os.fspath(file).startswith(folder):
            opened.append(os.fspath(file))
        return real_open(file, *a, **k)

    out = []
    for scenario in scenarios:
        saved = {v: os.environ.get(v) for v in scenario}
        for var, values in scenario.items():
            os.environ[var] = values[rank]
        del opened[:]
        dist.barrier()
        os.open, builtins.open = spy_os_open, spy_open
        t0 = time.monotonic()
        try:
            sd = mo.load_state_dict(folder)
            row = {"raised": None, "tensors": len(sd)}
        except Exception as e:  # noqa: BLE001 - what every rank raised is the result
            row = {"raised": type(e).__name__, "option_error": isinstance(e, OptionError), "message": str(e)}
        finally:
            os.open, builtins.open = real_os_open, real_open
        row["seconds"] = time.monotonic() - t0
        row["opened"] = sorted(set(opened))
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        out.append(row)
    return out


def test_ranks_whose_shared_memory_settings_differ_stop_before_reading(tmp_path):
    other_dir = str(tmp_path / "shm")
    scenarios = [
        {"METASEQ_ONELOAD_SHM": ["1", "0"]},
        {"METASEQ_ONELOAD_SHM_DIR": ["/dev/shm", other_dir]},
        {"METASEQ_ONELOAD_SHM": ["0", "0"], "METASEQ_ONELOAD_SHM_DIR": [other_dir, other_dir]},  # agreed
    ]
    folder = str(FIXTURES / "fsdp_dp3")
    rows = run_ranks(2, _loads_with_settings, scenarios, folder, tmp_path=tmp_path, timeout=90)
    shm, shm_dir, agreed = zip(*rows)
    for rank, r in enumerate(shm):
        assert r["raised"] and r["option_error"], (rank, r)
        assert re.search(r"\$METASEQ_ONELOAD_SHM differs between the ranks of one load \(True on rank\(s\) 0; "
                         r"False on rank\(s\) 1\)", r["message"]), (rank, r["message"])
        assert r["seconds"] < 20, (rank, r["seconds"])  # told at once, not left to a timeout
        assert r["opened"] == [], (rank, r["opened"])  # nothing of the checkpoint was read
    for rank, r in enumerate(shm_dir):
        assert r["raised"] and r["option_error"], (rank, r)
        assert re.search(rf"\$METASEQ_ONELOAD_SHM_DIR differs between the ranks of one load \('/dev/shm' on "
                         rf"rank\(s\) 0; {re.escape(repr(other_dir))} on rank\(s\) 1\)", r["message"]), r["message"]
        assert r["seconds"] < 20 and r["opened"] == [], (rank, r)
    for rank, r in enumerate(agreed):
        assert r["raised"] is None and r["tensors"] > 0, (rank, r)
