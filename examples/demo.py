"""The README's demo: a tiny checkpoint in every layout, inspected, then loaded on 2 and 3
CPU ranks (torchrun, gloo) through every strategy.

    make demo            # or: .venv/bin/python examples/demo.py [--keep DIR]

1. Builds a tiny metaseq-style model (fused qkv_proj, tied output projection) and saves it
   as one file, the way metaseq's consolidation leaves it.
2. Rewrites it in every layout with ``metaseq-oneload convert`` (model-parallel parts, FSDP
   flat shards with shard_metadata, both at once, and fairseq's ``-shard{d}`` and
   ``_part{k}`` namings) and ``inspect``s each: the table shows what the files say, with no flags.
3. Runs ``examples/demo_load.py`` under ``torchrun --standalone`` on 2 and on 3 ranks: every
   layout, every strategy, flat and unflattened; each rank checks what it got against the
   original weights and measures its peak RSS.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from argparse import Namespace

import torch

import metaseq_oneload as oneload

DIM, FFN, HEADS, LAYERS, VOCAB, POSITIONS = 32, 64, 4, 2, 64, 18

# name -> (model parallel, shards, flat): the layouts metaseq and fairseq write.
LAYOUTS = {
    "model_parallel_2": (2, 1, False),
    "fsdp_1x3": (1, 3, True),
    "fsdp_2x2": (2, 2, True),
    "fsdp_1x4": (1, 4, True),
}


def tiny_state_dict() -> dict:
    torch.manual_seed(0)
    sd = {"decoder.embed_tokens.weight": torch.randn(VOCAB, DIM) * 0.1,
          "decoder.embed_positions.weight": torch.randn(POSITIONS, DIM) * 0.1}
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."
        sd.update({
            p + "self_attn.qkv_proj.weight": torch.randn(3 * DIM, DIM) * 0.1, p + "self_attn.qkv_proj.bias": torch.randn(3 * DIM) * 0.1,
            p + "self_attn.out_proj.weight": torch.randn(DIM, DIM) * 0.1, p + "self_attn.out_proj.bias": torch.randn(DIM) * 0.1,
            p + "self_attn_layer_norm.weight": torch.ones(DIM), p + "self_attn_layer_norm.bias": torch.zeros(DIM),
            p + "fc1.weight": torch.randn(FFN, DIM) * 0.1, p + "fc1.bias": torch.randn(FFN) * 0.1,
            p + "fc2.weight": torch.randn(DIM, FFN) * 0.1, p + "fc2.bias": torch.randn(DIM) * 0.1,
            p + "final_layer_norm.weight": torch.ones(DIM), p + "final_layer_norm.bias": torch.zeros(DIM),
        })
    sd["decoder.layer_norm.weight"] = torch.ones(DIM)
    sd["decoder.layer_norm.bias"] = torch.zeros(DIM)
    sd["decoder.version"] = torch.tensor([3.0])
    return sd


def write_singleton(path: str) -> None:
    args = Namespace(arch="transformer_lm_megatron", decoder_layers=LAYERS, decoder_embed_dim=DIM,
                     decoder_ffn_embed_dim=FFN, decoder_attention_heads=HEADS, decoder_learned_pos=True,
                     share_decoder_input_output_embed=True, no_scale_embedding=True, activation_fn="relu",
                     max_target_positions=POSITIONS - 2)
    cfg = {"common": {"model_parallel_size": 1}, "checkpoint": {"checkpoint_shard_count": 1},
           "distributed_training": {"use_sharded_state": False, "distributed_world_size": 1, "ddp_backend": "pytorch_ddp"},
           "model": args, "reshard": {}}
    torch.save({"model": tiny_state_dict(), "cfg": cfg, "optimizer_history": [{"num_updates": 10}],
                "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": 10}}}, path)


def write_fairseq_styles(root: str) -> None:
    """The two fairseq namings of FSDP shards: ``X-shard{d}.pt`` (as metaseq's reshard_fsdp
    also writes) and ``X_part{k}.pt`` (checkpoint_shard_count > 1, metadata under
    ``fsdp_metadata``), made from the 1x2 flat conversion."""
    src = os.path.join(root, "fsdp_1x2")
    oneload.convert(os.path.join(root, "singleton"), os.path.join(src, "checkpoint_10"), model_parallel=1, shards=2,
                    flat=True, overwrite=True, progress=False)
    for name in ("fairseq_shards", "fairseq_parts"):
        os.makedirs(os.path.join(root, name), exist_ok=True)
    for d in range(2):
        part = os.path.join(src, f"checkpoint_10-model_part-0-shard{d}.pt")
        shutil.copy(part, os.path.join(root, "fairseq_shards", f"checkpoint_10-shard{d}.pt"))
        state = torch.load(part, weights_only=False)  # our own file, written just above
        state["fsdp_metadata"] = state.pop("shard_metadata")
        torch.save(state, os.path.join(root, "fairseq_parts", f"checkpoint_10_part{d}.pt"))
    shutil.rmtree(src)


def table(rows, header) -> str:
    rows = [[str(c) for c in r] for r in [header] + rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="metaseq-oneload demo")
    ap.add_argument("--keep", help="write the checkpoints here and keep them")
    ap.add_argument("--worlds", default="2,3")
    args = ap.parse_args(argv)
    root = args.keep or tempfile.mkdtemp(prefix="oneload-demo-")
    try:
        os.makedirs(os.path.join(root, "singleton"), exist_ok=True)
        single = os.path.join(root, "singleton", "checkpoint_10.pt")
        write_singleton(single)
        for name, (m, d, flat) in LAYOUTS.items():
            oneload.convert(single, os.path.join(root, name, "checkpoint_10"), model_parallel=m, shards=d, flat=flat,
                            overwrite=True, progress=False)
        write_fairseq_styles(root)

        print(f"1. A tiny checkpoint in every layout, written to {root}, as `metaseq-oneload inspect` sees it:\n")
        rows = []
        names = ["singleton"] + list(LAYOUTS) + ["fairseq_shards", "fairseq_parts"]
        for name in names:
            lay = oneload.inspect(os.path.join(root, name))
            files = sorted(os.path.basename(f.path) for f in lay.all_files)
            rows.append([name, lay.kind, lay.model_parallel_size, lay.shards_per_part, "yes" if lay.flat else "no",
                         lay.saved_world_size, f"{lay.num_params:,}", f"{files[0]}{' ...' if len(files) > 1 else ''}"])
        print(table(rows, ["layout", "kind", "model parallel", "shards/part", "flat", "saved world", "params", "files"]))

        print("\n2. Loaded on several CPU ranks (torchrun --standalone, gloo), every strategy:\n")
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        loader = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_load.py")
        for world in [int(w) for w in args.worlds.split(",")]:
            cmd = [torchrun, "--standalone", f"--nproc_per_node={world}", loader, root, *names]
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if r.returncode:
                print(r.stdout + r.stderr, file=sys.stderr)
                return r.returncode
            print(r.stdout)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
