"""Issue 25, "the first hour", discovery side: ordinary files print no warnings (what their
writers leave stale is a line of inspect's report), a folder says what it skipped and why
(FasterTransformer's raw weights, a metrics file), and three messages that pointed the wrong
way (a missing last shard, one non-checkpoint file, fairseq's export refusal)."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

import metaseq_oneload as mo
from metaseq_oneload.cli import main
from tests.conftest import FIXTURES, REPO, needs_fixtures, raw_load
from tests.hf_tiny import edited_singleton

pytestmark = needs_fixtures

FAIRSEQ = REPO / "tests" / "fixtures" / "fairseq"

# Plain consolidated, OPT-release-like and resharded sets as their writers leave them (see
# the corpus.json of each folder): every one keeps a cfg or FSDP metadata of the run it came
# from, which the tensors override.
ORDINARY = {
    "singleton": FIXTURES / "singleton",
    "reshard_unflat": FIXTURES / "reshard_unflat" / "reshard.pt",
    "opt_release_mp2": FIXTURES / "opt_release_mp2" / "reshard.pt",
    "reshard_mp1": FIXTURES / "reshard_mp1" / "reshard-model_part-0.pt",
    "consolidated_mp2_newarch": FIXTURES / "consolidated_mp2_newarch",
    "consolidated_mp2_parts": FIXTURES / "consolidated_mp2_parts",
    "convert_to_singleton": FIXTURES / "convert_to_singleton" / "restored.pt",
    "shard_only": FIXTURES / "shard_only" / "checkpoint_2.pt",
    "fairseq_fsdp_full": FAIRSEQ / "fsdp_full" / "checkpoint_last.pt",
}


def _run(capsys, argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("name", sorted(ORDINARY))
def test_ordinary_files_print_no_warning_on_any_command(name, tmp_path, capsys):
    src = ORDINARY[name]
    commands = [
        ["inspect", src],
        ["plan", src, "--world", "2"],
        ["convert", src, tmp_path / "c1" / "ck", "--no-progress"],
        ["verify", src, src, "--no-progress"],
        ["consolidate", src, tmp_path / "one.pt", "--no-progress"],
        ["export-hf", src, tmp_path / "hf", "--no-progress"],
    ]
    for argv in commands:
        rc, out, err = _run(capsys, argv)
        assert "warning:" not in err, (argv[0], err)
        # Converting is not warning either: the report's notes do not repeat what the source's cfg says.
        assert "source: cfg " not in out, (argv[0], out)
        if name != "fairseq_fsdp_full" or argv[0] != "export-hf":  # (fairseq's sinusoidal positions: refused)
            assert rc == 0, (argv[0], err)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layout = mo.inspect(src)
    assert layout.warnings == () and not caught, (layout.warnings, [str(w.message) for w in caught])
    assert layout.notes, name  # said, in inspect's report


def test_inspect_reports_what_the_files_override(capsys):
    rc, out, err = _run(capsys, ["inspect", FIXTURES / "singleton"])
    assert rc == 0 and err == ""
    notes = out.split("\nnotes\n", 1)[1]
    assert "cfg distributed_training.use_sharded_state=True" in notes and "unsharded weights" in notes
    rc, out, err = _run(capsys, ["inspect", FIXTURES / "singleton", "--json"])
    d = json.loads(out)
    assert d["warnings"] == [] and any("use_sharded_state=True" in n for n in d["notes"]) and err == ""


def test_stale_metadata_is_not_attributed_to_the_wrong_tool():
    # fairseq-train (FSDP without --use-sharded-state) wrote this file, not metaseq's reshard_fsdp.
    layout = mo.inspect(FAIRSEQ / "fsdp_full" / "checkpoint_last.pt")
    said = " ".join(layout.notes)
    assert "fsdp_metadata" in said and "reshard_fsdp" not in said and "metaseq" not in said, said


def test_what_is_actually_wrong_still_warns(tmp_path, capsys):
    # An index that no longer describes its files: discovery reads the headers and says so.
    mo.convert(FIXTURES / "fsdp_dp3", tmp_path / "out" / "ck", shards=2, progress=False)
    shard = tmp_path / "out" / "ck-model_part-0-shard1.pt"
    obj = raw_load(shard)
    obj["extra_state"]["edited"] = True
    torch.save(obj, shard)
    rc, out, err = _run(capsys, ["inspect", tmp_path / "out"])
    assert rc == 0 and "warning: " in err and "stale" in err and "read the headers instead" in err
    # A cfg that contradicts the tensors in a way neither settles: export-hf warns.
    src = edited_singleton(tmp_path / "edited", cfg={"max_target_positions": 99})
    rc, out, err = _run(capsys, ["export-hf", src, tmp_path / "hf", "--no-progress"])
    assert rc == 0 and "warning: " in err and "max_target_positions=99" in err


# --------------------------------------------------------------------------- folders


def _fastertransformer_folder(folder):
    """Files shaped like FasterTransformer's converter output: raw little-endian weights, one
    per tensor (and per tensor-parallel rank), beside a config.ini."""
    folder.mkdir(parents=True)
    (folder / "config.ini").write_text("[gpt]\nmodel_name = opt\nhead_num = 2\nsize_per_head = 8\n"
                                       "inter_size = 64\nnum_layer = 2\ntensor_para_size = 1\n")
    torch.randn(56, 16).numpy().tofile(folder / "model.wte.bin")
    torch.randn(16, 16).numpy().tofile(folder / "model.layers.0.attention.dense.weight.0.bin")
    torch.randn(16).numpy().tofile(folder / "model.final_layernorm.weight.bin")
    return folder


@pytest.mark.parametrize("metrics", ["floats", "scalar_tensors"])
def test_fastertransformer_folder_says_what_was_skipped(tmp_path, capsys, metrics):
    folder = _fastertransformer_folder(tmp_path / "ft")
    values = {f"step{i}": float(i) / 3 for i in range(100)}
    torch.save(values if metrics == "floats" else {k: torch.tensor(v) for k, v in values.items()},
               folder / "metrics.pt")
    with pytest.raises(mo.CheckpointLayoutError) as e:
        mo.inspect(folder)
    msg = str(e.value)
    assert "metrics.pt" in msg and "skipped" in msg and "FasterTransformer" in msg, msg
    assert "config.ini and 3 model.*.bin" in msg, msg
    rc, out, err = _run(capsys, ["inspect", folder])
    assert rc == 2 and "FasterTransformer" in err and "metrics.pt" in err


def test_fastertransformer_folder_without_pt_files_names_the_format(tmp_path):
    folder = _fastertransformer_folder(tmp_path / "ft")
    with pytest.raises(mo.CheckpointLayoutError, match="FasterTransformer") as e:
        mo.inspect(folder)
    assert "holds no *.pt files" not in str(e.value) or "FasterTransformer" in str(e.value)


def test_metrics_file_beside_a_checkpoint_is_skipped_not_suggested(tmp_path, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    shutil.copy(FIXTURES / "singleton" / "checkpoint_2_consolidated.pt", folder / "checkpoint_2.pt")
    torch.save({f"step{i}": torch.tensor(float(i)) for i in range(100)}, folder / "metrics.pt")
    layout = mo.inspect(folder)
    assert layout.files[0][0].path.endswith("checkpoint_2.pt") and layout.num_params == 21548
    assert any("metrics.pt" in n and "skipped" in n for n in layout.notes), layout.notes
    # Two real checkpoints: the choice is the user's, and the hint names only checkpoints.
    shutil.copy(FIXTURES / "singleton" / "checkpoint_2_consolidated.pt", folder / "checkpoint_1.pt")
    with pytest.raises(mo.CheckpointLayoutError) as e:
        mo.inspect(folder)
    msg = str(e.value)
    hint = msg.split("e.g.", 1)[1].split("(Not checkpoints", 1)[0]
    assert "2 checkpoints" in msg and "metrics.pt" not in hint and "checkpoint_" in hint, msg
    assert "skipped metrics.pt" in msg, msg


# --------------------------------------------------------------------------- messages


def test_missing_last_shard_is_named(tmp_path, capsys):
    for d in (0, 1):
        name = f"checkpoint_2-model_part-0-shard{d}.pt"
        shutil.copy(FIXTURES / "fsdp_dp3" / name, tmp_path / name)
    for entry in (tmp_path, tmp_path / "checkpoint_2-model_part-0-shard1.pt"):
        with pytest.raises(mo.CheckpointLayoutError) as e:
            mo.inspect(entry)
        msg = str(e.value)
        assert "checkpoint_2-model_part-0-shard2.pt" in msg and "missing" in msg, msg
        assert "Copy the missing shard" in msg, msg


def test_one_file_that_is_no_checkpoint_is_not_called_part_of_a_set(tmp_path, capsys):
    for path in (REPO / "README.md", tmp_path / "notes.pt"):
        if path.suffix == ".pt":
            path.write_text("these are not weights\n")
        with pytest.raises(mo.CheckpointLayoutError) as e:
            mo.inspect(path)
        msg = str(e.value)
        assert "not a torch checkpoint" in msg and "checkpoint set" not in msg, msg
        assert "Pass a checkpoint" in msg, msg
    # Among a set's files, the junk file is what to move out.
    for d in (0, 1):
        shutil.copy(FIXTURES / "shard_only" / f"checkpoint_2-shard{d}.pt", tmp_path / f"checkpoint_2-shard{d}.pt")
    (tmp_path / "checkpoint_2-shard2.pt").write_text("these are not weights\n")
    with pytest.raises(mo.CheckpointLayoutError, match=r"shard2\.pt: not a torch checkpoint.*Remove it from the "
                                                       r"checkpoint set"):
        mo.inspect(tmp_path / "checkpoint_2-shard0.pt")


def test_fairseq_export_refusal_speaks_fairseq(tmp_path, capsys):
    rc, out, err = _run(capsys, ["export-hf", FAIRSEQ / "plain" / "checkpoint_last.pt", tmp_path / "hf",
                                 "--no-progress"])
    assert rc == 2 and "cannot be expressed as a Hugging Face OPT model" in err
    assert "metaseq" not in err.split("error: ", 1)[1].replace("metaseq-oneload", ""), err
    assert "fairseq multiplies token embeddings" in err and "another architecture" not in err, err
    assert "--decoder-learned-pos" in err and "--no-scale-embedding" in err, err
