"""What every benchmark reads from /proc and how it prints its table."""

from __future__ import annotations

from typing import Sequence

__all__ = ["proc_status", "proc_io", "print_table"]


def proc_status(field: str) -> int:
    """A memory field of /proc/self/status (``VmRSS``, ``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def proc_io() -> dict:
    """/proc/self/io: ``rchar``, ``read_bytes``, ... of this process so far."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def print_table(header: Sequence[str], body: Sequence[Sequence]) -> None:
    """Columns padded to their widest cell, a rule under the header."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    for i, line in enumerate([list(header)] + [list(b) for b in body]):
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
