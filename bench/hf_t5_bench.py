"""Benchmark (not a test): loading a ~250M-parameter T5 (~1 GiB fp32) onto 4 ranks.

Compares the PyTorch FSDP T5 example as written (every rank calls
``T5ForConditionalGeneration.from_pretrained``) with ``metaseq_oneload.from_pretrained``,
unwrapped and sharded with FSDP2 ``fully_shard`` (every T5Block, then the root), on CPU
with gloo. For each rank: the peak resident memory above its baseline (the high-water mark
is reset through ``/proc/self/clear_refs`` after imports and process-group setup, then
VmHWM is read after the load), what it holds after the load, and the wall time of the load.
Then every parameter is written once, as the first optimizer step will, and the peak and
the private (anonymous) memory are read again: transformers 5 memory-maps safetensors, so
its load alone looks cheap until the weights are written and each rank copies them.

    .venv/bin/python bench/hf_t5_bench.py            # ~5 minutes on 2 cores, ~10 GiB RAM at peak
    .venv/bin/python bench/hf_t5_bench.py --ranks 2 --d-ff 1024   # smaller, faster

The model is built from a T5Config (flan-t5-base shaped, d_ff widened to reach ~1 GiB) and
saved once with save_pretrained under bench/out/ (git-ignored); no downloads.
Target: with FSDP2, the sum over ranks of (peak - baseline) <= 1.25x the model's bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._report import proc_status  # noqa: E402

MODES = {
    "hf": "every rank T5ForConditionalGeneration.from_pretrained (the example as written)",
    "hf+fsdp2": "every rank from_pretrained, then fully_shard",
    "ours": "oneload.from_pretrained, unwrapped (each rank reads its copy once)",
    "ours+fsdp2": "oneload.from_pretrained(fsdp=fully_shard_blocks()): each rank reads its shard",
    "ours+fsdp2/bcast": "the same, rank 0 reads and broadcasts (32 MiB buckets)",
}


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS


def _worker(rank: int, world: int, init_file: str, mode: str, folder: str, queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch
        import torch.distributed as dist
        from transformers import T5ForConditionalGeneration

        from metaseq_oneload import from_pretrained
        from metaseq_oneload.hf import fully_shard_blocks
        from metaseq_oneload._into import is_dtensor as _is_dtensor

        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        gc.collect()
        dist.barrier()
        _reset_peak()
        base, base_anon = proc_status("VmHWM"), proc_status("RssAnon")
        dist.barrier()
        t0 = time.perf_counter()
        if mode.startswith("hf"):
            model = T5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
            if mode == "hf+fsdp2":
                model = fully_shard_blocks()(model)
        elif mode == "ours":
            model = from_pretrained(T5ForConditionalGeneration, folder, dtype=torch.float32)
        else:
            model = from_pretrained(T5ForConditionalGeneration, folder, dtype=torch.float32, fsdp=fully_shard_blocks(),
                                    **({"strategy": "broadcast", "bucket_mb": 32} if mode.endswith("bcast") else {}))
        gc.collect()
        dist.barrier()
        seconds = time.perf_counter() - t0
        peak = proc_status("VmHWM")
        locals_ = [p.to_local() if _is_dtensor(p) else p for p in model.parameters()]
        held = sum(t.numel() * t.element_size() for t in locals_)
        # What training will own: the first optimizer step writes every parameter, and a
        # memory-mapped weight (transformers 5 maps safetensors) becomes a private copy then.
        with torch.no_grad():
            for t in locals_:
                t.add_(0)
        gc.collect()
        dist.barrier()
        queue.put({"rank": rank, "base": base, "base_anon": base_anon, "peak": peak, "peak_written": proc_status("VmHWM"),
                   "anon_written": proc_status("RssAnon"), "held": held, "seconds": seconds})
        dist.destroy_process_group()
    except BaseException as e:  # the parent reports it
        import traceback

        queue.put({"rank": rank, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})


def run_mode(mode: str, folder: str, world: int) -> list:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, world, os.path.join(tmp, "store"), mode, folder, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = [queue.get(timeout=1800) for _ in procs]
        for p in procs:
            p.join()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"{mode}: " + "\n".join(errors))
    return sorted(results, key=lambda r: r["rank"])


def build_model(folder: str, d_ff: int) -> int:
    """Save the benchmark T5 once; returns its parameter bytes."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=32128, d_model=768, d_kv=64, d_ff=d_ff, num_layers=12, num_decoder_layers=12,
                      num_heads=12, feed_forward_proj="gated-gelu", decoder_start_token_id=0)
    marker = os.path.join(folder, "config.json")
    if os.path.exists(marker) and json.load(open(marker)).get("d_ff") == d_ff:
        from metaseq_oneload import inspect

        return inspect(folder).total_bytes
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config)
    model.save_pretrained(folder)
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    gc.collect()
    return n


def gib(n: float) -> str:
    return f"{n / (1 << 30):.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--d-ff", type=int, default=2816, help="T5 feed-forward width (2816: ~267M params, ~1 GiB)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES))
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "t5-bench"))
    parser.add_argument("--json", action="store_true", help="also print the raw per-rank numbers as JSON")
    args = parser.parse_args()

    os.makedirs(args.out, exist_ok=True)
    t = time.perf_counter()
    model_bytes = build_model(args.out, args.d_ff)
    print(f"model: T5 d_model 768, d_ff {args.d_ff}, 12+12 layers, vocab 32128: {model_bytes / 4 / 1e6:.0f}M params, "
          f"{gib(model_bytes)} GiB fp32 ({args.out}, ready in {time.perf_counter() - t:.0f}s); {args.ranks} ranks, "
          "gloo on CPU", flush=True)
    rows, raw = [], {}
    for mode in args.modes.split(","):
        results = run_mode(mode, os.path.abspath(args.out), args.ranks)
        raw[mode] = results
        above = [r["peak"] - r["base"] for r in results]
        written = [r["peak_written"] - r["base"] for r in results]
        private = sum(r["anon_written"] - r["base_anon"] for r in results)
        rows.append([mode, " ".join(gib(a) for a in above), gib(sum(above)), f"{sum(above) / model_bytes:.2f}x",
                     f"{sum(written) / model_bytes:.2f}x", f"{private / model_bytes:.2f}x", gib(results[0]["held"]),
                     f"{max(r['seconds'] for r in results):.1f}"])
        print(f"  {mode}: done", flush=True)
    header = ["mode", "load peak above baseline, per rank (GiB)", "sum (GiB)", "sum / model",
              "sum / model, after first write", "private after first write / model", "rank 0 holds (GiB)", "wall (s)"]
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    print()
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")
    print()
    for mode in args.modes.split(","):
        print(f"  {mode}: {MODES[mode]}")
    if args.json:
        print(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
