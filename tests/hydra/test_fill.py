"""Filling metaseq's loading settings from the real checkpoints (no metaseq needed): what is
filled, what the user gave is kept (the run's choices) or refused, what the run's model
requires, which checkpoint a run would load."""

import argparse
import os
import shutil

import pytest
from omegaconf import OmegaConf

import metaseq_oneload as mo
from metaseq_oneload._hydra import checkpoint_path
from metaseq_oneload.hydra import CheckpointSettingsError, fill_settings
from tests.conftest import FIXTURES, needs_fixtures

pytestmark = needs_fixtures


def metaseq_cfg(**sections):
    """A config shaped like the one metaseq builds from argparse: nested sections, and the
    flat argparse.Namespace copy of every option in cfg.model."""
    base = {
        "common": {"model_parallel_size": 1, "seed": 1},
        "checkpoint": {"checkpoint_shard_count": 1, "save_dir": "checkpoints", "restore_file": "checkpoint_last.pt",
                       "finetune_from_model": None},
        "distributed_training": {"ddp_backend": "pytorch_ddp", "use_sharded_state": False},
        "common_eval": {"path": None},
    }
    for name, values in sections.items():
        base[name].update(values)
    # metaseq swaps omegaconf's primitive-type check to store the Namespace; allow_objects
    # is omegaconf's own switch for the same.
    cfg = OmegaConf.create(base, flags={"allow_objects": True})
    flat = {k: v for section in base.values() for k, v in section.items()}
    cfg.model = argparse.Namespace(**flat)  # what convert_namespace_to_omegaconf does
    return cfg


def values(cfg):
    return (cfg.common.model_parallel_size, cfg.checkpoint.checkpoint_shard_count,
            cfg.distributed_training.ddp_backend, cfg.distributed_training.use_sharded_state)


@pytest.mark.parametrize("name,expected", [
    ("singleton", (1, 1, "pytorch_ddp", False)),
    ("fsdp_dp3", (1, 1, "fully_sharded", True)),
    ("mp2_ddp", (2, 1, "pytorch_ddp", False)),
    ("mp2_dp2", (2, 1, "fully_sharded", True)),
    ("shard_only", (1, 1, "fully_sharded", True)),
])
def test_defaults_take_the_files_values(name, expected):
    cfg = metaseq_cfg()
    changes = fill_settings(cfg, mo.inspect(FIXTURES / name))
    assert values(cfg) == expected
    assert {k for k, _, _ in changes} == {k for k, old, new in zip(
        ("common.model_parallel_size", "checkpoint.checkpoint_shard_count", "distributed_training.ddp_backend",
         "distributed_training.use_sharded_state"), (1, 1, "pytorch_ddp", False), expected) if old != new}


def test_the_namespace_copies_follow():
    cfg = metaseq_cfg()
    fill_settings(cfg, mo.inspect(FIXTURES / "mp2_dp2"))
    # metaseq's model reads use_sharded_state from cfg.model, not from distributed_training.
    assert (cfg.model.model_parallel_size, cfg.model.use_sharded_state, cfg.model.ddp_backend) == (2, True, "fully_sharded")


def test_agreeing_values_are_fine():
    cfg = metaseq_cfg(common={"model_parallel_size": 2}, distributed_training={"ddp_backend": "fully_sharded"})
    assert fill_settings(cfg, mo.inspect(FIXTURES / "mp2_dp2"),
                         explicit={"--model-parallel-size", "--ddp-backend"}) == [
        ("distributed_training.use_sharded_state", False, True)]


def test_a_given_model_parallel_size_is_the_runs_choice():
    # auto: the engine reshards onto the run's own model-parallel size; reported in `kept`.
    cfg, kept = metaseq_cfg(), []
    changes = fill_settings(cfg, mo.inspect(FIXTURES / "mp2_ddp"), explicit={"--model-parallel-size"}, kept=kept)
    assert changes == [] and values(cfg) == (1, 1, "pytorch_ddp", False)
    assert kept == [("common.model_parallel_size", 1, 2)]


def test_a_non_default_value_counts_as_given():
    cfg, kept = metaseq_cfg(common={"model_parallel_size": 4}), []
    fill_settings(cfg, mo.inspect(FIXTURES / "fsdp_dp3"), kept=kept)
    assert cfg.common.model_parallel_size == 4 and kept == [("common.model_parallel_size", 4, 1)]
    # the backend and sharded state still come from the files
    assert values(cfg)[2:] == ("fully_sharded", True)


def test_own_shard_refuses_what_it_cannot_read_as_saved():
    with pytest.raises(CheckpointSettingsError, match=(
            r"--model-parallel-size 1 \(common\.model_parallel_size\): oneload\.strategy=own_shard reads the files "
            r"as they are, and .*mp2_ddp/checkpoint_2-model_part-\{0\.\.1\}\.pt hold model_parallel_size=2 "
            r"\(2 model-parallel part\(s\)\)\. Drop --model-parallel-size to take the files' value, or use "
            r"oneload\.strategy=auto to load onto model_parallel_size=1\.")):
        fill_settings(metaseq_cfg(), mo.inspect(FIXTURES / "mp2_ddp"), explicit={"--model-parallel-size"},
                      strategy="own_shard")


def test_a_given_backend_is_the_runs_choice():
    # c10d (DDP) trains on FSDP shards: the engine unflattens them for its model.
    cfg, kept = metaseq_cfg(distributed_training={"ddp_backend": "c10d"}), []
    assert fill_settings(cfg, mo.inspect(FIXTURES / "fsdp_dp3"), kept=kept) == []
    assert values(cfg) == (1, 1, "c10d", False)  # DDP cannot save sharded state: not filled either
    assert kept == [("distributed_training.ddp_backend", "c10d", "fully_sharded")]


def test_what_the_model_requires_comes_first():
    why = "metaseq's model-parallel transformer asserts it"
    cfg = metaseq_cfg()
    changes = fill_settings(cfg, mo.inspect(FIXTURES / "mp2_ddp"), requires={"use_sharded_state": (True, why)})
    assert values(cfg) == (2, 1, "pytorch_ddp", True) and cfg.model.use_sharded_state is True
    assert changes == [("common.model_parallel_size", 1, 2), ("distributed_training.use_sharded_state", False, True)]
    # passed by hand (--use-sharded-state): nothing to change, nothing to say
    cfg = metaseq_cfg(distributed_training={"use_sharded_state": True})
    assert fill_settings(cfg, mo.inspect(FIXTURES / "mp2_ddp"), explicit={"--use-sharded-state"},
                         requires={"use_sharded_state": (True, why)}) == [("common.model_parallel_size", 1, 2)]
    # explicitly off: the run cannot be built
    with pytest.raises(CheckpointSettingsError, match=(
            r"distributed_training\.use_sharded_state=False \(--use-sharded-state\): metaseq's model-parallel "
            r"transformer asserts it, so this run needs use_sharded_state=True; the files \(.*mp2_ddp/"
            r"checkpoint_2-model_part-\{0\.\.1\}\.pt\) hold unflattened weights, which load either way\.")):
        fill_settings(metaseq_cfg(), mo.inspect(FIXTURES / "mp2_ddp"),
                      explicit={"distributed_training.use_sharded_state"}, requires={"use_sharded_state": (True, why)})


def test_sharded_state_beside_pytorch_ddp_parts_is_not_stale():
    # metaseq's model-parallel transformer saves use_sharded_state=True under pytorch_ddp:
    # what the run needed, not a cfg left over from another layout (not even a note).
    assert mo.inspect(FIXTURES / "mp2_ddp").notes == ()
    assert any("use_sharded_state=True" in w for w in mo.inspect(FIXTURES / "singleton").notes)  # FSDP's


def test_reshard_lets_the_user_win():
    cfg = metaseq_cfg(distributed_training={"ddp_backend": "pytorch_ddp"})
    changes = fill_settings(cfg, mo.inspect(FIXTURES / "mp2_dp2"), strategy="reshard",
                            explicit={"--model-parallel-size", "--ddp-backend"})
    # MP stays 1 and the backend stays DDP, which cannot save sharded state: not filled either.
    assert values(cfg) == (1, 1, "pytorch_ddp", False) and changes == []


def test_unflattened_files_leave_backend_and_sharded_state_to_the_user():
    # e.g. fine-tuning a consolidated checkpoint with FSDP and sharded saving
    cfg = metaseq_cfg(distributed_training={"ddp_backend": "fully_sharded", "use_sharded_state": True})
    assert fill_settings(cfg, mo.inspect(FIXTURES / "singleton")) == []
    assert values(cfg) == (1, 1, "fully_sharded", True)


def test_fairseq_part_files(tmp_path):
    # fairseq's checkpoint_shard_count > 1 layout: the FSDP shards named X_partK.pt
    for k in range(2):
        shutil.copy(FIXTURES / "shard_only" / f"checkpoint_2-shard{k}.pt", tmp_path / f"checkpoint_2_part{k}.pt")
    layout = mo.inspect(tmp_path / "checkpoint_2_part0.pt")
    cfg = metaseq_cfg()
    fill_settings(cfg, layout)
    assert values(cfg) == (1, 2, "pytorch_ddp", False)  # fairseq consolidates _part files while loading
    with pytest.raises(CheckpointSettingsError, match=r"--checkpoint-shard-count 3 .* checkpoint_shard_count=2 \(2 _part file\(s\)\)"):
        fill_settings(metaseq_cfg(checkpoint={"checkpoint_shard_count": 3}), layout)


def test_sections_the_config_lacks_are_skipped():
    cfg = OmegaConf.create({"common": {"model_parallel_size": 1}})
    assert fill_settings(cfg, mo.inspect(FIXTURES / "mp2_dp2")) == [("common.model_parallel_size", 1, 2)]


def test_checkpoint_path_evaluation_first():
    cfg = metaseq_cfg(common_eval={"path": f"{FIXTURES / 'mp2_dp2' / 'checkpoint_last.pt'}:/other/model.pt"})
    assert checkpoint_path(cfg) == str(FIXTURES / "mp2_dp2" / "checkpoint_last.pt")
    assert checkpoint_path(cfg, "/given.pt") == "/given.pt"


def test_checkpoint_path_training(tmp_path):
    cfg = metaseq_cfg(checkpoint={"save_dir": str(tmp_path), "finetune_from_model": "/pretrained/reshard.pt"})
    assert checkpoint_path(cfg) == "/pretrained/reshard.pt"  # nothing to resume: the fine-tune source
    cfg.checkpoint.finetune_from_model = None
    assert checkpoint_path(cfg) is None  # a first launch
    for name in os.listdir(FIXTURES / "fsdp_dp3"):
        shutil.copy(FIXTURES / "fsdp_dp3" / name, tmp_path / name)
    assert checkpoint_path(cfg) == os.path.join(str(tmp_path), "checkpoint_last.pt")
    cfg.checkpoint.restore_file = "/elsewhere/checkpoint_9.pt"
    assert checkpoint_path(cfg) == "/elsewhere/checkpoint_9.pt"


def test_checkpoint_path_of_an_argparse_namespace():
    # metaseq's older entry points hand a flat argparse.Namespace per section.
    import argparse

    path = str(FIXTURES / "mp2_dp2" / "checkpoint_last.pt")
    cfg = argparse.Namespace(common_eval=argparse.Namespace(path=f"{path}:/other/model.pt"))
    assert checkpoint_path(cfg) == path
    cfg = argparse.Namespace(common_eval=argparse.Namespace(path=None),
                             checkpoint=argparse.Namespace(restore_file="/r/checkpoint_9.pt", save_dir="/r"))
    assert checkpoint_path(cfg) == "/r/checkpoint_9.pt"
