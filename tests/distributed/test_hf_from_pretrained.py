"""`from_pretrained` on real gloo ranks: a tiny T5 written by save_pretrained (one
safetensors file or a sharded index set) loads as full weights on every rank, as FSDP2
shards (each rank holds only its shard; gathered, they are the saved weights; the sharded
model computes the same logits), onto ranks that cannot see the folder (the readers send it), and
through the documented FSDP1 recipe. Mismatched checkpoints raise on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_ranks
from tests.hf_tiny import T5_LABELS, T5_TOKENS, rewrite_safetensors, save_tiny_t5

pytest.importorskip("transformers")


def _saved(folder, how):
    """The folder written by save_pretrained, plus the oracle: saved weights and logits."""
    from transformers import T5ForConditionalGeneration

    saved = save_tiny_t5(folder, how=how)
    ref = T5ForConditionalGeneration.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = ref(input_ids=T5_TOKENS, labels=T5_LABELS).logits
    torch.save({"weights": saved, "logits": logits}, f"{folder}.oracle.pt")
    return str(folder)


def _compare(model, oracle) -> dict:
    """(collective under FSDP2: full_tensor gathers) Max abs diff per check."""
    from metaseq_oneload._into import is_dtensor as _is_dtensor

    sd = model.state_dict()
    assert set(sd) == set(oracle["weights"]), sorted(set(sd) ^ set(oracle["weights"]))
    weights = 0.0
    for k, v in oracle["weights"].items():
        got = sd[k].full_tensor() if _is_dtensor(sd[k]) else sd[k]
        weights = max(weights, float((got - v).abs().max()))
    shared = model.shared.weight
    tied = model.encoder.embed_tokens.weight is shared and model.decoder.embed_tokens.weight is shared
    # Before the forward: FSDP2 leaves the root's parameters unsharded after one.
    local = sum((p.to_local() if _is_dtensor(p) else p).numel() for p in model.parameters())
    with torch.no_grad():
        logits = model(input_ids=T5_TOKENS, labels=T5_LABELS).logits
    return {"weights": weights, "logits": float((logits - oracle["logits"]).abs().max()), "tied": tied,
            "local_numel": local, "total_numel": sum(v.numel() for k, v in oracle["weights"].items()
                                                     if k == "shared.weight" or not k.endswith(("embed_tokens.weight",
                                                                                                 "lm_head.weight")))}


def load_all_ways(rank, world, cases):
    """Each case: a folder, and the ranks that are told a path they cannot see."""
    from transformers import T5ForConditionalGeneration

    from metaseq_oneload import from_pretrained
    from metaseq_oneload.hf import fully_shard_blocks

    out = {}
    for name, folder, blind_ranks in cases:
        oracle = torch.load(f"{folder}.oracle.pt")
        path = "/nonexistent/oneload/t5" if rank in blind_ranks else folder
        model, report = from_pretrained(T5ForConditionalGeneration, path, return_report=True, bucket_mb=0.01)
        out[name] = {"unwrapped": {**_compare(model, oracle), "strategy": report.strategy, "read": report.bytes_read}}
        model, report = from_pretrained(T5ForConditionalGeneration, path, fsdp=fully_shard_blocks(),
                                        return_report=True, bucket_mb=0.01)
        out[name]["fsdp2"] = {**_compare(model, oracle), "strategy": report.strategy, "read": report.bytes_read}
    return out


WORLD = 3  # uneven FSDP2 shards: 32 rows over 3 ranks


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """One spawn of WORLD ranks for all the loading cases (starting ranks dominates the cost)."""
    tmp = tmp_path_factory.mktemp("hf_ranks")
    cases = [("single", _saved(tmp / "single", "single"), ()),
             ("sharded", _saved(tmp / "sharded", "sharded"), ()),
             ("blind", _saved(tmp / "blind", "single"), (1,))]
    results = run_ranks(WORLD, load_all_ways, cases, tmp_path=tmp, timeout=300)
    return {name: [r[name] for r in results] for name, _, _ in cases}


def _check(per_rank, unwrapped, fsdp2):
    for rank, r in enumerate(per_rank):
        for how, strategy in (("unwrapped", unwrapped), ("fsdp2", fsdp2)):
            got = r[how]
            assert got["weights"] == 0.0 and got["tied"], (rank, how, got)
            assert got["logits"] <= 1e-5, (rank, how, got)
            assert got["strategy"] == strategy, (rank, how, got)


@pytest.mark.parametrize("case", ["single", "sharded"])
def test_full_weights_on_every_rank(loaded, case):
    # Every rank wants the whole model, all on one node: each reads it through the node's
    # page cache (the storage serves it once), nothing is exchanged.
    _check(loaded[case], "reshard", "reshard")
    for r in loaded[case]:
        assert r["unwrapped"]["local_numel"] == r["unwrapped"]["total_numel"]
    total = loaded[case][0]["unwrapped"]["total_numel"]
    assert [r["unwrapped"]["read"] for r in loaded[case]] == [4 * total] * WORLD


@pytest.mark.parametrize("case", ["single", "sharded"])
def test_fsdp2_ranks_hold_and_read_only_their_shard(loaded, case):
    per_rank = loaded[case]
    total = per_rank[0]["unwrapped"]["total_numel"]
    assert sum(r["fsdp2"]["local_numel"] for r in per_rank) == total
    assert max(r["fsdp2"]["local_numel"] for r in per_rank) <= 1.5 * total / WORLD
    # Each rank read only the bytes of its shard: together one model (fp32).
    assert sum(r["fsdp2"]["read"] for r in per_rank) == 4 * total


def test_ranks_without_the_files_receive_from_the_readers(loaded):
    _check(loaded["blind"], "parallel", "parallel")
    assert loaded["blind"][1]["fsdp2"]["read"] == 0 and loaded["blind"][0]["fsdp2"]["read"] > 0


def mismatches(rank, world, folders):
    from transformers import T5ForConditionalGeneration

    from metaseq_oneload._errors import OneloadError
    from metaseq_oneload import from_pretrained
    from metaseq_oneload.hf import fully_shard_blocks

    out = []
    for folder, fsdp, blind in folders:
        path = "/nonexistent/oneload/t5" if rank in blind else folder
        try:
            from_pretrained(T5ForConditionalGeneration, path, fsdp=fully_shard_blocks() if fsdp else None)
            out.append(None)
        except OneloadError as e:
            out.append([type(e).__name__, str(e)])
        dist.barrier()  # every rank is still in step after the error
    return out


def fsdp1_recipe(rank, world, folder):
    """docs/huggingface.md, "FSDP1": every rank builds the empty model and wraps it; rank 0
    alone reads the checkpoint; torch broadcasts it into the shards."""
    import functools

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import T5ForConditionalGeneration
    from transformers.models.t5.modeling_t5 import T5Block

    import metaseq_oneload as oneload
    from metaseq_oneload.hf import empty_model, fsdp1_param_init_fn

    device = torch.device("cpu")
    model = empty_model(T5ForConditionalGeneration, folder)  # every rank: parameters on meta
    full = {}
    if rank == 0:
        oneload.load_into(model, folder, no_dist=True)  # rank 0 alone reads, once
        full = model.state_dict()  # every name, tied ones included
    model = FSDP(model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={T5Block}),
                 device_id=device, param_init_fn=fsdp1_param_init_fn(model, device))
    # strict=False: torch broadcasts each tensor once, so the tied names arrive as one.
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                               strict=False))
    del full
    oracle = torch.load(f"{folder}.oracle.pt")
    got = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    with torch.no_grad():
        logits = model(input_ids=T5_TOKENS, labels=T5_LABELS).logits
    return {"weights": max(float((got[k] - v).abs().max()) for k, v in oracle["weights"].items() if k in got),
            "names": len(got), "logits": float((logits - oracle["logits"]).abs().max())}


def cpu_offload(rank, world, folder):
    """FSDP2 with CPUOffloadPolicy: parameters materialised on CPU. This machine has no GPU,
    so for the device choice the mesh is made to say "cuda" and load_into is stopped before
    it reads; the load itself runs on the CPU mesh."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    from transformers import T5ForConditionalGeneration

    from metaseq_oneload import _hf
    from metaseq_oneload._into import is_dtensor as _is_dtensor

    class Stop(Exception):
        pass

    seen, placed, meshes = [], [], []

    def stop_before_reading(model, path, **kw):
        seen.append(str(kw["device"]))
        placement = getattr(_hf, "_placement", None)  # (parameters, buffers)
        placed.append([str(d) for d in placement(model, None)] if placement else None)
        raise Stop

    def on_cuda_mesh(**kw):
        def apply(model):
            _hf.fully_shard_blocks(**kw)(model)
            mesh = next(p for p in model.parameters() if _is_dtensor(p)).device_mesh
            meshes.append(mesh)
            mesh._device_type = "cuda"  # what a CUDA mesh says
            return model

        return apply

    out = {}
    real_load, real_current = _hf.load_into, torch.cuda.current_device
    _hf.load_into, torch.cuda.current_device = stop_before_reading, (lambda: 0)
    try:
        for kw in ({"offload_policy": CPUOffloadPolicy()}, {}):
            try:
                _hf.from_pretrained(T5ForConditionalGeneration, folder, fsdp=on_cuda_mesh(**kw))
            except Stop:
                pass
            finally:
                meshes.pop()._device_type = "cpu"
        try:
            _hf.from_pretrained(T5ForConditionalGeneration, folder, device="cuda",
                                fsdp=on_cuda_mesh(offload_policy=CPUOffloadPolicy()))
        except (Stop, ValueError) as e:
            out["explicit"] = [type(e).__name__, str(e)]
        finally:
            meshes.pop()._device_type = "cpu"
    finally:
        _hf.load_into, torch.cuda.current_device = real_load, real_current
    out["devices"], out["placed"] = seen, placed
    model = _hf.from_pretrained(T5ForConditionalGeneration, folder,
                                fsdp=_hf.fully_shard_blocks(offload_policy=CPUOffloadPolicy(pin_memory=False)))
    out["local_devices"] = sorted({str(p.to_local().device) for p in model.parameters() if _is_dtensor(p)})
    out["loaded"] = _compare(model, torch.load(f"{folder}.oracle.pt"))
    return out


def two_rank_checks(rank, world, mismatch_cases, fsdp1_folder):
    return {"mismatch": mismatches(rank, world, mismatch_cases), "fsdp1": fsdp1_recipe(rank, world, fsdp1_folder),
            "offload": cpu_offload(rank, world, fsdp1_folder)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_two")
    missing, extra, gone = tmp / "missing", tmp / "extra", tmp / "gone"
    save_tiny_t5(missing)
    rewrite_safetensors(missing, lambda sd: {k: v for k, v in sd.items() if k != "encoder.final_layer_norm.weight"})
    save_tiny_t5(extra)
    rewrite_safetensors(extra, lambda sd: {**sd, "classifier.weight": torch.ones(2, 32)})
    cases = [(str(missing), True, ()), (str(extra), False, (1,)), (str(gone), False, ())]
    return run_ranks(2, two_rank_checks, cases, _saved(tmp / "t5", "sharded"), tmp_path=tmp, timeout=300)


def test_mismatches_raise_on_every_rank(two_ranks):
    for rank, r in enumerate(two_ranks):
        r = r["mismatch"]
        assert r[0][0] == "StateDictMismatchError", (rank, r[0])
        assert "missing from the checkpoint: encoder.final_layer_norm.weight" in r[0][1]
        assert r[1][0] == "StateDictMismatchError" and "not in the model: classifier.weight" in r[1][1], (rank, r[1])
        # rank 0 cannot find the folder: every rank hears why.
        assert r[2][0] == "DistributedLoadError", (rank, r[2])
        assert "rank 0: CheckpointNotFoundError" in r[2][1] and "no such file or folder" in r[2][1]


def test_fsdp1_recipe(two_ranks):
    for r in two_ranks:
        r = r["fsdp1"]
        assert r["weights"] == 0.0 and r["logits"] <= 1e-5 and r["names"] >= 50, r


def test_fsdp2_cpu_offload_materialises_on_cpu(two_ranks):
    """fully_shard_blocks(offload_policy=CPUOffloadPolicy()) on a CUDA mesh: the parameters
    are materialised on CPU (FSDP2 raises on the first forward otherwise), the buffers go to
    the mesh's GPU; without offloading both go to the GPU. An explicit GPU device under CPU
    offload is refused before anything is read."""
    for r in two_ranks:
        r = r["offload"]
        assert r["devices"] == ["cpu", "cuda:0"], r["devices"]  # where load_into materialises
        assert r["placed"] == [["cpu", "cuda:0"], ["cuda:0", "cuda:0"]], r["placed"]  # (parameters, buffers)
        assert r["explicit"][0] == "ValueError" and "device=cuda, but the FSDP2 modules offload their parameters to " \
            "CPU (CPUOffloadPolicy)" in r["explicit"][1], r["explicit"]
        assert r["local_devices"] == ["cpu"]
        assert r["loaded"]["weights"] == 0.0 and r["loaded"]["logits"] <= 1e-5 and r["loaded"]["tied"], r["loaded"]
