"""Shards of two different runs that stopped at the same update number are not one set
(issue 21, class 6).

metaseq/fairseq files carry no save identity, and two runs of one config agree on the
update count, the epoch, the data position and the world size. What the ranks of one save
share beyond that are all-reduced values in ``extra_state``: ``previous_training_time``
(equal across the shards of a model part), the train ``loss`` meter and ``ewm_loss``.

The two runs here are real metaseq training runs of the same model, data and world size
(tests/fixtures/metaseq/train_ema and train_mefp16, 2 updates, 2 FSDP ranks each); the
second run's shard is re-saved with its flat parameters in float32 (as the first run keeps
them) so that nothing but the save tells the two apart.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import metaseq_oneload as mo

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metaseq"
RUN_A = FIXTURES / "train_ema"
RUN_B = FIXTURES / "train_mefp16"
NAME = "checkpoint_2-model_part-0-shard{}.pt"


def _mixed(tmp_path: Path) -> Path:
    folder = tmp_path / "mixed"
    folder.mkdir()
    shutil.copy(RUN_A / NAME.format(0), folder / NAME.format(0))
    other = torch.load(RUN_B / NAME.format(1), weights_only=False, map_location="cpu")
    other["model"] = {k: v.float() if v.is_floating_point() else v for k, v in other["model"].items()}
    torch.save(other, folder / NAME.format(1))
    return folder / NAME.format(0)


def test_shards_of_two_runs_at_the_same_update_are_refused(tmp_path):
    path = _mixed(tmp_path)
    with pytest.raises(mo.CheckpointLayoutError) as e:
        mo.inspect(str(path))
    msg = str(e.value)
    assert "files of different saves are mixed" in msg
    assert NAME.format(0) in msg and NAME.format(1) in msg and "previous_training_time" in msg
    with pytest.raises(mo.CheckpointLayoutError, match="files of different saves are mixed"):
        mo.load_state_dict(str(path))


def test_the_shards_of_one_run_still_load(tmp_path):
    """The same two files, each beside its own run's other shard: one save, loads."""
    for run in (RUN_A, RUN_B):
        folder = tmp_path / run.name
        folder.mkdir()
        for d in (0, 1):
            shutil.copy(run / NAME.format(d), folder / NAME.format(d))
        sd = mo.load_state_dict(str(folder / NAME.format(0)))
        ref = mo.load_state_dict(str(run / NAME.format(0)))
        assert set(sd) == set(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)


def test_a_set_we_wrote_from_model_parts_with_their_own_meters_loads(tmp_path):
    """convert takes each output's meters from a source file, and model parts keep their own
    previous_training_time: its outputs carry a save identity, which decides."""
    src = FIXTURES / "mp2_ddp" / "checkpoint_2-model_part-0.pt"
    mo.convert(str(src), str(tmp_path / "out" / "ck"), model_parallel=1, shards=2)
    sd = mo.load_state_dict(str(tmp_path / "out" / "ck-model_part-0-shard0.pt"))
    ref = mo.load_state_dict(str(src.parent / "checkpoint_2_consolidated.pt")) if (
        src.parent / "checkpoint_2_consolidated.pt").exists() else None
    assert sd and (ref is None or set(sd) == set(ref))


def test_shards_of_two_runs_in_an_object_store_are_refused(tmp_path, monkeypatch):
    """The values are read from each object's own bytes (a few bytes per file), as locally."""
    from metaseq_oneload import _storage
    from tests.s3_server import S3Endpoint

    path = _mixed(tmp_path)
    ep = S3Endpoint()
    try:
        url = ep.upload(path.parent, "ckpt", "mixed")
        for k, v in ep.env().items():
            monkeypatch.setenv(k, v)
        _storage.reset_stats()
        with pytest.raises(mo.CheckpointLayoutError, match="files of different saves are mixed") as e:
            mo.inspect(url.rstrip("/") + "/" + NAME.format(0))
        assert "previous_training_time" in str(e.value)
    finally:
        ep.stop()


# --------------------------------------------------------------------------- across model parts
# ewm_loss and the loss meter are all-reduced over each part's own data-parallel group: equal
# to the last bit is likely, not guaranteed. Across parts they are compared with a relative
# tolerance of 1e-6 (a few float32 ulps); within one part's shards previous_training_time
# (one average, broadcast) stays exact.
MP2 = FIXTURES / "mp2_ddp"
PART = "checkpoint_2-model_part-{}.pt"


def _parts(tmp_path: Path, edit) -> Path:
    folder = tmp_path / "parts"
    folder.mkdir()
    shutil.copy(MP2 / PART.format(0), folder / PART.format(0))
    obj = torch.load(MP2 / PART.format(1), weights_only=False, map_location="cpu")
    edit(obj["extra_state"])
    torch.save(obj, folder / PART.format(1))
    return folder / PART.format(0)


def _loss_meter(extra: dict) -> dict:
    return next(e[3] for e in extra["metrics"]["train"] if e[1] == "loss")


def test_model_parts_whose_meters_differ_by_rounding_are_one_save(tmp_path):
    import math

    def ulp_apart(extra):
        extra["ewm_loss"] = math.nextafter(extra["ewm_loss"], math.inf)
        meter = _loss_meter(extra)
        s = meter["sum"]
        meter["sum"] = torch.nextafter(s, s + 1)
        assert meter["sum"].item() != s.item()

    path = _parts(tmp_path, ulp_apart)
    layout = mo.inspect(str(path))
    assert len(layout.files) == 2
    sd = mo.load_state_dict(str(path), no_dist=True)
    ref = mo.load_state_dict(str(MP2 / PART.format(0)), no_dist=True)
    assert set(sd) == set(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)


@pytest.mark.parametrize("what", ["ewm_loss", "train loss meter"])
def test_model_parts_whose_meters_differ_are_refused_with_the_values(tmp_path, what):
    # as far apart as the two real runs RUN_A and RUN_B of one model, data and world size
    # (ewm_loss 6.233474032 / 6.233213995, loss sum 797.8847 / 797.8514: 4e-5 relative)
    ratio = 6.233213994501808 / 6.233474032269913

    def other_run(extra):
        if what == "ewm_loss":
            extra["ewm_loss"] = extra["ewm_loss"] * ratio
        else:
            _loss_meter(extra)["sum"] = _loss_meter(extra)["sum"] * ratio

    path = _parts(tmp_path, other_run)
    with pytest.raises(mo.CheckpointLayoutError) as e:
        mo.inspect(str(path))
    msg = str(e.value)
    assert "files of different saves are mixed" in msg and what in msg
    assert PART.format(0) in msg and PART.format(1) in msg
    assert "1e-06" in msg and "move" in msg


def test_the_shards_of_one_part_agree_exactly_on_previous_training_time(tmp_path):
    """One average broadcast to one part's data-parallel ranks: no tolerance there."""
    import math

    folder = tmp_path / "shards"
    folder.mkdir()
    shutil.copy(RUN_A / NAME.format(0), folder / NAME.format(0))
    obj = torch.load(RUN_A / NAME.format(1), weights_only=False, map_location="cpu")
    obj["extra_state"]["previous_training_time"] = math.nextafter(obj["extra_state"]["previous_training_time"], 0)
    torch.save(obj, folder / NAME.format(1))
    with pytest.raises(mo.CheckpointLayoutError, match="previous_training_time"):
        mo.inspect(str(folder / NAME.format(0)))
