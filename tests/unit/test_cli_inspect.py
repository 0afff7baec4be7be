"""`metaseq-oneload inspect`: readable table, --json, clean errors."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points


from metaseq_oneload.cli import main
from tests.conftest import FIXTURES, needs_fixtures


def test_console_script_is_declared():
    eps = entry_points(group="console_scripts")
    assert any(ep.name == "metaseq-oneload" and ep.value == "metaseq_oneload.cli:main" for ep in eps)


@needs_fixtures
def test_table(capsys):
    assert main(["inspect", str(FIXTURES / "mp2_dp2" / "checkpoint_last.pt")]) == 0
    out = capsys.readouterr().out
    for line in ("kind              fsdp_sharded", "model parallel    2", "shards per part   2",
                 "saved world size  4", "params            21,548", "[1][1]  checkpoint_2-model_part-1-shard1.pt"):
        assert line in out


@needs_fixtures
def test_json(capsys):
    assert main(["inspect", str(FIXTURES / "singleton"), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["kind"] == "singleton" and d["files"] == [[str(FIXTURES / "singleton" / "checkpoint_2_consolidated.pt")]]
    assert d["notes"] and d["warnings"] == [] and d["num_params"] == 21548


def test_error_exit_code_and_no_traceback(tmp_path):
    # Both side by side: each is a fresh interpreter importing torch, most of this test's time.
    plain, debug = (subprocess.Popen([sys.executable, "-m", "metaseq_oneload", "inspect", str(tmp_path), *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    for extra in ([], ["--debug"]))
    _, err = plain.communicate()
    assert plain.returncode == 2
    assert err.startswith("metaseq-oneload inspect: error: ") and "holds no *.pt files" in err
    assert "Traceback" not in err
    _, err = debug.communicate()
    assert debug.returncode != 0 and "Traceback" in err
