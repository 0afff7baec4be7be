"""examples/fsdp_t5 trains the same on its first run as on later ones: building the tiny T5
(first run only, rank 0 only) leaves the global random stream that dropout draws from as
it was, and what it builds is the same every time."""

import importlib.util

import pytest
import torch

from tests.conftest import REPO

pytest.importorskip("transformers")


def _example():
    spec = importlib.util.spec_from_file_location("t5_training_example", REPO / "examples" / "fsdp_t5" / "T5_training.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_building_the_tiny_model_leaves_the_global_rng_alone(tmp_path):
    example = _example()
    torch.manual_seed(1)  # what every rank does with --seed 1
    before = torch.random.get_rng_state()
    example.tiny_t5(tmp_path / "a")
    assert torch.equal(torch.random.get_rng_state(), before)
    example.tiny_t5(tmp_path / "b")
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
