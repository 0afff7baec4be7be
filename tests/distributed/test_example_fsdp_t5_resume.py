"""examples/fsdp_t5 resumes from its own sharded save onto another world: 2 gloo ranks
set the model up as the example does, change its weights (scaled by -1.5, so they differ
from the pretrained ones; no training step, for speed), save with the example's ``save_model_sharded`` (FSDP1 SHARDED_STATE_DICT, as PyTorch's
example saves; and FSDP2), then 3 ranks (FSDP2) start with ``--resume-from`` each folder. Gathered, the resumed weights equal what was saved, read back
by torch's own ``dcp_to_torch_save``, bit for bit."""

from __future__ import annotations

import argparse
import importlib.util

import pytest
import torch

from tests.conftest import REPO
from tests.distributed.harness import run_ranks

pytest.importorskip("transformers")

SCALE = -1.5


def _example():
    spec = importlib.util.spec_from_file_location("t5_training_example", REPO / "examples" / "fsdp_t5" / "T5_training.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(**kw) -> argparse.Namespace:
    base = dict(fsdp=2, every_rank_loads=False, bf16=False, cpu_offload=False, resume_from=None)
    return argparse.Namespace(**{**base, **kw})


def save_sharded(rank, world, model_name, cases):
    """Each case (fsdp, folder): the pretrained tiny T5 set up as the example does, its
    parameters scaled, saved with the example's own sharded save."""
    example = _example()
    for fsdp, folder in cases:
        model = example.setup_model(_args(fsdp=fsdp), model_name, torch.device("cpu"))
        with torch.no_grad():
            for p in model.parameters():  # FSDP1 flat parameters or FSDP2 DTensors: elementwise either way
                p.mul_(SCALE)
        example.save_model_sharded(_args(fsdp=fsdp), model, folder)
    return True


def resume(rank, world, model_name, cases):
    """Each case (fsdp, folder): ``--resume-from folder``, then the full weights, gathered the
    example's own way (``full_cpu_state_dict``: rank 0 gets them)."""
    example = _example()
    out = []
    for fsdp, folder in cases:
        model = example.setup_model(_args(fsdp=fsdp, resume_from=folder), model_name, torch.device("cpu"))
        sd = example.full_cpu_state_dict(_args(fsdp=fsdp), model)
        if rank == 0:
            torch.save({k: v.detach().clone() for k, v in sd.items()}, f"{folder}.resumed-w{world}.pt")
        out.append(type(model).__name__)
    return out


def _saved_by_torch(folder, tmp_path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dst = tmp_path / "torch-read.pt"
    dcp_to_torch_save(folder, dst)
    return torch.load(dst, weights_only=True)["model"]


def test_resume_from_a_sharded_save_onto_another_world(tmp_path):
    from safetensors.torch import load_file

    example = _example()
    model_name = str(tmp_path / "t5-tiny")
    example.tiny_t5(model_name)
    pretrained = load_file(tmp_path / "t5-tiny" / "model.safetensors")
    fsdp1, fsdp2 = str(tmp_path / "saved-fsdp1"), str(tmp_path / "saved-fsdp2")
    run_ranks(2, save_sharded, model_name, [(1, fsdp1), (2, fsdp2)], tmp_path=tmp_path)
    run_ranks(3, resume, model_name, [(2, fsdp1), (2, fsdp2)], tmp_path=tmp_path)

    for folder, worlds in ((fsdp1, (3,)), (fsdp2, (3,))):
        saved = _saved_by_torch(folder, tmp_path)
        # What was saved is the scaled pretrained model (tied embeddings under every name).
        assert torch.equal(saved["shared.weight"], pretrained["shared.weight"] * SCALE)
        assert torch.equal(saved["encoder.embed_tokens.weight"], saved["shared.weight"])
        for world in worlds:
            resumed = torch.load(f"{folder}.resumed-w{world}.pt", weights_only=True)
            assert set(resumed) == set(saved), sorted(set(resumed) ^ set(saved))
            for k, v in saved.items():
                assert torch.equal(resumed[k], v), (folder, world, k, float((resumed[k] - v).abs().max()))
            assert not torch.equal(resumed["shared.weight"], pretrained["shared.weight"])
