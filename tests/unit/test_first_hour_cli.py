"""Issue 25, "the first hour": what a new user meets in the first commands they type.

Every path the tool prints is accepted back; hints name options that exist where the user is
(flags on the command line, arguments in Python); a URL without the [remote] extra is a refusal
(exit 2), not a traceback; numeric options are checked once, the same way everywhere; and
``plan`` says what its own table shows. Real fixture files, the real CLI (in-process through
``main`` or in a subprocess); nothing under test is mocked.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import metaseq_oneload as mo
from metaseq_oneload.cli import build_parser, main
from tests import corpus
from tests.conftest import FIXTURES, needs_fixtures

pytestmark = needs_fixtures
REPO = Path(__file__).resolve().parents[2]


def _run(capsys, *argv) -> tuple:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _flags_of(command: str) -> set:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return {s for a in sub._actions for s in a.option_strings}


# --------------------------------------------------------------------------- paths printed are accepted back


def test_convert_destination_prefix_is_accepted_by_verify_and_inspect(tmp_path, capsys, monkeypatch):
    """`convert SRC out/c1/ck`, then `verify out/c1/ck SRC`: the prefix the user gave (and the
    table's target) names the checkpoint that was written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out" / "c1").mkdir(parents=True)
    src = FIXTURES / "fsdp_dp3" / "checkpoint_2"  # the un-suffixed name, as inspect prints it
    rc, out, err = _run(capsys, "convert", src, "out/c1/ck", "--no-progress")
    assert rc == 0, err
    target = re.search(r"^target\s+(\S+)", out, re.M).group(1)
    assert target == str(tmp_path / "out" / "c1" / "ck")
    for given in ("out/c1/ck", target):
        rc, out, err = _run(capsys, "verify", given, src, "--no-progress")
        assert rc == 0 and "MATCH" in out, err
        rc, out, err = _run(capsys, "inspect", given, "--json")
        assert rc == 0, err
        assert json.loads(out)["shards_per_part"] == 3


@pytest.mark.parametrize("e", [e for e in corpus.entries() if not e.refused], ids=lambda e: e.id)
def test_the_checkpoint_inspect_prints_is_accepted_by_every_command(e, capsys):
    """The `checkpoint` line of inspect (plan's and verify's too: the same name) pasted back
    into inspect, plan and verify names the same files."""
    rc, out, err = _run(capsys, "inspect", e.path, "--json")
    assert rc == 0, err
    first = json.loads(out)
    rc, out, err = _run(capsys, "inspect", first["path"], "--json")
    assert rc == 0, err
    again = json.loads(out)
    assert again["files"] == first["files"] and again["path"] == first["path"]
    rc, out, err = _run(capsys, "plan", first["path"], "-w", "1", "--json")
    assert rc == 0, err
    assert json.loads(out)["path"] == first["path"]


def test_printed_names_of_safetensors_and_hugging_face_outputs_are_accepted(tmp_path, capsys):
    rc, out, err = _run(capsys, "convert", FIXTURES / "fsdp_dp3", tmp_path / "st" / "ck", "-s", "1",
                        "--format", "safetensors", "--no-progress")
    assert rc == 0, err
    assert sorted(os.listdir(tmp_path / "st")) == ["ck.json", "ck.safetensors"]
    target = re.search(r"^target\s+(\S+)", out, re.M).group(1)  # .../st/ck
    rc, out, err = _run(capsys, "export-hf", FIXTURES / "singleton", tmp_path / "hf", "--no-progress")
    assert rc == 0, err
    for given in (tmp_path / "st" / "ck.safetensors", tmp_path / "hf"):
        rc, out, err = _run(capsys, "inspect", given, "--json")
        assert rc == 0, err
        printed = json.loads(out)["path"]  # .../st/ck, .../hf/model
        assert printed != str(given)
        if given.name == "ck.safetensors":
            assert printed == target
        rc, out, err = _run(capsys, "inspect", printed, "--json")
        assert rc == 0, (printed, err)
        rc, out, err = _run(capsys, "verify", printed, FIXTURES / "singleton", "--atol", "1e-4", "--no-progress")
        assert rc in (0, 1) and "a  " in out, (printed, err)


def test_a_prefix_with_nothing_behind_it_is_still_not_found(tmp_path, capsys):
    rc, out, err = _run(capsys, "inspect", tmp_path / "ck")
    assert rc == 2
    assert "no such file or folder, and no ck.pt, ck-model_part-*.pt, ck-shard*.pt or ck_part*.pt" in err, err


# --------------------------------------------------------------------------- hints name options that exist


def _named_flags(text: str) -> set:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", text))


def test_cli_refusals_name_flags_of_the_command_not_python_arguments(tmp_path, capsys):
    rc, out, err = _run(capsys, "plan", FIXTURES / "fsdp_dp3", "-w", "2", "--strategy", "own_shard")
    assert rc == 2
    assert "--strategy own_shard needs the saved layout to match the world" in err, err
    assert "Use --strategy reshard or --strategy auto" in err, err
    assert "strategy=" not in err and "CLI" not in err

    rc, out, err = _run(capsys, "convert", FIXTURES / "singleton", tmp_path / "ck", "--no-progress")
    assert rc == 0, err
    rc, out, err = _run(capsys, "convert", FIXTURES / "singleton", tmp_path / "ck", "--no-progress")
    assert rc == 2 and "Pass --overwrite to replace them" in err, err
    assert "overwrite=" not in err and "CLI" not in err

    rc, out, err = _run(capsys, "convert", FIXTURES / "singleton", tmp_path / "x", "-s", "2", "--unflat")
    assert rc == 2 and "--shards 2 with --unflat" in err and "Use --flat or --shards 1" in err, err

    rc, out, err = _run(capsys, "export-hf", FIXTURES / "singleton", tmp_path / "hf", "--no-progress")
    assert rc == 0, err
    rc, out, err = _run(capsys, "export-hf", FIXTURES / "singleton", tmp_path / "hf", "--no-progress")
    assert rc == 2 and "pass --overwrite to replace it" in err and "overwrite=" not in err, err

    rc, out, err = _run(capsys, "plan", FIXTURES / "fsdp_dp3", "-w", "3", "-m", "2")
    assert rc == 2 and "--world 3, --model-parallel 2: the world must be a positive multiple" in err, err
    assert _named_flags(err) <= _flags_of("plan")


def test_api_refusals_name_arguments(tmp_path):
    with pytest.raises(mo.CheckpointLayoutError, match=r"strategy='own_shard' needs .* Use strategy='reshard'"):
        mo.plan_load(FIXTURES / "fsdp_dp3", world=2, strategy="own_shard")
    mo.convert(FIXTURES / "singleton", tmp_path / "ck", progress=False)
    with pytest.raises(mo.OutputExistsError, match=r"Pass overwrite=True \(CLI: --overwrite\) to replace them"):
        mo.convert(FIXTURES / "singleton", tmp_path / "ck", progress=False)
    with pytest.raises(ValueError, match=r"Use flat=True \(CLI: --flat\) or shards=1 \(CLI: --shards 1\)"):
        mo.convert(FIXTURES / "singleton", tmp_path / "x", shards=2, flat=False)


def test_consolidate_never_suggests_a_flag_it_does_not_have(tmp_path, capsys):
    """Flat optimizer state is dropped by consolidate; the note names the way to keep it that
    exists (convert --flat), not consolidate --flat."""
    rc, out, err = _run(capsys, "consolidate", FIXTURES / "shard_only", tmp_path / "one.pt", "--no-progress")
    assert rc == 0, err
    assert "optimizer state dropped" in out
    assert "metaseq-oneload convert SRC DST --flat keeps the output flat" in out, out
    named = _named_flags(out.replace("metaseq-oneload convert SRC DST --flat", ""))
    assert named <= _flags_of("consolidate"), named - _flags_of("consolidate")
    r = mo.consolidate(FIXTURES / "shard_only", tmp_path / "two.pt", progress=False)
    assert any("convert(path, dst, flat=True)" in n for n in r.notes), r.notes


def test_convert_notes_name_convert_flags(tmp_path, capsys):
    rc, out, err = _run(capsys, "convert", FIXTURES / "shard_only", tmp_path / "ck", "-s", "1", "--no-progress")
    assert rc == 0, err
    assert "keep the output flat, --flat, to carry it" in out, out
    rc, out, err = _run(capsys, "convert", FIXTURES / "singleton", tmp_path / "f", "-s", "2", "--no-progress")
    assert rc == 0, err
    assert "pass --wrapping SHARD.pt to follow another model's" in out, out
    assert _named_flags(out) <= _flags_of("convert")


def test_plan_flat_on_unflattened_weights_works_from_the_command_line(tmp_path, capsys):
    """The README's `plan CKPT --world W --model-parallel M --flat` on unflattened weights: the
    plan assumes metaseq's wrapping and says so; --wrapping names another; the API keeps
    asking for shard_metadata=, which it can pass."""
    rc, out, err = _run(capsys, "plan", FIXTURES / "singleton", "--world", "4", "--model-parallel", "2", "--flat")
    assert rc == 0, err
    strategy = re.search(r"^strategy\s+(.*)$", out, re.M).group(1)
    assert "as metaseq wraps its models" in strategy and "--wrapping SHARD.pt" in strategy, strategy
    assert "shard_metadata" not in out and "CLI" not in out
    assert _named_flags(out) <= _flags_of("plan")
    shard = FIXTURES / "shard_only" / "checkpoint_2-shard0.pt"
    rc, out, err = _run(capsys, "plan", FIXTURES / "singleton", "-w", "2", "--flat", "--wrapping", shard, "--json")
    assert rc == 0, err
    assert "as metaseq wraps" not in json.loads(out)["reason"]
    with pytest.raises(mo.StateDictMismatchError, match=r"shard_metadata=model.local_metadata_dict\(\)"):
        mo.load_state_dict(FIXTURES / "mp2_ddp", flat=True)


# --------------------------------------------------------------------------- s3:// without the [remote] extra


@pytest.mark.parametrize("blocked", [("s3fs",), ("s3fs", "fsspec")], ids=["no-s3fs", "no-fsspec"])
def test_a_url_without_the_remote_extra_is_a_refusal_with_the_install_line(blocked):
    """As on a machine without the extra: importing the blocked modules raises ImportError."""
    code = ("import sys\n"
            f"for m in {blocked!r}: sys.modules[m] = None\n"
            "from metaseq_oneload.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    argvs = (["inspect", "s3://bucket/ck/checkpoint_last.pt"],
             ["verify", "s3://bucket/ck/checkpoint_last.pt", str(FIXTURES / "singleton")])
    # Side by side: each is a fresh interpreter importing torch, most of this test's time.
    runs = [subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=dict(os.environ, PYTHONPATH=str(REPO))) for argv in argvs]
    try:
        for argv, run in zip(argvs, runs):
            _, err = run.communicate(timeout=300)
            assert run.returncode == 2, err
            assert "Traceback" not in err and "internal error" not in err, err
            assert err.startswith(f"metaseq-oneload {argv[0]}: error: s3://bucket/ck/checkpoint_last.pt: reading "
                                  "checkpoints from URLs needs fsspec"), err
            assert "pip install metaseq-oneload[remote]" in err
    finally:  # (one that hung or failed an assertion leaves no sibling running)
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.communicate()


def test_the_missing_extra_is_a_oneload_error_and_still_an_import_error():
    code = ("import sys\nsys.modules['s3fs'] = None\n"
            "import metaseq_oneload as mo\n"
            "try:\n    mo.inspect('s3://bucket/ck/checkpoint_last.pt')\n"
            "except mo.OneloadError as e:\n    print('REFUSED', isinstance(e, ImportError))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.stdout.strip() == "REFUSED True", p.stdout + p.stderr


# --------------------------------------------------------------------------- options checked once, everywhere


BAD_OPTIONS = [
    (["convert", "{src}", "{out}/ck", "--chunk-mb", "0"], "--chunk-mb 0: expected a positive number of MiB"),
    (["convert", "{src}", "{out}/ck", "--chunk-mb", "-5"], "--chunk-mb -5: expected a positive number of MiB"),
    (["convert", "{src}", "{out}/ck", "--jobs", "0"], "--jobs 0: expected a whole number of at least 1"),
    (["convert", "{src}", "{out}/ck", "--memory-budget", "0"], "--memory-budget 0: expected a positive size"),
    (["consolidate", "{src}", "{out}/one.pt", "--chunk-mb", "0"], "--chunk-mb 0: expected a positive number"),
    (["verify", "{src}", "{src}", "--atol", "-1"], "--atol -1: expected a finite number of at least 0"),
    (["verify", "{src}", "{src}", "--rtol", "nan"], "--rtol nan: expected a finite number of at least 0"),
    (["verify", "{src}", "{src}", "--top", "-1"], "--top -1: expected a whole number of at least 0"),
    (["export-hf", "{src}", "{out}/hf", "--chunk-mb", "0"], "--chunk-mb 0: expected a positive number of MiB"),
    (["export-hf", "{src}", "{out}/hf", "--max-shard-size", "0"], "--max-shard-size 0: must be positive"),
    (["plan", "{src}", "-w", "2", "--chunk-mb", "0"], "--chunk-mb 0: expected a positive number of MiB"),
    (["plan", "{src}", "-w", "2", "--bucket-mb", "-5"], "--bucket-mb -5: expected a positive number of MiB"),
    (["plan", "{src}", "-w", "0"], "--world 0: expected a whole number of at least 1"),
]


@pytest.mark.parametrize("argv,message", BAD_OPTIONS, ids=[" ".join(a[0:1] + a[-2:]) for a, _ in BAD_OPTIONS])
def test_bad_option_values_are_refused_in_the_same_words_everywhere(tmp_path, capsys, argv, message):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    argv = [a.format(src=FIXTURES / "singleton", out=out_dir) for a in argv]
    rc, out, err = _run(capsys, *argv, "--no-progress" if argv[0] not in ("plan",) else "--json")
    assert rc == 2, (out, err)
    assert message in err and "Nothing was read or written" in err or "--max-shard-size" in message, err
    assert "=" not in err.split(": error: ", 1)[1].split(":", 1)[0], err  # flags, not chunk_mb=0
    assert os.listdir(out_dir) == []


@pytest.mark.parametrize("call,message", [
    (lambda t: mo.convert(FIXTURES / "singleton", t / "ck", chunk_mb=0), r"chunk_mb=0 \(CLI: --chunk-mb 0\)"),
    (lambda t: mo.convert(FIXTURES / "singleton", t / "ck", jobs=0), r"jobs=0 \(CLI: --jobs 0\)"),
    (lambda t: mo.verify(FIXTURES / "singleton", FIXTURES / "singleton", atol=-1), r"atol=-1 \(CLI: --atol -1\)"),
    (lambda t: mo.export_hf(FIXTURES / "singleton", t / "hf", chunk_mb=-5), r"chunk_mb=-5 \(CLI: --chunk-mb -5\)"),
    (lambda t: mo.plan_load(FIXTURES / "singleton", world=2, chunk_mb=0), r"chunk_mb=0 \(CLI: --chunk-mb 0\)"),
    (lambda t: mo.load_state_dict(FIXTURES / "singleton", bucket_mb=0), r"bucket_mb=0 \(CLI: --bucket-mb 0\)"),
])
def test_bad_option_values_are_refused_by_the_api_naming_the_argument(tmp_path, call, message):
    with pytest.raises(mo.OneloadError, match=message) as info:
        call(tmp_path)
    assert isinstance(info.value, ValueError)  # a bad argument, as before
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- plan says what its table shows


def test_own_shard_reason_names_every_rank_that_reads_another_file(capsys):
    for argv in (["fsdp_dp3", "-w", "3", "--flat"], ["mp2_dp2", "-w", "4", "-m", "2", "--flat"],
                 ["shard_only", "-w", "2", "--flat"], ["mp2_ddp", "-w", "2", "-m", "2"]):
        rc, out, err = _run(capsys, "plan", FIXTURES / argv[0], *argv[1:], "--json")
        assert rc == 0, err
        d = json.loads(out)
        assert d["strategy"] == "own_shard"
        beyond = sorted(r["rank"] for r in d["ranks"] if len(r["files"]) > 1)
        # Each model-parallel part names its own ranks ("rank 2 also reads from ...; rank 3 ...").
        named = sorted(int(n) for m in re.finditer(r"\branks? ([\d, ]+) also reads? from", d["reason"])
                       for n in m.group(1).split(","))
        assert named == beyond, (argv, beyond, d["reason"])


def test_no_sentence_of_the_reason_is_said_twice(capsys):
    rc, out, err = _run(capsys, "plan", FIXTURES / "mp2_ddp", "-w", "4", "-m", "2", "--json")
    assert rc == 0, err
    parts = json.loads(out)["reason"].split("; ")
    assert len(parts) == len(set(parts)), parts


@pytest.mark.parametrize("argv", [["-w", "3", "--strategy", "broadcast"],
                                  ["-w", "3", "--strategy", "broadcast", "--flat"]])
def test_broadcast_peak_is_no_larger_than_the_checkpoint_needs(capsys, argv):
    """An 84 KiB checkpoint is not staged through a 256 MiB bucket (the engine allocates what
    the plan says: tests/unit/test_cli_plan.py measures it)."""
    src = FIXTURES / ("fsdp_dp3" if "--flat" in argv else "singleton")
    rc, out, err = _run(capsys, "plan", src, *argv, "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert 0 < max(r["peak_extra_bytes"] for r in d["ranks"]) <= d["model_bytes"] + 4096, d["ranks"]
