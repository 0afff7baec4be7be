"""Placeholder until the writer lands: inspect the shared fixtures if present."""
import sys
from pathlib import Path

import metaseq_oneload as oneload

fixtures = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "metaseq"
for name in ("singleton", "fsdp_dp3", "mp2_ddp", "mp2_dp2", "shard_only"):
    if (fixtures / name).is_dir():
        layout = oneload.inspect(fixtures / name)
        print(f"{name:12s} {layout.kind:15s} mp={layout.model_parallel_size} shards={layout.shards_per_part} flat={layout.flat}")
sys.exit(0)
