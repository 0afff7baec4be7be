"""``load_into(..., optimizer=)`` in one process: a DCP folder's Adam state (saved by FSDP2 on
2 ranks) onto a plain module, against torch's own recipe (``dcp.load`` into ``get_state_dict``
then ``set_state_dict``) in the same run; refusals for checkpoints without optimizer state,
metaseq trainer state, and pickled values outside plain data."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from metaseq_oneload import OptionError, StateDictMismatchError, UnsafeCheckpointError, load_into
from tests.conftest import FIXTURES, reference_weights
from tests.tiny_metaseq import TinyMetaseqLM

DCP = Path(__file__).resolve().parents[1] / "fixtures" / "dcp"
OPTIM = DCP / "fsdp2_optim"


def _adam(model):
    return torch.optim.Adam(model.parameters(), lr=5e-2)  # a different lr: the checkpoint's must win


def _grads(model) -> None:
    g = torch.Generator().manual_seed(7)
    for _, p in sorted(model.named_parameters()):
        p.grad = torch.randn(p.shape, generator=g)


def torch_way(path):
    """(model, optimizer) loaded the way torch's own recipe does."""
    model = TinyMetaseqLM()
    optim = _adam(model)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, optim


def assert_same(a_model, a_optim, b_model, b_optim) -> None:
    a, b = a_optim.state_dict(), b_optim.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["param_groups"][0]["lr"] == 1e-3
    assert set(a["state"]) == set(b["state"]) and len(a["state"]) == len(list(a_model.parameters()))
    for i in a["state"]:
        assert set(a["state"][i]) == {"step", "exp_avg", "exp_avg_sq"} == set(b["state"][i])
        for k, v in a["state"][i].items():
            assert v.dtype == b["state"][i][k].dtype and torch.equal(v, b["state"][i][k]), (i, k)
    for m, o in ((a_model, a_optim), (b_model, b_optim)):
        _grads(m)
        o.step()
    for (n, p), (n2, q) in zip(a_model.named_parameters(), b_model.named_parameters()):
        assert n == n2 and torch.equal(p.detach(), q.detach()), n


def test_plain_module_equals_torch_recipe():
    theirs_model, theirs = torch_way(OPTIM)
    model = TinyMetaseqLM()
    optim = _adam(model)
    report = load_into(model, OPTIM, optimizer=optim, no_dist=True)
    assert report.kind and report.bytes_read > 0
    assert not optim.state_dict()["state"][0]["exp_avg"].eq(0).all()
    assert_same(model, optim, theirs_model, theirs)


def test_verify_covers_the_state():
    model = TinyMetaseqLM()
    optim = _adam(model)
    load_into(model, OPTIM, optimizer=optim, no_dist=True, verify=True)
    theirs_model, theirs = torch_way(OPTIM)
    assert_same(model, optim, theirs_model, theirs)


def test_state_loads_after_an_adopting_rank_vouched_for_the_model_s_chunks_only():
    # A rank that adopted the model-only layout of this folder (another load in the same
    # process) recorded spans that hold none of the optimizer's chunks; the reads of the
    # state, on the reader's pool, fall back to parsing the items, never to a refusal.
    from metaseq_oneload import inspect
    from metaseq_oneload.formats.dcp import vouch_layout

    vouch_layout(inspect(OPTIM))
    model = TinyMetaseqLM()
    optim = _adam(model)
    load_into(model, OPTIM, optimizer=optim, no_dist=True)
    theirs_model, theirs = torch_way(OPTIM)
    assert_same(model, optim, theirs_model, theirs)


def test_no_optimizer_state_is_refused():
    model = TinyMetaseqLM()
    optim = _adam(model)
    with pytest.raises(OptionError, match=r"holds no optimizer state .*Leave out optimizer="):
        load_into(model, DCP / "fsdp2_w2", optimizer=optim, no_dist=True)
    assert not optim.state


@pytest.mark.skipif(not (FIXTURES / "reshard_unflat").is_dir(), reason="metaseq fixtures absent")
def test_metaseq_trainer_state_names_install():
    model = TinyMetaseqLM()
    optim = _adam(model)
    with pytest.raises(OptionError, match=r"metaseq set whose optimizer state .*install\(\)"):
        load_into(model, FIXTURES / "reshard_unflat", optimizer=optim, no_dist=True)
    with pytest.raises(OptionError, match=r"holds no optimizer state"):
        load_into(model, FIXTURES / "singleton", optimizer=optim, no_dist=True)


class _Boom:
    """Would leave a file behind if anything built it."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _save_with(tmp_path: Path, lr, edit=None) -> Path:
    model = TinyMetaseqLM()
    model.load_state_dict(reference_weights())
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    _grads(model)
    optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    optim_sd["param_groups"][0]["lr"] = lr
    if edit is not None:
        edit(optim_sd)
    out = tmp_path / "ckpt"
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(out), no_dist=True)
    return out


def test_param_groups_outside_plain_data_are_refused(tmp_path):
    marker = tmp_path / "built"
    path = _save_with(tmp_path, _Boom(str(marker)))
    model = TinyMetaseqLM()
    optim = _adam(model)
    with pytest.raises(UnsafeCheckpointError, match=r"optim\.param_groups\.0\.lr is not plain data"):
        load_into(model, path, optimizer=optim, no_dist=True)
    assert not marker.exists() and not optim.state


def test_state_shaped_unlike_its_parameter(tmp_path):
    def shrink(osd):
        osd["state"]["decoder.layers.0.fc1.bias"]["exp_avg"] = torch.zeros(5)

    path = _save_with(tmp_path, 1e-3, shrink)
    model = TinyMetaseqLM()
    optim = _adam(model)
    with pytest.raises(StateDictMismatchError, match=r"optimizer state does not match TinyMetaseqLM: shaped unlike "
                                                     r"its parameter: optim\.state\.decoder\.layers\.0\.fc1\.bias"
                                                     r"\.exp_avg: checkpoint \[5\] vs parameter .* \[64\]"):
        load_into(model, path, optimizer=optim, no_dist=True)
    assert not optim.state


def test_optimizer_over_other_parameters(tmp_path):
    model = TinyMetaseqLM()
    optim = _adam(TinyMetaseqLM())
    with pytest.raises(OptionError, match=r"parameter\(s\) that are not TinyMetaseqLM's"):
        load_into(model, OPTIM, optimizer=optim, no_dist=True)


def test_copied_folder_loads_the_same(tmp_path):
    # a folder elsewhere (its own path in the layout): the same state as torch's recipe reads
    dst = tmp_path / "copy"
    shutil.copytree(OPTIM, dst)
    model = TinyMetaseqLM()
    optim = _adam(model)
    load_into(model, os.fspath(dst), optimizer=optim, no_dist=True)
    theirs_model, theirs = torch_way(dst)
    assert_same(model, optim, theirs_model, theirs)


def test_a_shared_list_nested_deep_is_refused_at_once(tmp_path):
    # 40 copies of one list, 14 deep: 2.7 KB that torch.load builds in 1 ms, 40**14 paths to walk
    # (dcp.save itself would walk it: the item is appended to its file and the .metadata repointed)
    x = 0.001
    for _ in range(14):
        x = [x] * 40
    buf = io.BytesIO()
    torch.save(x, buf)
    path = _save_with(tmp_path, 1e-3)
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    for k, v in list(md.storage_data.items()):
        if k.fqn == "optim.param_groups.0.lr":
            end = os.path.getsize(path / v.relative_path)
            with open(path / v.relative_path, "ab") as f:
                f.write(buf.getvalue())
            md.storage_data[k] = dataclasses.replace(v, offset=end, length=len(buf.getvalue()))
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)
    model = TinyMetaseqLM()
    optim = _adam(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(UnsafeCheckpointError, match=r"optim\.param_groups\.0\.lr holds more than 100000 values"):
        load_into(model, path, optimizer=optim, no_dist=True)
    assert not optim.state
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def _unchanged(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("build, match", [
    (lambda m: torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9),
     r"SGD given: param group 0: keys \['amsgrad', 'betas'.* only in the checkpoint, \['dampening', 'momentum', "
     r"'nesterov'\] only in the SGD's"),
    (lambda m: torch.optim.Adam([{"params": list(m.parameters())[:5]}, {"params": list(m.parameters())[5:]}]),
     r"1 param group\(s\) in the checkpoint, 2 in the Adam"),
])
def test_param_groups_of_another_optimizer_are_refused_before_any_byte_moves(build, match):
    model = TinyMetaseqLM()
    optim = build(model)
    before = _unchanged(model)
    with pytest.raises(StateDictMismatchError, match=match):
        load_into(model, OPTIM, optimizer=optim, no_dist=True)
    assert not optim.state and all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_param_groups_naming_another_parameter_are_refused_before_any_byte_moves(tmp_path):
    def rename(osd):
        osd["param_groups"][0]["params"] = ["bogus.weight"] + osd["param_groups"][0]["params"][1:]

    path = _save_with(tmp_path, 1e-3, rename)
    model = TinyMetaseqLM()
    optim = _adam(model)
    before = _unchanged(model)
    with pytest.raises(StateDictMismatchError, match=r"param group 0: parameters bogus\.weight only in the checkpoint, "
                                                     r"decoder\.\S+ only in the optimizer"):
        load_into(model, path, optimizer=optim, no_dist=True)
    assert not optim.state and all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_flattened_optimizer_state_is_refused_by_name(tmp_path):
    # torchtitan's form: get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model = TinyMetaseqLM()
    model.load_state_dict(reference_weights())
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    _grads(model)
    optim.step()
    osd = get_optimizer_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True))
    assert any(k.startswith("state.") for k in osd)
    dcp.save({"model": model.state_dict(), "optimizer": osd}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    fresh = TinyMetaseqLM()
    with pytest.raises(OptionError, match=r"holds flattened optimizer state \(torchtitan's.*not read yet"):
        load_into(fresh, tmp_path / "ck", optimizer=_adam(fresh), no_dist=True)
