"""Discovery never lets a set through that would load wrong weights, and its errors stay
small and fast: one shard in another dtype, a part in another dtype, absurd shard or part
counts, folders of broken links (issue 10, items 4, 9 and 12). Each case is made from real
fixture files; each test checks the message names the file and tensor and that nothing on
disk changed."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

import metaseq_oneload as mo
from metaseq_oneload import CheckpointLayoutError, CheckpointNotFoundError
from tests.conftest import FIXTURES, copy_set, needs_fixtures, raw_load

pytestmark = needs_fixtures


def snapshot(folder) -> dict:
    return {p: hashlib.sha256(open(os.path.join(folder, p), "rb").read()).hexdigest() if not os.path.islink(
        os.path.join(folder, p)) else os.readlink(os.path.join(folder, p)) for p in sorted(os.listdir(folder))}


def resave(path, edit) -> None:
    obj = raw_load(path)
    edit(obj)
    torch.save(obj, path)


def test_one_shard_in_another_dtype_is_refused(tmp_path):
    d = copy_set("fsdp_dp3", tmp_path)
    shard = d / "checkpoint_2-model_part-0-shard1.pt"
    resave(shard, lambda o: o["model"].update({k: v.half() for k, v in o["model"].items() if "flat_param" in k}))
    before = snapshot(d)
    with pytest.raises(CheckpointLayoutError, match=r"checkpoint_2-model_part-0-shard1\.pt: flat_param_0 is stored as "
                                                     r"float16 but checkpoint_2-model_part-0-shard0\.pt stores it as float32"):
        mo.inspect(d)
    with pytest.raises(CheckpointLayoutError, match="float16"):
        mo.load_state_dict(d)
    assert snapshot(d) == before


def test_one_model_part_in_another_dtype_is_refused(tmp_path):
    d = copy_set("mp2_ddp", tmp_path)
    resave(d / "checkpoint_2-model_part-1.pt",
           lambda o: o.update(model={k: v.half() if v.is_floating_point() else v for k, v in o["model"].items()}))
    before = snapshot(d)
    with pytest.raises(CheckpointLayoutError, match=r"checkpoint_2-model_part-1\.pt: decoder\.\S+ is stored as float16 "
                                                     r"in model part 1 but as float32 in part 0"):
        mo.inspect(d)
    assert snapshot(d) == before


def _fast(name: str, tmp_path) -> float:
    """What "fast" means on this machine, now: 20 times a successful inspect of the genuine
    set (after one to warm up), and never under 2 s. The refusals below read no more than
    that inspect does; work per claimed shard or part (a stat or an open of each missing
    name: some 17 us each, 17 s for a million) is far above the bound, while a loaded
    machine slows the inspect measured here as much as the refusal."""
    warm, genuine = copy_set(name, tmp_path / "warm"), copy_set(name, tmp_path / "genuine")
    mo.inspect(warm)
    t0 = time.perf_counter()
    mo.inspect(genuine)
    return max(2.0, 20 * (time.perf_counter() - t0))


def test_a_million_shards_claimed_gives_a_short_fast_message(tmp_path):
    d = tmp_path / "huge"
    d.mkdir()
    src = copy_set("fsdp_dp3", tmp_path) / "checkpoint_2-model_part-0-shard0.pt"
    shutil.copy(src, d / "checkpoint_2-model_part-0-shard0.pt")
    os.link(d / "checkpoint_2-model_part-0-shard0.pt", d / "checkpoint_2-model_part-0-shard999999.pt")
    fast = _fast("fsdp_dp3", tmp_path)
    t0 = time.perf_counter()
    with pytest.raises(CheckpointLayoutError, match=r"found shards 0,999999 of 1000000 \(missing "
                                                     r".*shard1\.pt, .*shard5\.pt \.\.\. and 999993 more\)") as err:
        mo.inspect(d)
    took = time.perf_counter() - t0
    assert took < fast, (took, fast)
    assert len(str(err.value)) < 1500


def test_a_million_parts_in_cfg_gives_a_short_message(tmp_path):
    d = copy_set("mp2_ddp", tmp_path)
    os.remove(d / "checkpoint_2-model_part-1.pt")  # part 0 alone: its tensors are half the model
    resave(d / "checkpoint_2-model_part-0.pt", lambda o: o["cfg"]["common"].update(model_parallel_size=10**6))
    fast = _fast("mp2_ddp", tmp_path)
    t0 = time.perf_counter()
    with pytest.raises(CheckpointLayoutError, match=r"common\.model_parallel_size=1000000 \(missing "
                                                     r".*model_part-1\.pt.* \.\.\. and 999994 more\)") as err:
        mo.inspect(d / "checkpoint_2-model_part-0.pt")
    took = time.perf_counter() - t0
    assert took < fast and len(str(err.value)) < 1500, (took, fast, len(str(err.value)))


def test_a_cfg_claiming_parts_the_tensors_show_complete_is_stale(tmp_path):
    d = copy_set("mp2_ddp", tmp_path)
    for m in (0, 1):
        resave(d / f"checkpoint_2-model_part-{m}.pt", lambda o: o["cfg"]["common"].update(model_parallel_size=4))
    layout = mo.inspect(d)  # fc1's rows over both parts are the model's ffn width: nothing is missing
    assert layout.model_parallel_size == 2 and "cfg.common.model_parallel_size" in layout.stale_metadata


def test_folder_of_broken_links_says_so_from_every_entry_point(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    os.symlink("/nonexistent/mount/checkpoint_2.pt", d / "checkpoint_last.pt")
    os.symlink("loop-b.pt", d / "loop-a.pt")
    os.symlink("loop-a.pt", d / "loop-b.pt")
    before = snapshot(d)
    expected = (r"holds 3 \*\.pt entries but none can be read: .*checkpoint_last\.pt: dangling link: "
                r".*-> /nonexistent/mount/checkpoint_2\.pt does not exist.*loop-a\.pt: symlink loop")
    for call in (mo.inspect, mo.load_state_dict, lambda p: mo.consolidate(p, tmp_path / "out.pt"),
                 lambda p: mo.verify(p, p), lambda p: mo.export_hf(p, tmp_path / "hf")):
        with pytest.raises(CheckpointNotFoundError, match=expected):
            call(d)
    cli = subprocess.run([sys.executable, "-m", "metaseq_oneload", "inspect", str(d)], capture_output=True, text=True)
    assert cli.returncode == 2 and "none can be read" in cli.stderr and "dangling link" in cli.stderr
    assert snapshot(d) == before
    assert not (tmp_path / "out.pt").exists() and not (tmp_path / "hf").exists()


def test_paths_are_shown_as_given_through_a_linked_folder(tmp_path):
    real = copy_set("fsdp_dp3", tmp_path)
    link = tmp_path / "shared-storage"
    os.symlink(real, link)
    layout = mo.inspect(link)
    assert layout.directory == str(link)
    assert all(f.path.startswith(str(link) + os.sep) for f in layout.all_files)
    assert all(e.path.startswith(str(link) + os.sep) for p in layout.parts for t in p.tensors.values()
               for e in t.extents)
    sd = mo.load_state_dict(link / "checkpoint_last-model_part-0-shard1.pt", verify=True)
    ref = mo.load_state_dict(real)
    assert all(torch.equal(sd[k], ref[k]) for k in ref)


def test_sets_of_two_saves_at_the_same_step_are_told_apart(tmp_path):
    """Two converts of one source: same step, same names, same sizes; only the save
    identity our writer puts in every file tells them apart (issue 10, item 10)."""
    for name in ("a", "b"):
        mo.convert(FIXTURES / "fsdp_dp3", tmp_path / name / "ck", shards=2, progress=False)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(tmp_path / "a" / "ck-model_part-0-shard0.pt", mixed)
    shutil.copy(tmp_path / "b" / "ck-model_part-0-shard1.pt", mixed)
    ids = [raw_load(mixed / f"ck-model_part-0-shard{d}.pt")["oneload_save"]["save_id"] for d in (0, 1)]
    assert ids[0] != ids[1]
    before = snapshot(mixed)
    with pytest.raises(CheckpointLayoutError, match=rf"files of different saves are mixed in one set \(num_updates=2, "
                                                     rf".*save {ids[0]}.*ck-model_part-0-shard0\.pt; .*save {ids[1]}"):
        mo.inspect(mixed)
    assert snapshot(mixed) == before


def test_shards_of_runs_with_other_world_sizes_are_told_apart(tmp_path):
    d = copy_set("fsdp_dp3", tmp_path)
    resave(d / "checkpoint_2-model_part-0-shard2.pt",
           lambda o: o["cfg"]["distributed_training"].update(distributed_world_size=6))
    with pytest.raises(CheckpointLayoutError, match=r"files of different saves are mixed .*world size 3: .*"
                                                     r"world size 6: checkpoint_2-model_part-0-shard2\.pt"):
        mo.inspect(d)
