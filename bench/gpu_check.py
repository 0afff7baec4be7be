"""GPU placement check (not a test: CI has no GPU). Run on a machine with CUDA:

    ONELOAD_FIXTURES=/path/to/shared/fixtures/metaseq python3 bench/gpu_check.py

Checks that weights land on the GPU correctly through every path that touches a CUDA
destination: a meta-built module materialised on cuda, a module already on cuda (with a
model-parallel merge, so column blocks are staged), a bf16 flat shard on cuda, an FSDP2
module on a one-rank NCCL mesh (DTensor shards on cuda, the NCCL collective device), and two
gloo ranks sharing the GPU (broadcast and scatter into cuda tensors through CPU staging).
``--device cpu`` runs the same script on CPU, to check the script itself.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import metaseq_oneload as oneload  # noqa: E402
from tests.conftest import FIXTURES, assert_matches_reference, reference_weights  # noqa: E402
from tests.tiny_metaseq import TinyMetaseqLM, sharded_on_meta  # noqa: E402


def _on(sd: dict, device: str) -> None:
    bad = [k for k, v in sd.items() if v.device.type != device]
    assert not bad, f"not on {device}: {bad[:3]}"


def single(device: str) -> list:
    ref = reference_weights()
    out = []
    with torch.device("meta"):
        model = TinyMetaseqLM()
    oneload.load_into(model, FIXTURES / "fsdp_dp3", device=device, verify=True)
    _on(model.state_dict(), device)
    assert model.decoder.output_projection.weight is model.decoder.embed_tokens.weight
    assert_matches_reference({k: v.cpu() for k, v in model.state_dict().items()}, ref)
    out.append("meta module materialised on the device (fsdp_dp3, reshard)")

    model = TinyMetaseqLM().to(device)
    oneload.load_into(model, FIXTURES / "mp2_dp2", verify=True)  # model-parallel 2 -> 1: column blocks staged
    _on(model.state_dict(), device)
    assert_matches_reference({k: v.cpu() for k, v in model.state_dict().items()}, ref)
    out.append("module already on the device (mp2_dp2, 2 -> 1 merge)")

    lc = oneload.load_checkpoint(FIXTURES / "shard_only", flat=True, device=device, dtype=torch.bfloat16)
    _on(lc.model, device)
    names = lc.shard_metadata["param_metadata"][1]["params"]["flat_param_0"]["names"]
    want = torch.cat([ref["decoder.layers.0." + n].flatten() for n in names]).to(torch.bfloat16)
    got = lc.model["decoder.layers.0.flat_param_0"].cpu()
    assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), want.float(), atol=1e-2)
    out.append("bf16 flat shard on the device (shard_only)")
    return out


def _fsdp2_nccl(rank, world, store, results):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        model = sharded_on_meta(init_device_mesh("cuda", (world,)))
        report = oneload.load_into(model, FIXTURES / "mp2_ddp", device="cuda", verify=True)
        full = {n: (p.full_tensor() if isinstance(p, DTensor) else p) for n, p in model.state_dict().items()}
        _on(full, "cuda")
        assert_matches_reference({k: v.cpu() for k, v in full.items()}, reference_weights())
        results.put(("ok", report.strategy))
    except BaseException as e:  # noqa: BLE001 (report to the parent)
        results.put(("error", repr(e)))
    finally:
        dist.destroy_process_group()


def _gloo_pair(rank, world, store, device, results):
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        ref = reference_weights()
        model = TinyMetaseqLM().to(device)
        path = FIXTURES / "singleton" if rank == 0 else "/nowhere/checkpoint_last.pt"  # rank 1 cannot see it
        r1 = oneload.load_into(model, path, process_group=dist.group.WORLD, verify=True)
        _on(model.state_dict(), device)
        assert_matches_reference({k: v.cpu() for k, v in model.state_dict().items()}, ref)
        lc = oneload.load_checkpoint(FIXTURES / "fsdp_dp3", process_group=dist.group.WORLD, flat=True,
                                     strategy="broadcast", device=device, verify=True)
        _on(lc.model, device)
        results.put(("ok", f"{r1.strategy}+{lc.report.strategy}"))
    except BaseException as e:  # noqa: BLE001
        results.put(("error", repr(e)))
    finally:
        dist.destroy_process_group()


def spawn(fn, world, *args) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(), "store")
    procs = [ctx.Process(target=fn, args=(r, world, store, *args, results)) for r in range(world)]
    for p in procs:
        p.start()
    out = [results.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(30)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if args.device == "cuda":
        assert torch.cuda.is_available(), "no CUDA device"
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    t0 = time.time()
    failures = 0
    for line in single(args.device):
        print("PASS", line)
    if args.device == "cuda" and dist.is_nccl_available():
        res = spawn(_fsdp2_nccl, 1)
        ok = all(r[0] == "ok" for r in res)
        failures += not ok
        print("PASS" if ok else "FAIL", "FSDP2 on a one-rank NCCL cuda mesh (mp2_ddp, DTensor shards on cuda):", res)
    res = spawn(_gloo_pair, 2, args.device)
    ok = all(r[0] == "ok" for r in res)
    failures += not ok
    print("PASS" if ok else "FAIL", f"two gloo ranks into {args.device} tensors (blind rank -> broadcast; flat scatter):", res)
    print(f"{'all passed' if not failures else f'{failures} failed'} in {time.time() - t0:.1f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
