"""Synthetic metaseq-format checkpoints for the benchmarks.

``write_singleton`` and ``write_flat_shards`` write a model with metaseq's names (fused
``qkv_proj``, tied ``output_projection``) exactly the way metaseq/fairscale lay files out:
one ``X.pt`` with an unflattened ``model``, or ``X-model_part-0-shard{d}.pt`` files holding
FSDP flat parameters (one per layer plus the root) and fairscale's ``shard_metadata``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.tiny_metaseq import TinyMetaseqLM  # noqa: E402  (a parametric module with metaseq's names)

# The shape of the benchmark model; scaled() picks its width.
GIB_MODEL = dict(dim=2048, ffn=8192, vocab=16384, layers=5, positions=2050)


def model_args(dim, ffn, vocab, layers, positions) -> argparse.Namespace:
    return argparse.Namespace(
        arch="transformer_lm_megatron", decoder_layers=layers, decoder_embed_dim=dim, decoder_ffn_embed_dim=ffn,
        decoder_attention_heads=max(1, dim // 64), decoder_learned_pos=True, share_decoder_input_output_embed=True,
        no_scale_embedding=True, activation_fn="relu", max_target_positions=positions - 2, dict_size=vocab,
    )


def build_model(**dims) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = TinyMetaseqLM(**dims)
    model.to_empty(device="cpu")
    model.decoder.output_projection.weight = model.decoder.embed_tokens.weight  # to_empty unties
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.05, 0.05)
    return model


def _cfg(dims: dict, shards: int) -> dict:
    return {
        "common": {"model_parallel_size": 1},
        "checkpoint": {"checkpoint_shard_count": 1},
        "distributed_training": {"use_sharded_state": shards > 1, "distributed_world_size": shards,
                                 "ddp_backend": "fully_sharded" if shards > 1 else "pytorch_ddp"},
        "model": model_args(**dims),
    }


def write_singleton(model: torch.nn.Module, path: str, dims: dict) -> None:
    sd = model.state_dict()
    torch.save({"model": sd, "cfg": _cfg(dims, 1), "optimizer_history": [{"num_updates": 0}]}, path)


def flat_groups(model: torch.nn.Module) -> list:
    """(fsdp_path, [(local name, tensor)]): each layer is one FSDP unit, the rest the root."""
    sd = model.state_dict()
    groups = []
    layer_prefixes = [f"decoder.layers.{i}" for i in range(len(model.decoder.layers))]
    for pre in layer_prefixes:
        groups.append((pre, [(k[len(pre) + 1:], v) for k, v in sd.items() if k.startswith(pre + ".")]))
    root = [(k, v) for k, v in sd.items()
            if not k.startswith("decoder.layers.") and k not in ("decoder.output_projection.weight", "decoder.version")]
    return [("", root)] + groups


def write_flat_shards(model: torch.nn.Module, prefix: str, shards: int, dims: dict) -> list:
    """fairscale local_state_dict shards with shard_metadata, one file per rank."""
    groups = flat_groups(model)
    models = [dict() for _ in range(shards)]
    metas = [{"param_metadata": [], "buffer_names": ["decoder.version"]} for _ in range(shards)]
    for fsdp_path, members in groups:
        flat = torch.cat([t.reshape(-1) for _, t in members])
        chunks = list(flat.chunk(shards))
        while len(chunks) < shards:
            chunks.append(chunks[0].new_empty(0))
        key = f"{fsdp_path}.flat_param_0" if fsdp_path else "flat_param_0"
        for d in range(shards):
            pad = chunks[0].numel() - chunks[d].numel()
            models[d][key] = F.pad(chunks[d], [0, pad]).clone()
            metas[d]["param_metadata"].append({
                "fsdp_path": fsdp_path,
                "params": {"flat_param_0": {"names": [n for n, _ in members], "shapes": [tuple(t.shape) for _, t in members],
                                            "numels": [t.numel() for _, t in members], "padding": pad}},
                "no_broadcast_optim_state": False,
                "shared_param_info": [("decoder.embed_tokens.weight", "decoder.output_projection.weight")] if not fsdp_path else [],
            })
        del flat, chunks
    paths = []
    for d in range(shards):
        models[d]["decoder.version"] = model.decoder.version.clone()
        path = f"{prefix}-model_part-0-shard{d}.pt"
        torch.save({"model": models[d], "shard_metadata": metas[d], "cfg": _cfg(dims, shards),
                    "optimizer_history": [{"num_updates": 0}]}, path)
        models[d] = None
        paths.append(path)
    return paths


def model_bytes(dims: dict) -> int:
    m = build_model(**dims)
    return sum(p.numel() * p.element_size() for p in m.parameters())


def param_count(dim, ffn, vocab, layers, positions) -> int:
    per_layer = 3 * dim * dim + 3 * dim + dim * dim + dim + 2 * dim * ffn + ffn + dim + 4 * dim
    return vocab * dim + positions * dim + 2 * dim + layers * per_layer


def scaled(gib: float) -> dict:
    """GIB_MODEL's shape with its width chosen so the fp32 model is closest to ``gib`` GiB."""
    target = gib * 2**30 / 4
    best = None
    for dim in range(64, 8192 + 1, 64):
        dims = dict(GIB_MODEL, dim=dim, ffn=4 * dim, vocab=max(256, dim * 8))
        err = abs(param_count(**dims) - target)
        if best is None or err < best[0]:
            best = (err, dims)
    return best[1]
