"""Bad input: a clear error naming the file(s), what was found and what was expected;
nothing on disk changes."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

import metaseq_oneload as mo
from metaseq_oneload import CheckpointLayoutError
from tests.conftest import copy_set, needs_fixtures, raw_load

pytestmark = needs_fixtures


def snapshot(folder) -> dict:
    out = {}
    for p in sorted(os.listdir(folder)):
        full = os.path.join(folder, p)
        st = os.lstat(full)
        digest = hashlib.sha256(open(full, "rb").read()).hexdigest() if os.path.isfile(full) and not os.path.islink(full) else os.readlink(full) if os.path.islink(full) else ""
        out[p] = (st.st_size, st.st_mtime_ns, digest)
    return out


def inspect_fails(path, match):
    before = snapshot(path if os.path.isdir(path) else os.path.dirname(path))
    with pytest.raises(CheckpointLayoutError, match=match):
        mo.inspect(path)
    assert snapshot(path if os.path.isdir(path) else os.path.dirname(path)) == before


def test_missing_middle_shard(tmp_path):
    d = copy_set("fsdp_dp3", tmp_path)
    os.remove(d / "checkpoint_2-model_part-0-shard1.pt")
    inspect_fails(d / "checkpoint_2-model_part-0-shard0.pt",
                  r"checkpoint_2-model_part-0-shard\{0\.\.2\}\.pt: found shards 0,2 of 3 "
                  r"\(missing checkpoint_2-model_part-0-shard1\.pt\)")


def test_missing_shards_of_four(tmp_path):
    d = copy_set("fsdp_dp3", tmp_path)
    # 0,1,3 of 4: rename shard2 -> shard3
    os.rename(d / "checkpoint_2-model_part-0-shard2.pt", d / "checkpoint_2-model_part-0-shard3.pt")
    inspect_fails(d / "checkpoint_2.pt", r"found shards 0,1,3 of 4 \(missing checkpoint_2-model_part-0-shard2\.pt\)")


def test_missing_last_shard_is_caught_by_the_metadata(tmp_path):
    d = copy_set("fsdp_dp3", tmp_path)
    os.remove(d / "checkpoint_2-model_part-0-shard2.pt")
    inspect_fails(d / "checkpoint_2-model_part-0-shard0.pt",
                  r"flat_param_0: the 2 shard\(s\) hold 1904 of the 2856 elements its metadata lists, 952 per shard, so "
                  r"the set has 3 shards and checkpoint_2-model_part-0-shard2\.pt is missing")


def test_missing_model_part(tmp_path):
    d = copy_set("mp2_ddp", tmp_path)
    os.remove(d / "checkpoint_2-model_part-1.pt")
    inspect_fails(d / "checkpoint_2-model_part-0.pt",
                  r"found model parts 0\.\.0 but cfg common\.model_parallel_size=2 \(missing checkpoint_2-model_part-1\.pt\)")


def test_missing_first_model_part(tmp_path):
    d = copy_set("mp2_dp2", tmp_path)
    for s in (0, 1):
        os.remove(d / f"checkpoint_2-model_part-0-shard{s}.pt")
    inspect_fails(d / "checkpoint_2-model_part-1-shard0.pt", r"found model parts 1 of 2 \(missing checkpoint_2-model_part-0-shard0\.pt\)")


def test_truncated_file(tmp_path):
    d = copy_set("fsdp_dp3", tmp_path)
    f = d / "checkpoint_2-model_part-0-shard1.pt"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    inspect_fails(d, r"checkpoint_2-model_part-0-shard1\.pt: truncated or corrupted.*zip directory.*missing")


def test_non_checkpoint_files(tmp_path):
    (tmp_path / "notes.pt").write_text("these are my notes, not a checkpoint\n")
    inspect_fails(tmp_path / "notes.pt", r"notes\.pt: not a torch checkpoint: it starts with b'these ar'")
    torch.save({"tokens": torch.zeros(2), "how": "text"}, tmp_path / "logits.pt")
    inspect_fails(tmp_path / "logits.pt", r"logits\.pt: not a model checkpoint: its top level is \['tokens', 'how'\]")
    (tmp_path / "empty.pt").write_bytes(b"")
    inspect_fails(tmp_path / "empty.pt", r"empty\.pt: the file is empty")


def test_empty_folder(tmp_path):
    inspect_fails(tmp_path, r"holds no \*\.pt files")


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointLayoutError, match=r"checkpoint_9\.pt: no such file, and no checkpoint_9-model_part-\*\.pt"):
        mo.inspect(tmp_path / "checkpoint_9.pt")


def test_folder_with_several_checkpoints_and_no_last(tmp_path):
    d = copy_set("fsdp_dp3", tmp_path)
    for p in d.glob("checkpoint_last-*"):
        p.unlink()
    for p in list(d.glob("checkpoint_2-*")):
        os.link(p, d / p.name.replace("checkpoint_2", "checkpoint_1"))
    inspect_fails(d, r"holds 2 checkpoints and no checkpoint_last: checkpoint_1 \(3 files\), checkpoint_2 \(3 files\)\. "
                     r"Choose one by passing its name, e\.g\. .*checkpoint_2\.pt")
    assert mo.inspect(d / "checkpoint_1.pt").shards_per_part == 3


def test_shards_of_two_saves_are_mixed(tmp_path):
    d = copy_set("fsdp_dp3", tmp_path)
    f = d / "checkpoint_2-model_part-0-shard1.pt"
    state = raw_load(f)
    state["optimizer_history"][-1]["num_updates"] = 4
    torch.save(state, f)
    inspect_fails(d / "checkpoint_2.pt", r"files of different saves are mixed in one set \(num_updates=2.*num_updates=4, "
                                         r"epoch=1, iterations_in_epoch=2: checkpoint_2-model_part-0-shard1\.pt")


def test_shards_of_different_shapes_are_mixed(tmp_path):
    d = copy_set("fsdp_dp3", tmp_path)
    # shard_only was resharded to 2 flat shards: same model, other shard sizes.
    other = copy_set("shard_only", tmp_path)
    os.replace(other / "checkpoint_2-shard1.pt", d / "checkpoint_2-model_part-0-shard1.pt")
    inspect_fails(d / "checkpoint_2.pt", r"flat_param_0 has a different size in each shard \(checkpoint_2-model_part-0-shard0\.pt: 952, "
                                         r"checkpoint_2-model_part-0-shard1\.pt: 1428")


def test_inconsistent_padding(tmp_path):
    d = copy_set("fsdp_dp3", tmp_path)
    f = d / "checkpoint_2-model_part-0-shard0.pt"
    state = raw_load(f)
    state["shard_metadata"]["param_metadata"][1]["params"]["flat_param_0"]["padding"] = 2
    torch.save(state, f)
    inspect_fails(d / "checkpoint_2.pt", r"shard1\.pt: decoder\.layers\.0\.flat_param_0: holds 3116 elements after an earlier "
                                         r"shard ended in padding \(paddings \[2, 0, 2\]\): inconsistent padding")


def test_symlink_loop(tmp_path):
    os.symlink(tmp_path / "b-shard0.pt", tmp_path / "a-shard0.pt")
    os.symlink(tmp_path / "a-shard0.pt", tmp_path / "b-shard0.pt")
    with pytest.raises(CheckpointLayoutError, match=r"a-shard0\.pt: symlink loop"):
        mo.inspect(tmp_path / "a-shard0.pt")


def test_text_pointer_loop(tmp_path):
    (tmp_path / "a.pt").write_text("b.pt")
    (tmp_path / "b.pt").write_text("a.pt")
    with pytest.raises(CheckpointLayoutError, match=r"a\.pt: link loop \(.*a\.pt -> .*b\.pt -> .*a\.pt\)"):
        mo.inspect(tmp_path / "a.pt")


def test_dangling_link(tmp_path):
    os.symlink(tmp_path / "gone-shard0.pt", tmp_path / "checkpoint_last-shard0.pt")
    with pytest.raises(CheckpointLayoutError, match=r"dangling link"):
        mo.inspect(tmp_path / "checkpoint_last-shard0.pt")
