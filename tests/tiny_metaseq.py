"""A module with the parameter names and shapes of metaseq's tiny fixture model
(transformer_lm_gpt2_tiny, 2 layers, dim 34, ffn 64, vocab 64, 18 positions), with
output_projection tied to embed_tokens, for load_into tests. Model parallel size ``mp``
splits it the Megatron way. No forward: end-to-end checks use Hugging Face OPT."""

from __future__ import annotations

import torch
from torch import nn


class _Layer(nn.Module):
    def __init__(self, dim: int, ffn: int, mp: int):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = nn.Linear(dim, 3 * dim // mp)
        self.self_attn.out_proj = nn.Linear(dim // mp, dim)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ffn // mp)
        self.fc2 = nn.Linear(ffn // mp, dim)
        self.final_layer_norm = nn.LayerNorm(dim)


class TinyMetaseqLM(nn.Module):
    def __init__(self, mp: int = 1, dim: int = 34, ffn: int = 64, vocab: int = 64, layers: int = 2, positions: int = 18):
        super().__init__()
        self.decoder = nn.Module()
        self.decoder.embed_tokens = nn.Embedding(vocab // mp, dim)
        self.decoder.embed_positions = nn.Embedding(positions, dim)
        self.decoder.layers = nn.ModuleList(_Layer(dim, ffn, mp) for _ in range(layers))
        self.decoder.layer_norm = nn.LayerNorm(dim)
        self.decoder.output_projection = nn.Linear(dim, vocab // mp, bias=False)
        self.decoder.output_projection.weight = self.decoder.embed_tokens.weight
        self.decoder.register_buffer("version", torch.tensor([3.0]))


def sharded_on_meta(mesh, **dims) -> TinyMetaseqLM:
    """The model built on ``meta`` and sharded with FSDP2 over ``mesh``, each layer its own
    unit and the root holding the rest (as metaseq wraps it); nothing allocated yet."""
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = TinyMetaseqLM(**dims)
    for layer in model.decoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
