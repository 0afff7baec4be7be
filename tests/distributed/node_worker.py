"""One rank of the two-node simulation (tests/distributed/test_two_nodes.py), started by
torchrun: two agents on this machine, ``--nnodes 2 --nproc-per-node 2`` over a c10d
rendezvous on 127.0.0.1, so each sees its own ``GROUP_RANK``. Every rank loads every
scenario in the one process group and writes what it measured as JSON.

    node_worker.py OUT_DIR ROOT

``ROOT/node{GROUP_RANK}`` is the folder this rank's node sees (a copy of the checkpoints,
or missing for a node that sees none).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys

import torch
import torch.distributed as dist


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise KeyError("rchar")


def main() -> None:
    # `kill -USR1` a hung rank to see where it waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    out_dir, root = sys.argv[1], sys.argv[2]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo")
    import metaseq_oneload as mo
    from metaseq_oneload._planner import to_wire
    from tests.distributed.workers import target_metadata

    node = int(os.environ["GROUP_RANK"])
    rank = dist.get_rank()
    rows = []
    # (scenario, folder this node sees, checkpoint file in it, flat, strategy). ``auto``: a
    # node with its own copy on its own disk reads it there, through its page cache; nodes on
    # one shared storage (the object store) read each byte once between them and exchange;
    # ``parallel``: every byte read once in all, shared inside a node and across copies too.
    s3 = os.environ.get("ONELOAD_TEST_S3", "")
    scenarios = [("one object store", s3, "big/synth.pt", False, "auto")] if s3 else []
    scenarios += [
        ("own copies", f"node{node}", "big/synth.pt", False, "auto"),
        ("own copies, strict", f"node{node}", "big/synth.pt", False, "parallel"),
        ("own copies, strict, no shared memory", f"node{node}", "big/synth.pt", False, "parallel"),
        ("own copies, fsdp shards", f"node{node}", "fsdp_dp3/checkpoint_2-model_part-0-shard0.pt", False, "auto"),
        ("own copies, flat", f"node{node}", "fsdp_dp3/checkpoint_2-model_part-0-shard0.pt", True, "auto"),
        ("node 1 sees none", "node0" if node == 0 else "nowhere", "big/synth.pt", False, "auto"),
        ("node 1 sees none, flat", "node0" if node == 0 else "nowhere", "singleton/checkpoint_2_consolidated.pt", True,
         "auto"),
    ]
    for name, folder, rel, flat, strategy in scenarios:
        path = f"{folder}/{rel}" if folder.startswith("s3://") else os.path.join(root, folder, rel)
        md = target_metadata(1) if flat and "singleton" in rel else None
        # Ranks of a node share through /dev/shm; without it, through the process group.
        os.environ["METASEQ_ONELOAD_SHM"] = "0" if "no shared memory" in name else "1"
        remote = folder.startswith("s3://")
        if remote:
            from tests.s3_server import proxy_control
        dist.barrier()
        if remote and rank == 0:  # the proxy counts what the store serves
            proxy_control(os.environ["ONELOAD_TEST_S3_PROXY"], "reset")
        dist.barrier()
        before = _rchar()
        lc = mo.load_checkpoint(path, flat=flat, shard_metadata=md, strategy=strategy, verify=False)
        read = _rchar() - before
        served = -1
        if remote:
            dist.barrier()
            served = proxy_control(os.environ["ONELOAD_TEST_S3_PROXY"], "counters")["body_bytes"]
        torch.save(dict(lc.model), os.path.join(out_dir, f"{name.replace(' ', '_').replace(',', '')}-r{rank}.pt"))
        r = lc.report
        rows.append({"scenario": name, "strategy": r.strategy, "reason": r.reason, "bytes_read": r.bytes_read,
                     "rchar": read, "bytes_out": r.bytes_out, "received": r.bytes_received,
                     "from_other_nodes": r.bytes_from_other_nodes, "sent": r.bytes_sent, "served": served,
                     "plan": to_wire(r.plan.parts[0]).decode()})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "node": node, "local_rank": int(os.environ["LOCAL_RANK"]), "rows": rows}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
