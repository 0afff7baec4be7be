"""``metaseq-train +oneload=auto``: the command-line tokens, METASEQ_ONELOAD, and the real
start-up hook (metaseq_oneload.pth) run in fresh interpreters."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from metaseq_oneload import _hydra
from metaseq_oneload._import_hook import AfterImport
from metaseq_oneload._startup import strip_argv
from tests.conftest import REPO

PTH = (REPO / "metaseq_oneload.pth").read_text()


def test_split_argv():
    argv = ["data", "+oneload=broadcast", "--lr", "0.1", "oneload.bucket_mb=64", "++oneload.verify=true",
            "~oneload.path", "--oneload-like-flag", "notoneload.x=1"]
    kept, tokens = _hydra.split_argv(argv)
    assert kept == ["data", "--lr", "0.1", "--oneload-like-flag", "notoneload.x=1"]
    assert tokens == ["+oneload=broadcast", "oneload.bucket_mb=64", "++oneload.verify=true", "~oneload.path"]


def test_split_argv_takes_only_overrides():
    # A bare "oneload" (a --save-dir value) or a file "oneload.bin" is the program's argument.
    argv = ["--save-dir", "oneload", "--task", "dummy_lm", "oneload.bin", "+oneload=auto", "oneload",
            "~oneload.verify=true", "oneload.verify", "~oneloadx", "+oneload.bucket_mb=8"]
    kept, tokens = _hydra.split_argv(argv)
    assert kept == ["--save-dir", "oneload", "--task", "dummy_lm", "oneload.bin", "oneload", "oneload.verify",
                    "~oneloadx"]
    assert tokens == ["+oneload=auto", "~oneload.verify=true", "+oneload.bucket_mb=8"]
    argv = ["metaseq-train", "--save-dir", "oneload", "oneload.bin", "+oneload=auto"]
    assert strip_argv(argv) == ["+oneload=auto"] and argv == ["metaseq-train", "--save-dir", "oneload", "oneload.bin"]


def test_strip_argv_keeps_the_program_and_works_in_place():
    argv = ["metaseq-train", "+oneload=auto", "data"]
    alias = argv
    assert strip_argv(argv) == ["+oneload=auto"]
    assert alias == ["metaseq-train", "data"]


def test_explicit_settings():
    argv = ["--model-parallel-size", "2", "--use-sharded-state", "--ddp-backend=fully_sharded",
            "checkpoint.checkpoint_shard_count=1", "--model-parallel-sizes", "3"]
    assert _hydra.explicit_settings(argv) == {
        "common.model_parallel_size", "distributed_training.use_sharded_state", "distributed_training.ddp_backend",
        "checkpoint.checkpoint_shard_count"}


def test_explicit_settings_know_argparse_abbreviations():
    # argparse (allow_abbrev) takes a unique prefix: metaseq-train --model-parallel 1 sets the size.
    assert _hydra.explicit_settings(["--model-parallel", "1"]) == {"common.model_parallel_size"}
    assert _hydra.explicit_settings(["--ddp-b=fully_sharded", "--use-sharded", "--checkpoint-shard", "2"]) == {
        "distributed_training.ddp_backend", "distributed_training.use_sharded_state", "checkpoint.checkpoint_shard_count"}
    assert _hydra.explicit_settings(["--", "--model-parallel-size", "2"]) == set()  # after --: positional
    # With the parser's options: another option's exact name, or an ambiguous prefix, is not ours.
    options = ["--model-parallel-size", "--model-parallel", "--model-overrides", "--ddp-backend", "--ddp-bucket"]
    assert _hydra.explicit_settings(["--model-parallel", "1"], options=options) == set()
    assert _hydra.explicit_settings(["--ddp-b", "x"], options=options) == set()
    assert _hydra.explicit_settings(["--model-parallel-s", "1"], options=options) == {"common.model_parallel_size"}


@pytest.mark.parametrize("argv,env,expected", [
    (["data"], {}, None),
    (["oneload.strategy=reshard"], {}, None),  # a field without the group turns nothing on
    (["+oneload=auto"], {}, ["+oneload=auto"]),
    (["+oneload=auto", "oneload.verify=true"], {"METASEQ_ONELOAD": "broadcast"}, ["+oneload=auto", "oneload.verify=true"]),
    (["oneload.verify=true"], {"METASEQ_ONELOAD": "broadcast oneload.bucket_mb=8"},
     ["+oneload=broadcast", "oneload.bucket_mb=8", "oneload.verify=true"]),
    ([], {"METASEQ_ONELOAD": " "}, None),
    # switch-like values and bare overrides in the environment
    ([], {"METASEQ_ONELOAD": "1"}, ["+oneload=auto"]),
    ([], {"METASEQ_ONELOAD": "true"}, ["+oneload=auto"]),
    ([], {"METASEQ_ONELOAD": "0"}, ["+oneload=off"]),
    ([], {"METASEQ_ONELOAD": "oneload.verify=true"}, ["+oneload=auto", "oneload.verify=true"]),
    ([], {"METASEQ_ONELOAD": "+oneload=reshard oneload.verify=true"}, ["+oneload=reshard", "oneload.verify=true"]),
])
def test_activation_overrides(argv, env, expected):
    assert _hydra.activation_overrides(argv, env) == expected


def test_environment_value_round_trips():
    overrides = ["+oneload=broadcast", "oneload.path='/ckpt dir/checkpoint_last.pt'", "oneload.verify=true"]
    env = {"METASEQ_ONELOAD": _hydra.environment_value(overrides)}
    assert _hydra.activation_overrides([], env) == overrides


def run_with_pth(tmp_path, argv, env=None, program="metaseq-fake", then=""):
    """A fresh interpreter that runs the shipped .pth line first, as site.py would, then
    reports what the program sees (``then``: code the program runs after that)."""
    script = tmp_path / program
    script.write_text(textwrap.dedent(f"""\
        import sys, os, json
        {PTH.strip()}
        print(json.dumps({{"argv": sys.argv[1:], "env": os.environ.get("METASEQ_ONELOAD"),
                          "heavy": sorted(m for m in ("torch", "hydra", "omegaconf", "metaseq_oneload.integrations")
                                          if m in sys.modules),
                          "hook": any(type(f).__name__ == "AfterImport" for f in sys.meta_path)}}), flush=True)
        """) + textwrap.dedent(then))
    full_env = {k: v for k, v in os.environ.items() if k != "METASEQ_ONELOAD"}
    full_env.update(env or {})
    full_env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), str(REPO)])
    return subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, env=full_env, cwd=tmp_path)


def fake_metaseq(tmp_path):
    """An importable package called metaseq that is not metaseq (install() cannot patch it)."""
    pkg = tmp_path / "site" / "metaseq"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("IMPORTED = True\n")


def test_without_the_token_nothing_is_imported(tmp_path):
    r = run_with_pth(tmp_path, ["data", "--lr", "0.1"], then="print('metaseq_oneload' in sys.modules)\n")
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()
    assert json.loads(first) == {"argv": ["data", "--lr", "0.1"], "env": None, "heavy": [], "hook": False}
    assert second == "False"


def test_metaseq_command_gets_the_tokens_stripped(tmp_path):
    r = run_with_pth(tmp_path, ["data", "+oneload=broadcast", "--lr", "0.1", "oneload.verify=true"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["argv"] == ["data", "--lr", "0.1"]
    assert out["env"] == "broadcast oneload.verify=true"  # what spawned workers compose again
    assert out["hook"]  # metaseq is not imported yet: the patch waits for it


def test_other_programs_keep_their_tokens(tmp_path):
    # e.g. a Hydra app: +oneload=... is its own override; the patch still comes with metaseq.
    r = run_with_pth(tmp_path, ["+oneload=auto"], program="my_app.py")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["argv"] == ["+oneload=auto"] and out["env"] == "auto" and out["hook"]


def test_environment_variable_alone(tmp_path):
    r = run_with_pth(tmp_path, ["data", "oneload.bucket_mb=8"], env={"METASEQ_ONELOAD": "reshard"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["argv"] == ["data"] and out["env"] == "reshard oneload.bucket_mb=8"


def test_off_composes_but_installs_nothing(tmp_path):
    r = run_with_pth(tmp_path, ["data", "+oneload=off"])
    out = json.loads(r.stdout)
    assert out["argv"] == ["data"] and out["env"] == "off" and not out["hook"]


def test_a_typo_stops_the_program_with_hydras_message(tmp_path):
    r = run_with_pth(tmp_path, ["data", "+oneload=auto", "oneload.bogus=1"])
    assert r.returncode == 2 and r.stdout == ""
    assert "metaseq-oneload: data +oneload=auto oneload.bogus=1: ConfigCompositionException: " \
           "Could not override 'oneload.bogus'." in r.stderr


@pytest.mark.parametrize("value", ["auto", "broadcast oneload.verify=true", "1", "true", "oneload.verify=true", "bogus",
                                   "'unbalanced"])
def test_other_processes_under_the_variable_pay_nothing_and_never_stop(tmp_path, value):
    # metaseq-train exports METASEQ_ONELOAD: pip, a launcher, a data loader worker started by
    # it import no torch, no Hydra at start-up, and a value that does not compose cannot stop them.
    r = run_with_pth(tmp_path, ["install", "x"], env={"METASEQ_ONELOAD": value}, program="pip")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["argv"] == ["install", "x"] and out["heavy"] == []
    if value == "'unbalanced":
        assert "metaseq-oneload: warning: METASEQ_ONELOAD" in r.stderr and not out["hook"]
    else:
        assert r.stderr == "" and out["hook"]  # waits for metaseq, if it is ever imported


def test_a_bad_value_in_another_process_is_a_warning_when_metaseq_is_imported(tmp_path):
    fake_metaseq(tmp_path)
    r = run_with_pth(tmp_path, [], env={"METASEQ_ONELOAD": "bogus"}, program="worker.py",
                     then="import metaseq\nprint('imported', metaseq.IMPORTED)\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "imported True"
    assert "metaseq-oneload: warning: +oneload=bogus does not compose" in r.stderr


def test_a_bad_value_stops_a_metaseq_command(tmp_path):
    r = run_with_pth(tmp_path, ["data"], env={"METASEQ_ONELOAD": "bogus"})
    assert r.returncode == 2 and r.stdout == ""
    assert "metaseq-oneload: data: " in r.stderr and "oneload/bogus" in r.stderr


def test_the_hook_imports_the_patch_only_with_metaseq(tmp_path):
    # A metaseq command composes at start (Hydra), but the patch module (torch) waits for metaseq.
    r = run_with_pth(tmp_path, ["data", "+oneload=auto"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "torch" not in out["heavy"] and "metaseq_oneload.integrations" not in out["heavy"] and out["hook"]


def test_after_import_fires_once_the_package_has_run(tmp_path):
    pkg = tmp_path / "oneload_probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("VALUE = 42\n")
    code = textwrap.dedent("""\
        import sys
        from metaseq_oneload._import_hook import AfterImport
        seen = []
        finder = AfterImport.watch(["oneload_probe_pkg"], lambda: seen.append(sys.modules["oneload_probe_pkg"].VALUE))
        import oneload_probe_pkg
        print(seen, finder in sys.meta_path, type(oneload_probe_pkg.__loader__).__name__, oneload_probe_pkg.__spec__.loader is oneload_probe_pkg.__loader__)
        """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["[42]", "False", "SourceFileLoader", "True"]


def test_after_import_ignores_other_modules():
    finder = AfterImport(["no_such_package_xyz"], lambda: None)
    assert finder.find_spec("json") is None
    assert finder.find_spec("no_such_package_xyz") is None  # not installed: nothing to wrap
