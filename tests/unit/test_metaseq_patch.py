"""install() against the real metaseq, on real gloo ranks: metaseq's own entry points load
every layout through the engine and reproduce the logits metaseq itself produced
(reference_logits.pt).

metaseq is not on PyPI; these tests run where it is importable (installed from its
repository) and skip otherwise. On a CPU-only torch metaseq needs
tests/integration_shims/metaseq_cpu_shim.py, whose own fixes for torch.load's weights_only and for
fairscale's load_local_state_dict are taken back here: install() must provide both.
"""

import importlib.util
import os
import sys

import pytest
import torch

from tests.conftest import FIXTURES, REPO, needs_fixtures
from tests.distributed.harness import run_ranks

# Run-time fixes for metaseq on Python 3.11, a CPU-only torch and fairscale 0.4.13 (see its docstring).
SHIM = REPO / "tests" / "integration_shims" / "metaseq_cpu_shim.py"


def _why_not() -> str:
    spec = importlib.util.find_spec("metaseq")
    if spec is None or not spec.submodule_search_locations or not any(
            os.path.exists(os.path.join(p, "checkpoint_utils.py")) for p in spec.submodule_search_locations):
        return "metaseq is not importable here (it is not on PyPI; install it from its repository, see tests/integration/README.md)"
    if importlib.util.find_spec("fairscale") is None:
        return "metaseq needs fairscale"
    if not torch.cuda.is_available() and not SHIM.exists():
        return f"metaseq on a CPU-only torch needs {SHIM}"
    return ""


pytestmark = [needs_fixtures, pytest.mark.skipif(bool(_why_not()), reason=_why_not() or "metaseq available")]


def import_metaseq() -> None:
    """metaseq on this machine's torch: the CPU shim, whose own fixes for torch.load's
    weights_only and for fairscale's load_local_state_dict are taken back (install() must
    provide both)."""
    if not torch.cuda.is_available():
        sys.path.insert(0, str(SHIM.parent))
        import metaseq_cpu_shim as shim

        shim._F2.load_local_state_dict = shim._orig_lsd
        torch.serialization.clear_safe_globals()
    importlib.import_module("metaseq")


def setup_metaseq(model_parallel: int) -> None:
    """(every rank) What metaseq's distributed_init does after init_process_group."""
    import_metaseq()
    from metaseq.distributed import utils as distributed_utils
    from metaseq.modules.megatron import global_vars
    from metaseq.modules.megatron.mpu import initialize_model_parallel, model_parallel_cuda_manual_seed

    distributed_utils._USE_MEGATRON = True
    initialize_model_parallel(model_parallel)
    model_parallel_cuda_manual_seed(1)
    if global_vars._GLOBAL_MEMORY_BUFFER is None:
        global_vars._set_global_memory_buffer()


def logits_diff(model, name: str) -> float:
    from metaseq.distributed import utils as distributed_utils

    ref = torch.load(FIXTURES / name / "reference_logits.pt", weights_only=True)
    model.eval()
    with torch.no_grad():
        got = model(ref["tokens"])[0]
    want = ref["logits"]
    if got.shape[-1] != want.shape[-1]:  # vocab-parallel output: this rank's slice
        n, r = got.shape[-1], distributed_utils.get_model_parallel_rank()
        want = want[..., r * n:(r + 1) * n]
    return float((got - want).abs().max())


def install_worker(rank: int, world: int) -> dict:
    setup_metaseq(1)
    from metaseq import checkpoint_utils, file_io, hub_utils, trainer
    from metaseq.distributed import fully_sharded_data_parallel as fsdp_module
    from metaseq.distributed import utils as distributed_utils
    from metaseq_oneload import integrations

    singleton = str(FIXTURES / "singleton" / "checkpoint_2_consolidated.pt")
    names = [(checkpoint_utils, "load_checkpoint_to_cpu"), (checkpoint_utils, "load_model_ensemble_and_task"),
             (checkpoint_utils, "load_checkpoint"), (checkpoint_utils, "torch_load_cpu"), (file_io, "torch_load_cpu"),
             (trainer.Trainer, "load_checkpoint"), (hub_utils.GeneratorInterface, "load_model"),
             (distributed_utils, "broadcast_object"), (distributed_utils, "call_main"),
             (fsdp_module.FullyShardedDataParallel, "load_state_dict")]
    before = [getattr(t, n) for t, n in names]
    out = {}
    try:
        checkpoint_utils.load_model_ensemble_and_task([singleton], suffix="")
        out["before"] = "loaded"
    except Exception as e:  # torch >= 2.6 refuses the Namespace in every metaseq checkpoint
        out["before"] = type(e).__name__
    out["first_install"] = integrations.install()
    out["second_install"] = integrations.install({"strategy": "reshard"})
    out["patched"] = [getattr(t, n) is not b for (t, n), b in zip(names, before)]
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([singleton])
    out["singleton"] = logits_diff(models[0], "singleton")
    # the un-suffixed name, and metaseq's model-part suffix that this file does not have
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task(
        [str(FIXTURES / "shard_only" / "checkpoint_2.pt")], suffix="-model_part-0")
    out["shard_only"] = logits_diff(models[0], "shard_only")
    state = file_io.torch_load_cpu(singleton)
    out["torch_load_cpu"] = sorted(state)
    out["uninstall"] = [integrations.uninstall(), integrations.uninstall()]
    out["restored"] = [getattr(t, n) is b for (t, n), b in zip(names, before)]
    out["safe_globals_after"] = len(torch.serialization.get_safe_globals())
    return out


def test_install_is_idempotent_reversible_and_loads_split_qkv(tmp_path):
    out = run_ranks(1, install_worker, tmp_path=tmp_path, timeout=240)[0]
    assert out["before"] in ("UnpicklingError", "RuntimeError")
    assert out["first_install"] is True and out["second_install"] is False
    assert all(out["patched"]) and all(out["restored"]) and out["uninstall"] == [True, False]
    assert out["singleton"] <= 1e-5 and out["shard_only"] <= 1e-5
    assert "cfg" in out["torch_load_cpu"] and "model" in out["torch_load_cpu"]
    assert out["safe_globals_after"] == 0  # exactly what was there before install()


def fsdp_worker(rank: int, world: int) -> dict:
    """The padded 3-shard checkpoint onto 2 FSDP ranks, before any forward."""
    setup_metaseq(1)
    from metaseq import checkpoint_utils
    from metaseq.dataclass.configs import DistributedTrainingConfig
    from metaseq.distributed import fsdp_enable_wrap, fsdp_wrap
    from metaseq.distributed import utils as distributed_utils
    from metaseq_oneload import integrations
    from tests.conftest import reference_part, reference_weights
    from tests.distributed.workers import check_flat

    integrations.install()
    path = str(FIXTURES / "fsdp_dp3" / "checkpoint_last.pt")
    # (fp16/bf16 default to interpolations of common.*, which a bare dataclass cannot resolve)
    dt = DistributedTrainingConfig(distributed_world_size=world, ddp_backend="fully_sharded", use_sharded_state=True,
                                   fp16=False, bf16=False, memory_efficient_fp16=False)
    with fsdp_enable_wrap(dt, use_sharded_state=True):
        models, _, _ = checkpoint_utils.load_model_ensemble_and_task(
            [path], build_model_hook=lambda cfg, task: fsdp_wrap(task.build_model(cfg.model)))
    out = {"model": type(models[0]).__name__, "logits": logits_diff(models[0], "fsdp_dp3")}
    state = checkpoint_utils.load_checkpoint_to_cpu(path)
    dp = distributed_utils.get_data_parallel_group()
    check_flat(state["model"], state["shard_metadata"], reference_part(reference_weights(), 0, 1), dp, rank, world)
    out["flat_shards_equal_fairscale"] = True
    sizes = {k: v.numel() for k, v in state["model"].items() if "flat_param" in k}
    opt = state["last_optimizer_state"]["state"]
    out["optimizer_matches_shards"] = [v["exp_avg"].numel() for k, v in sorted(opt.items())] == list(sizes.values())
    out["cfg"] = type(state["cfg"]).__name__
    return out


def test_padded_three_shards_onto_two_fsdp_ranks(tmp_path):
    for out in run_ranks(2, fsdp_worker, tmp_path=tmp_path, timeout=240):
        assert out["model"] == "FullyShardedDataParallel"
        assert out["logits"] <= 1e-5
        assert out["flat_shards_equal_fairscale"] and out["optimizer_matches_shards"]
        assert out["cfg"] == "DictConfig"


def model_parallel_worker(rank: int, world: int) -> dict:
    setup_metaseq(2)
    from metaseq import checkpoint_utils
    from metaseq_oneload import integrations

    integrations.install()
    out = {}
    for name in ("mp2_ddp", "mp2_dp2"):  # unflattened parts, and flat parts of 2 shards each
        models, _, _ = checkpoint_utils.load_model_ensemble_and_task([str(FIXTURES / name)])
        out[name] = logits_diff(models[0], name)
    return out


def test_model_parallel_parts(tmp_path):
    for out in run_ranks(2, model_parallel_worker, tmp_path=tmp_path, timeout=240):
        assert out["mp2_ddp"] <= 1e-5 and out["mp2_dp2"] <= 1e-5


def named_file_worker(rank: int, world: int, tmp: str) -> dict:
    """A script outside a trainer, no model-parallel groups: a named part file reads as
    metaseq reads it; the folder (or un-suffixed name) gives the whole model."""
    import_metaseq()
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
    from metaseq import checkpoint_utils

    from metaseq_oneload import integrations
    from metaseq_oneload._convert import convert
    from tests.conftest import assert_matches_reference, raw_load, reference_part, reference_weights
    from tests.unit.test_convert import _equal

    integrations.install()
    out = {}
    part1 = FIXTURES / "mp2_ddp" / "checkpoint_2-model_part-1.pt"
    state, raw = checkpoint_utils.load_checkpoint_to_cpu(str(part1)), raw_load(part1)
    out["part1_fc1"] = list(state["model"]["decoder.layers.0.fc1.weight"].shape)
    _equal(dict(state["model"]), dict(raw["model"]), "model")  # the file's own tensors, names, order
    _equal(state["last_optimizer_state"], raw["last_optimizer_state"], "optimizer")
    _equal(state["extra_state"]["rng_tracker_states"], raw["extra_state"]["rng_tracker_states"], "rng")
    out["part1_cfg"] = type(state["cfg"]).__name__
    # The whole set: merged weights, the optimizer state merged like them, no RNG state of
    # the saved model-parallel ranks (none of them is this process's).
    whole = checkpoint_utils.load_checkpoint_to_cpu(str(FIXTURES / "mp2_ddp"))
    out["whole_fc1"] = list(whole["model"]["decoder.layers.0.fc1.weight"].shape)
    out["whole_rng"] = "rng_tracker_states" in whole["extra_state"]
    merged = convert(FIXTURES / "mp2_ddp", os.path.join(tmp, "one", "ck"), model_parallel=1, progress=False)
    _equal(whole["last_optimizer_state"], raw_load(merged.files[0])["last_optimizer_state"], "merged optimizer")
    # metaseq's consolidated singleton: split k/v/q fused as every metaseq model names them.
    single = checkpoint_utils.load_checkpoint_to_cpu(str(FIXTURES / "singleton" / "checkpoint_2_consolidated.pt"))
    names = list(single["model"])
    out["single_fused"] = any(n.endswith("qkv_proj.weight") for n in names) and not any("k_proj" in n for n in names)
    # A flat shard of part 1: that part's shards merged for this one data-parallel rank
    # (metaseq merges them too), not the whole model; its own RNG state kept.
    shard = FIXTURES / "mp2_dp2" / "checkpoint_2-model_part-1-shard0.pt"
    flat = checkpoint_utils.load_checkpoint_to_cpu(str(shard))
    full = FSDP.consolidate_shard_weights([flat["model"]], [flat["shard_metadata"]])
    assert_matches_reference(full, {k: v for k, v in reference_part(reference_weights(), 1, 2).items()
                                    if k != "decoder.output_projection.weight"})
    _equal(flat["extra_state"]["rng_tracker_states"], raw_load(shard)["extra_state"]["rng_tracker_states"], "rng")
    out["flat_opt"] = [v["exp_avg"].numel() for _, v in sorted(flat["last_optimizer_state"]["state"].items())] == [
        t.numel() for k, t in flat["model"].items() if "flat_param" in k]
    return out


def test_a_named_file_reads_as_metaseq_reads_it(tmp_path):
    out = run_ranks(1, named_file_worker, str(tmp_path), tmp_path=tmp_path, timeout=240)[0]
    assert out["part1_fc1"] == [32, 34] and out["part1_cfg"] == "DictConfig"
    assert out["whole_fc1"] == [64, 34] and out["whole_rng"] is False
    assert out["single_fused"] and out["flat_opt"]


def hub_utils_worker(rank: int, world: int) -> dict:
    import importlib.abc
    import logging

    import_metaseq()
    from metaseq_oneload import integrations

    class Failing(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "metaseq.hub_utils":
                raise RuntimeError("CUDA driver not found")  # not an ImportError
            return None

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("metaseq_oneload").addHandler(handler)
    sys.modules.pop("metaseq.hub_utils", None)
    sys.meta_path.insert(0, Failing())
    out = {"installed": integrations.install()}
    out["warning"] = [r.getMessage() for r in records if "hub_utils" in r.getMessage()]
    from metaseq import checkpoint_utils

    out["rest_patched"] = checkpoint_utils.load_checkpoint_to_cpu.__module__ == "metaseq_oneload.integrations.metaseq"
    return out


def test_any_failure_of_hub_utils_leaves_the_rest_patched(tmp_path):
    out = run_ranks(1, hub_utils_worker, tmp_path=tmp_path, timeout=240)[0]
    assert out["installed"] is True and out["rest_patched"]
    assert out["warning"] and "RuntimeError: CUDA driver not found" in out["warning"][0]
    assert "GeneratorInterface.load_model is not patched" in out["warning"][0]


def test_no_metaseq_option_is_a_prefix_of_a_loading_flag():
    """explicit_settings() reads argparse abbreviations without the parser; that is exact
    only if no metaseq option is a strict prefix of one of the four flags (then argparse
    would take that option, not ours)."""
    import_metaseq()
    from metaseq import options

    from metaseq_oneload._hydra import SETTINGS, explicit_settings

    strings = set()
    for parser in (options.get_training_parser(), options.get_validation_parser(), options.get_generation_parser(),
                   options.get_eval_lm_parser()):
        strings |= set(parser._option_string_actions)
    for s in SETTINGS:
        assert s.flag in strings
        assert not [o for o in strings if s.flag.startswith(o) and o != s.flag], s.flag
    assert explicit_settings(["--model-parallel", "2"], options=strings) == {"common.model_parallel_size"}
