"""Every benchmark, one after the other (`make bench`). Each prints its own table."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHES = ["inspect_cost.py", "load_bench.py", "convert_bench.py", "hf_t5_bench.py", "discovery_scale.py",
           "read_bandwidth.py", "storage_bytes.py", "two_nodes.py"]

if __name__ == "__main__":
    failed = 0
    for name in BENCHES:
        path = os.path.join(HERE, name)
        if not os.path.exists(path):
            continue
        print(f"\n=== {name}", flush=True)
        failed += subprocess.call([sys.executable, path]) != 0
    sys.exit(1 if failed else 0)
