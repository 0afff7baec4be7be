"""The ``metaseq-oneload`` command line: thin over the public API.

Every subcommand prints a readable table, or one JSON object with ``--json``. Errors print
one clear message and exit non-zero; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Optional, Sequence

from ._errors import OneloadError

__all__ = ["main"]

_COMMANDS: dict = {}


def command(name: str, help: str) -> Callable:
    """Register ``fn(args) -> int`` as a subcommand; ``fn.configure(parser)`` adds its flags."""

    def wrap(fn):
        _COMMANDS[name] = (fn, help)
        return fn

    return wrap


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def table(rows: Sequence[Sequence], header: Optional[Sequence] = None) -> str:
    """A plain, aligned text table."""
    rows = [[str(c) for c in r] for r in rows]
    if header:
        rows = [[str(c) for c in header]] + rows
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if header:
        lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# --------------------------------------------------------------------------- inspect


def _describe(layout) -> str:
    kinds = {
        "singleton": "one file, unflattened weights",
        "model_parallel": "model-parallel parts, unflattened (Megatron splits)",
        "fsdp_sharded": "FSDP-sharded parts" + (f", flat params ({layout.metadata_key})" if layout.flat else ""),
    }
    d = layout.to_dict()
    out = [
        table([
            ["checkpoint", d["path"]],
            ["kind", f"{d['kind']}  ({kinds[d['kind']]})"],
            ["model parallel", d["model_parallel_size"]],
            ["shards per part", d["shards_per_part"]],
            ["flat", "yes" if d["flat"] else "no"],
            ["saved world size", d["saved_world_size"]],
            ["params", f"{d['num_params']:,}"],
            ["bytes", f"{human_bytes(d['total_bytes'])} of tensors, {human_bytes(d['file_bytes'])} on disk"],
            ["dtype", ", ".join(d["dtypes"])],
            ["flavor", d["flavor"]],
            ["num_updates", d["num_updates"]],
        ]),
        "",
        "files  [part][shard]",
    ]
    rows = []
    shown = 0
    for m, row in enumerate(layout.files):
        for f in row:
            if shown < 16:
                rows.append([f"[{m}][{f.shard}]", os.path.basename(f.path), human_bytes(f.size)])
            shown += 1
    out.append(table(rows))
    if shown > 16:
        out.append(f"... and {shown - 16} more files")
    if layout.aliases:
        out.append(f"links: {', '.join(layout.aliases[:4])}{' ...' if len(layout.aliases) > 4 else ''}")
    if layout.warnings:
        out += ["", "warnings"] + [f"  - {w}" for w in layout.warnings]
    return "\n".join(out)


@command("inspect", "describe a checkpoint from its metadata (no tensor data is read)")
def _inspect(args) -> int:
    from . import inspect

    layout = inspect(args.path, trust_pickle=args.trust_pickle)
    if args.json:
        print(json.dumps(layout.to_dict(), indent=2))
    else:
        print(_describe(layout))
    return 0


def _configure_inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a folder, any file of the set, the un-suffixed name, or a glob")


_inspect.configure = _configure_inspect


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="metaseq-oneload",
        description="Inspect, load, convert and export metaseq/fairseq checkpoints of any layout.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (fn, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        fn.configure(p)
        p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
        p.add_argument("--debug", action="store_true", help="print the traceback on errors")
        p.add_argument("--trust-pickle", action="store_true",
                       help="UNSAFE: unpickle without the allowlist (runs code from the file)")
        p.set_defaults(_fn=fn)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    _load_commands()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._fn(args) or 0)
    except (OneloadError, FileNotFoundError, ValueError, KeyboardInterrupt) as e:
        if args.debug:
            raise
        if isinstance(e, KeyboardInterrupt):
            print("metaseq-oneload: interrupted", file=sys.stderr)
            return 130
        if args.json:
            print(json.dumps({"error": str(e), "type": type(e).__name__}))
        print(f"metaseq-oneload {args.command}: error: {e}", file=sys.stderr)
        return 2


def _load_commands() -> None:
    """Subcommands that live in other modules register themselves on import."""
    import importlib

    for mod in ("metaseq_oneload._convert", "metaseq_oneload._hf"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


if __name__ == "__main__":
    # ``python -m metaseq_oneload.cli`` runs this file as __main__, a second copy of the
    # module: delegate to the package's, whose registry the other modules' commands fill.
    from metaseq_oneload.cli import main as _main

    sys.exit(_main())
