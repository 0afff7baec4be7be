"""Tiny real Hugging Face folders and edited metaseq checkpoints for the Hugging Face tests.

Everything is built locally from configs (no Hub downloads): ``save_tiny_t5`` writes a T5
the way ``save_pretrained`` does (one ``model.safetensors``, a sharded index set, or
``pytorch_model.bin``) and returns the weights it saved, the oracle the tests compare to.
``edited_singleton`` rewrites the singleton fixture's cfg (or tensors), for the export
refusals; ``big_singleton`` writes a metaseq checkpoint of a few hundred MB with the
fixture's cfg, for the streaming and interruption checks.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path
from typing import Callable, Optional

import torch

from tests.conftest import FIXTURES

T5_TOKENS = torch.tensor([[5, 17, 9, 3, 44, 101, 7], [8, 2, 99, 12, 6, 1, 0]])
T5_LABELS = torch.tensor([[4, 11, 30, 1, 0], [9, 9, 2, 77, 1]])


def tiny_t5_config(**overrides):
    from transformers import T5Config

    kw = dict(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
              feed_forward_proj="gated-gelu", decoder_start_token_id=0, dropout_rate=0.0)
    kw.update(overrides)
    return T5Config(**kw)


def save_tiny_t5(folder, *, how: str = "single", seed: int = 0, **overrides) -> dict:
    """A tiny T5ForConditionalGeneration saved in ``folder``: ``how`` = "single"
    (model.safetensors), "sharded" (several files + index) or "bin" (pytorch_model.bin).
    Returns the saved weights (every state-dict name, tied ones included)."""
    from transformers import T5ForConditionalGeneration

    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(tiny_t5_config(**overrides)).eval()
    folder = Path(folder)
    if how == "single":
        model.save_pretrained(folder)
    elif how == "sharded":
        model.save_pretrained(folder, max_shard_size="20KB")
        assert (folder / "model.safetensors.index.json").exists()
    elif how == "bin":
        # transformers 5 writes safetensors only; older releases (and the Hub) still carry .bin
        model.save_pretrained(folder)
        os.remove(folder / "model.safetensors")
        # as older releases wrote it: every name, the tied ones sharing one storage
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    else:
        raise ValueError(how)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def rewrite_safetensors(folder, edit: Callable[[dict], dict]) -> None:
    """Apply ``edit`` to the tensors of a single-file folder (drop or add keys)."""
    from safetensors.torch import load_file, save_file

    path = Path(folder) / "model.safetensors"
    save_file(edit(dict(load_file(path))), path, metadata={"format": "pt"})


def _load_full(path) -> dict:
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu", weights_only=True)


def edited_singleton(dst_dir, *, cfg: Optional[dict] = None, drop=(), add: Optional[dict] = None) -> Path:
    """The singleton fixture with ``cfg.model`` attributes changed, tensors dropped or added,
    saved as ``dst_dir/checkpoint_2_consolidated.pt`` (returned)."""
    obj = _load_full(FIXTURES / "singleton" / "checkpoint_2_consolidated.pt")
    obj = dict(obj)
    obj["cfg"] = copy.deepcopy(obj["cfg"])
    for k, v in (cfg or {}).items():
        setattr(obj["cfg"]["model"], k, v)
    model = {k: v for k, v in obj["model"].items() if k not in drop}
    model.update(add or {})
    obj["model"] = model
    return _save_singleton(obj, dst_dir)


def big_singleton(dst_dir, *, dim: int = 1024, layers: int = 8, ffn: int = 4096, vocab: int = 8192,
                  positions: int = 2048) -> Path:
    """A metaseq singleton checkpoint of ``dim``/``layers`` (~400 MB at the defaults) with the
    fixture's cfg and uninitialised weights: for memory and interruption checks, not values."""
    obj = dict(_load_full(FIXTURES / "singleton" / "checkpoint_2_consolidated.pt"))
    obj["cfg"] = copy.deepcopy(obj["cfg"])
    m = obj["cfg"]["model"]
    m.decoder_embed_dim, m.decoder_ffn_embed_dim, m.decoder_layers = dim, ffn, layers
    m.decoder_attention_heads, m.max_target_positions = 16, positions
    obj["last_optimizer_state"] = {}
    sd = {"decoder.embed_tokens.weight": torch.empty(vocab, dim),
          "decoder.embed_positions.weight": torch.empty(positions + 2, dim),
          "decoder.layer_norm.weight": torch.ones(dim), "decoder.layer_norm.bias": torch.zeros(dim)}
    for i in range(layers):
        p = f"decoder.layers.{i}."
        for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):
            sd[p + f"self_attn.{proj}.weight"] = torch.empty(dim, dim)
            sd[p + f"self_attn.{proj}.bias"] = torch.zeros(dim)
        for ln in ("self_attn_layer_norm", "final_layer_norm"):
            sd[p + f"{ln}.weight"], sd[p + f"{ln}.bias"] = torch.ones(dim), torch.zeros(dim)
        sd[p + "fc1.weight"], sd[p + "fc1.bias"] = torch.empty(ffn, dim), torch.zeros(ffn)
        sd[p + "fc2.weight"], sd[p + "fc2.bias"] = torch.empty(dim, ffn), torch.zeros(dim)
    sd["decoder.version"] = torch.tensor([3.0])
    obj["model"] = sd
    return _save_singleton(obj, dst_dir)


def config_of(folder) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def _save_singleton(obj: dict, dst_dir) -> Path:
    dst = Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    out = dst / "checkpoint_2_consolidated.pt"
    torch.save(obj, out)
    return out
