"""Synthetic metaseq checkpoints of any size, for benchmarks and for tests that need a big one.

:func:`write_metaseq` writes a full (unsplit) state dict with metaseq's names as M model-parallel
parts x D data-parallel shards, the way metaseq's trainer saves it:

* flat (``use_sharded_state``): ``P-model_part-{m}-shard{d}.pt``, fairscale flat params
  (each ``*.layers.N`` its own FSDP instance, the rest in the root's ``flat_param_0``,
  ``torch.chunk`` sharding, zero padding at the tail) with the matching ``shard_metadata``;
* unflattened: ``P-model_part-{m}.pt`` (``P.pt`` for one part), the tied output projection
  stored under its own name, sharing ``embed_tokens``' storage;

with ``cfg`` (plain dicts, ``cfg["model"]`` an ``argparse.Namespace``), ``optimizer_history``,
``extra_state`` and optionally a flat/unflat Adam ``last_optimizer_state``. Values of a
:class:`Lazy` tensor are produced chunk by chunk while writing (seeded per block of elements),
so a 10 GiB checkpoint costs a few chunks of memory to write (``torch.save`` under
``skip_data`` lays out the file; the bytes are ``pwrite``-n in place). Model-parallel splits
(Megatron's: fused qkv per part, column/row parallel, replicated) are computed here, not by
the package under test.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping, Optional, Union

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metaseq_oneload._outputs import OutputSet  # noqa: E402
from metaseq_oneload._writing import Record, storage_key, write_torch  # noqa: E402

__all__ = ["Lazy", "metaseq_lm", "model_shape", "write_metaseq", "materialize"]

_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")
_BLOCK = 1 << 16


@dataclass(frozen=True)
class Lazy:
    """A tensor of uniform values in +-``scale``, drawn in fixed blocks of elements from a
    generator seeded by (``seed``, block): any element range can be produced on its own,
    in any order, and always gives the same values."""

    shape: tuple
    dtype: torch.dtype = torch.float32
    seed: int = 0
    scale: float = 0.02

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape else 1

    def fill(self, out: torch.Tensor, start: int) -> None:
        """Elements ``start .. start + len(out)`` into 1-D ``out``, in place: fresh pages
        cost more than the arithmetic on some machines, so nothing is allocated per call
        beyond one block of scratch."""
        n = out.numel()
        dst = out if out.dtype == torch.float32 else torch.empty(n, dtype=torch.float32)
        pos = start
        while pos < start + n:
            block, within = divmod(pos, _BLOCK)
            take = min(_BLOCK - within, start + n - pos)
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + block)
            view = dst[pos - start: pos - start + take]
            if within == 0:
                torch.rand(take, generator=g, out=view)
            else:
                scratch = _scratch()
                torch.rand(within + take, generator=g, out=scratch[: within + take])
                view.copy_(scratch[within: within + take])
            pos += take
        dst.sub_(0.5).mul_(2 * self.scale)
        if dst is not out:
            out.copy_(dst)

    def values(self, start: int, n: int) -> torch.Tensor:
        out = torch.empty(n, dtype=self.dtype)
        self.fill(out, start)
        return out

    def materialize(self) -> torch.Tensor:
        return self.values(0, self.numel).view(self.shape)


Full = Mapping[str, Union[torch.Tensor, Lazy]]
_local = threading.local()


def _scratch() -> torch.Tensor:
    t = getattr(_local, "scratch", None)
    if t is None:
        t = _local.scratch = torch.empty(_BLOCK, dtype=torch.float32)
    return t


def _seed(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def metaseq_lm(layers: int, dim: int, ffn: int, vocab: int, positions: int = 2048, *,
               dtype: torch.dtype = torch.float32) -> "OrderedDict[str, Lazy]":
    """A metaseq decoder's full state dict (fused ``qkv_proj`` rows k, v, q; learned
    positions with metaseq's offset of 2), every tensor :class:`Lazy`. The output projection
    is tied to ``embed_tokens`` and not listed."""
    out: "OrderedDict[str, Lazy]" = OrderedDict()

    def add(name, *shape):
        out[name] = Lazy(tuple(shape), dtype, _seed(name))

    add("decoder.embed_tokens.weight", vocab, dim)
    add("decoder.embed_positions.weight", positions + 2, dim)
    for i in range(layers):
        p = f"decoder.layers.{i}."
        add(p + "self_attn.qkv_proj.weight", 3 * dim, dim)
        add(p + "self_attn.qkv_proj.bias", 3 * dim)
        add(p + "self_attn.out_proj.weight", dim, dim)
        add(p + "self_attn.out_proj.bias", dim)
        add(p + "self_attn_layer_norm.weight", dim)
        add(p + "self_attn_layer_norm.bias", dim)
        add(p + "fc1.weight", ffn, dim)
        add(p + "fc1.bias", ffn)
        add(p + "fc2.weight", dim, ffn)
        add(p + "fc2.bias", dim)
        add(p + "final_layer_norm.weight", dim)
        add(p + "final_layer_norm.bias", dim)
    add("decoder.layer_norm.weight", dim)
    add("decoder.layer_norm.bias", dim)
    return out


def model_shape(gib: float, dim: int = 2048) -> dict:
    """A metaseq-like decoder of about ``gib`` GiB in fp32 (width ``dim``, ffn 4 x dim,
    vocab 4 x dim, 2048 positions), with as many layers as that takes (at least one)."""
    ffn, vocab, positions = 4 * dim, 4 * dim, 2048
    per_layer = 4 * dim * dim + 2 * dim * ffn + 9 * dim + ffn
    fixed = (vocab + positions + 2) * dim + 2 * dim
    layers = max(1, round((gib * (1 << 30) / 4 - fixed) / per_layer))
    return dict(layers=layers, dim=dim, ffn=ffn, vocab=vocab, positions=positions)


def materialize(full: Full) -> "OrderedDict[str, torch.Tensor]":
    """Real tensors of a (small) full state dict."""
    return OrderedDict((k, v.materialize() if isinstance(v, Lazy) else v) for k, v in full.items())


# --------------------------------------------------------------------------- Megatron split


def _rule(name: str) -> str:
    if ".qkv_proj." in name:
        return "qkv"
    if name.endswith((".fc1.weight", ".fc1.bias", "embed_tokens.weight", "output_projection.weight")):
        return "column"
    if name.endswith((".out_proj.weight", ".fc2.weight")):
        return "row"
    return "replicated"


@dataclass(frozen=True)
class _Split:
    """Part ``part`` of ``parts`` of a full tensor, read element range by element range."""

    full: Union[torch.Tensor, Lazy]
    full_shape: tuple
    rule: str
    part: int
    parts: int

    @property
    def shape(self) -> tuple:
        s = list(self.full_shape)
        if self.parts > 1 and self.rule in ("qkv", "column"):
            s[0] //= self.parts
        elif self.parts > 1 and self.rule == "row":
            s[1] //= self.parts
        return tuple(s)

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape else 1

    def _full(self, out: torch.Tensor, start: int) -> None:
        if isinstance(self.full, Lazy):
            self.full.fill(out, start)
        else:
            out.copy_(self.full.reshape(-1)[start: start + out.numel()])

    def fill(self, out: torch.Tensor, start: int) -> None:
        n = out.numel()
        if self.parts == 1 or self.rule == "replicated":
            self._full(out, start)
            return
        inner = math.prod(self.full_shape[1:]) if len(self.full_shape) > 1 else 1
        if self.rule == "column":
            rows = self.full_shape[0] // self.parts
            self._full(out, self.part * rows * inner + start)
            return
        if self.rule == "qkv":
            e = self.full_shape[0] // 3
            per = e // self.parts
            block = per * inner
            pos = start
            while pos < start + n:
                j, within = divmod(pos, block)
                take = min(block - within, start + n - pos)
                src = (j * e + self.part * per) * inner + within
                self._full(out[pos - start: pos - start + take], src)
                pos += take
            return
        rows, cols = self.full_shape
        local = cols // self.parts
        pos = start
        while pos < start + n:
            r, c = divmod(pos, local)
            take = min(local - c, start + n - pos)
            self._full(out[pos - start: pos - start + take], r * cols + self.part * local + c)
            pos += take


@dataclass(frozen=True)
class _Piece:
    """``numel`` elements of a synthetic ``source`` from its element ``start``: an item of a
    :class:`Record` that :func:`_chunks` produces (no checkpoint to read from)."""

    source: object
    start: int
    numel: int


def _chunks(chunk_bytes: int):
    """The writer's ``chunks`` for records of :class:`_Piece` items, through one buffer."""
    buffer = torch.empty(chunk_bytes, dtype=torch.uint8)

    def chunks(rec: Record):
        item = torch.empty((), dtype=rec.dtype).element_size()
        per = max(1, chunk_bytes // item)
        for p in rec.items:
            for lo in range(0, p.numel, per):
                n = min(per, p.numel - lo)
                out = buffer[: n * item].view(rec.dtype)
                p.source.fill(out, p.start + lo)
                yield out

    return chunks


# --------------------------------------------------------------------------- files


def _cfg(model_parallel: int, shards: int, flat: bool, part: int, shard: int, tied: bool, layers: int) -> dict:
    return {
        "_name": None,
        "common": {"_name": None, "seed": 1, "fp16": False, "bf16": False, "model_parallel_size": model_parallel},
        "distributed_training": {"_name": None, "distributed_world_size": model_parallel * shards,
                                 "distributed_rank": shard * model_parallel + part, "device_id": 0,
                                 "ddp_backend": "fully_sharded" if flat else "pytorch_ddp",
                                 "use_sharded_state": flat},
        "checkpoint": {"_name": None, "checkpoint_shard_count": 1, "model_parallel_size": model_parallel,
                       "checkpoint_suffix": f"-model_part-{part}"},
        "model": argparse.Namespace(_name="transformer_lm_gpt2_synthetic", arch="transformer_lm_gpt2_synthetic",
                                    decoder_layers=layers, share_decoder_input_output_embed=tied,
                                    model_parallel_size=model_parallel, ddp_backend="fully_sharded" if flat else "pytorch_ddp",
                                    use_sharded_state=flat, distributed_world_size=model_parallel * shards),
        "task": {"_name": "dummy_lm"},
        "reshard": {"_name": None},
    }


def _shard(total: int, shard: int, shards: int) -> tuple:
    size = -(-total // shards)
    lo = min(total, shard * size)
    return lo, min(total, lo + size), size


def write_metaseq(prefix: str, full: Full, *, model_parallel: int = 1, shards: int = 1, flat: Optional[bool] = None,
                  tied: bool = True, optimizer: bool = False, num_updates: int = 10, chunk_mb: float = 16,
                  overwrite: bool = True) -> list:
    """Write ``full`` as ``model_parallel`` x ``shards`` metaseq files; returns their paths [part][shard].

    ``flat`` defaults to ``shards > 1``; unflattened files need ``shards == 1``. With
    ``optimizer`` every file also carries Adam state (``step``, ``exp_avg``, ``exp_avg_sq``)
    laid out like its parameters (flat per flat param, or per parameter), values :class:`Lazy`.
    """
    if flat is None:
        flat = shards > 1
    if not flat and shards != 1:
        raise ValueError("unflattened files hold one file per part: use shards=1 or flat=True")
    names = list(full)
    buffers = {"decoder.version": torch.tensor([3.0])}
    layers = len({m.group(1) for n in names if (m := _LAYER.match(n))})
    paths = []
    for m in range(model_parallel):
        if flat:
            row = [f"{prefix}-model_part-{m}-shard{d}.pt" for d in range(shards)]
        else:
            row = [f"{prefix}.pt" if model_parallel == 1 else f"{prefix}-model_part-{m}.pt"]
        paths.append(row)
    outputs = OutputSet([p for row in paths for p in row], overwrite=overwrite)
    outputs.check()
    try:
        for m in range(model_parallel):
            parts = OrderedDict((n, _Split(full[n], tuple(full[n].shape), _rule(n), m, model_parallel)) for n in names)
            opt_sources = {k: OrderedDict((n, _Split(Lazy(tuple(full[n].shape), torch.float32, _seed(n) + s, sc),
                                                     tuple(full[n].shape), _rule(n), m, model_parallel))
                                          for n in names)
                           for k, s, sc in (("exp_avg", 1, 1e-3), ("exp_avg_sq", 2, 1e-6))}
            # Flat groups: the root's params first, then one per layer, as fairscale orders them.
            root = [n for n in names if not _LAYER.match(n)]
            nested: "OrderedDict[str, list]" = OrderedDict()
            for n in names:
                if (g := _LAYER.match(n)):
                    nested.setdefault(g.group(1), []).append(n)
            groups = ([("", root)] if root else []) + list(nested.items())
            for d, path in enumerate(paths[m]):
                records: dict = {}
                model: "OrderedDict[str, torch.Tensor]" = OrderedDict()

                def placeholder(shape, dtype, pieces, pad=0):
                    t = torch.empty(shape, dtype=dtype)
                    records[storage_key(t)] = Record(tuple(pieces), dtype, pad)
                    return t

                def flat_shard(members, sources, dtype):
                    total = sum(sources[n].numel for n in members)
                    lo, hi, size = _shard(total, d, shards)
                    pieces, off = [], 0
                    for n in members:
                        k = sources[n].numel
                        a, b = max(lo, off), min(hi, off + k)
                        if a < b:
                            pieces.append(_Piece(sources[n], a - off, b - a))
                        off += k
                    return placeholder((size,), dtype, pieces, size - (hi - lo)), size - (hi - lo)

                meta = {"param_metadata": [], "buffer_names": list(buffers)}
                if flat:
                    for path_, members in groups:
                        dtype = full[members[0]].dtype
                        key = f"{path_}.flat_param_0" if path_ else "flat_param_0"
                        model[key], pad = flat_shard(members, parts, dtype)
                        cut = len(path_) + 1 if path_ else 0
                        meta["param_metadata"].append({
                            "fsdp_path": path_,
                            "params": {"flat_param_0": {"names": [n[cut:] for n in members],
                                                        "shapes": [parts[n].shape for n in members],
                                                        "numels": [parts[n].numel for n in members],
                                                        "padding": pad}},
                            "no_broadcast_optim_state": False,
                            "shared_param_info": ([("decoder.embed_tokens.weight", "decoder.output_projection.weight")]
                                                  if tied and not path_ else []),
                        })
                        if not path_:
                            model.update(buffers)
                    if not root:
                        model.update(buffers)
                else:
                    model.update(buffers)
                    for n in names:
                        p = parts[n]
                        model[n] = placeholder(p.shape, p.full.dtype, [_Piece(p, 0, p.numel)])
                    if tied:
                        model["decoder.output_projection.weight"] = model["decoder.embed_tokens.weight"]
                obj: dict = {
                    "cfg": _cfg(model_parallel, shards, flat, m, d, tied, layers),
                    "model": model,
                    "criterion": None,
                    "optimizer_history": [{"criterion_name": "VocabParallelCrossEntropyCriterion",
                                           "optimizer_name": "MetaseqAdam", "lr_scheduler_state": {"best": None},
                                           "num_updates": num_updates}],
                    "task_state": {},
                    "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": num_updates, "shuffle": True},
                                    "metrics": {}},
                }
                if optimizer:
                    state = {}
                    if flat:
                        for i, (_, members) in enumerate(groups):
                            state[i] = {"step": num_updates}
                            for k, srcs in opt_sources.items():
                                state[i][k] = flat_shard(members, srcs, torch.float32)[0]
                    else:
                        for i, n in enumerate(names):
                            state[i] = {"step": num_updates}
                            for k, srcs in opt_sources.items():
                                p = srcs[n]
                                state[i][k] = placeholder(p.shape, torch.float32, [_Piece(p, 0, p.numel)])
                    obj["last_optimizer_state"] = {
                        "state": state,
                        "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.98), "eps": 1e-8, "weight_decay": 0.0,
                                          "amsgrad": False, "params": list(range(len(state)))}],
                    }
                if flat:
                    obj["shard_metadata"] = meta
                write_torch(outputs.temp(path), obj, records, _chunks(int(chunk_mb * (1 << 20))))
        outputs.commit()
    except BaseException:
        outputs.abort()
        raise
    return paths


if __name__ == "__main__":
    import argparse as _ap

    ap = _ap.ArgumentParser(description="write a synthetic metaseq checkpoint")
    ap.add_argument("prefix")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--positions", type=int, default=128)
    ap.add_argument("--model-parallel", type=int, default=1)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--optimizer", action="store_true")
    a = ap.parse_args()
    out = write_metaseq(a.prefix, metaseq_lm(a.layers, a.dim, a.ffn, a.vocab, a.positions),
                        model_parallel=a.model_parallel, shards=a.shards, optimizer=a.optimizer)
    print("\n".join(p for row in out for p in row))
