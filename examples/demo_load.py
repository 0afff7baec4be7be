"""Run by examples/demo.py under ``torchrun --standalone --nproc_per_node W``.

Every rank loads every layout through every strategy (flat FSDP shards and unflattened
weights), checks the result against the original singleton weights and measures its own
peak RSS; rank 0 prints one table row per load.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import metaseq_oneload as oneload


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _expected_flat(ref: dict, metadata: dict, key: str, rank: int, world: int) -> torch.Tensor:
    for pm in metadata["param_metadata"]:
        for flat_name, v in pm["params"].items():
            if (f"{pm['fsdp_path']}.{flat_name}" if pm["fsdp_path"] else flat_name) != key:
                continue
            names = [f"{pm['fsdp_path']}.{n}" if pm["fsdp_path"] else n for n in v["names"]]
            full = torch.cat([ref[n].flatten() for n in names])
            # fairscale's sharding, written out as the independent check: torch.chunk into
            # ceil(n / world) pieces, the tail zero-padded.
            size = -(-full.numel() // world)
            piece = full[rank * size:(rank + 1) * size]
            return torch.cat([piece, full.new_zeros(size - piece.numel())])
    raise KeyError(key)


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root, names = sys.argv[1], sys.argv[2:]
    group = dist.group.WORLD
    ref = oneload.load_state_dict(os.path.join(root, "singleton"), no_dist=True)  # local, no collectives
    wrapping = oneload.inspect(os.path.join(root, "fsdp_1x3")).header()["shard_metadata"]
    rows = []
    for name in names:
        layout = oneload.inspect(os.path.join(root, name))
        for flat in (False, True):
            for strategy in ("auto", "own_shard", "reshard", "broadcast"):
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                base = _kib("VmRSS")
                try:
                    lc = oneload.load_checkpoint(os.path.join(root, name), process_group=group, flat=flat,
                                                 strategy=strategy, verify=True,
                                                 shard_metadata=None if layout.flat else wrapping)
                except oneload.OneloadError as e:
                    if strategy == "own_shard" and "needs the saved layout to match" in str(e):
                        rows.append([name, world, "yes" if flat else "no", strategy, "-", "n/a (layout != world)", "", ""])
                        continue
                    raise
                peak = _kib("VmHWM") - base
                if flat:
                    diff = max(float((t - _expected_flat(ref, lc.shard_metadata, k, rank, world)).abs().max())
                               if k.endswith("flat_param_0") else float((t - ref[k]).abs().max())
                               for k, t in lc.model.items())
                else:
                    diff = max(float((lc.model[k] - ref[k]).abs().max()) for k in ref)
                stats = torch.tensor([diff, float(peak)], dtype=torch.float64)
                dist.all_reduce(stats, op=dist.ReduceOp.MAX)
                ok = stats[0].item() == 0.0 and lc.report.verified
                rows.append([name, world, "yes" if flat else "no", strategy, lc.report.strategy,
                             "ok" if ok else "MISMATCH", f"{stats[0].item():.1e}", f"{int(stats[1].item())} KiB"])
                if not ok:
                    raise SystemExit(f"{name} {strategy} flat={flat}: max abs diff {stats[0].item()}")
    if rank == 0:
        header = ["layout", "world", "flat", "strategy", "chosen", "ok", "max abs diff", "peak RSS (max rank)"]
        cells = [[str(c) for c in r] for r in [header] + rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
        for i, r in enumerate(cells):
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
            if i == 0:
                print("  ".join("-" * w for w in widths))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
