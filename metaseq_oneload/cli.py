"""The ``metaseq-oneload`` command line: thin over the public API.

Every subcommand takes the checkpoint it reads as its first argument, PATH (verify: PATH
and OTHER), and what it writes as DST; the flags mean the same wherever they appear
(``--chunk-mb``, 64 by default, ``--dtype``, ``--overwrite``, ``--no-progress``). Every
subcommand prints a readable table, or one JSON object with ``--json``. Errors print one
clear message and exit non-zero; ``--debug`` adds the traceback. Warnings go to stderr, so
that stdout stays the report (or the JSON) alone.

Exit codes: 0 done (verify: the checkpoints match); 1 verify: they differ; 2 refused (a
:class:`~metaseq_oneload.OneloadError`, a bad argument, a file the system would not let us
read or write, a machine that ran out of memory or threads), one paragraph on stderr, no
traceback; 3 an internal error (a bug: the traceback, and a line saying so); 130
interrupted; 141 stdout closed early.

The parser, ``--help`` and ``--version`` import nothing heavy: every subcommand's flags are
declared here, and the modules that import torch are imported only when a command runs.
"""

import argparse
import contextlib
import json
import os
import re
import sys
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

from . import __version__
from ._errors import OneloadError, os_error_message, out_of_resources, resource_problem
from ._threads import check_signals, interruptible

__all__ = ["main", "build_parser"]

# name -> (run(args) -> int, one-line help, configure(parser)); filled below the commands.
_COMMANDS: Dict[str, Tuple[Callable, str, Callable]] = {}

# The dtypes --dtype takes, for convert, consolidate and export-hf alike; the same names as
# _convert's table of torch dtypes (a test keeps the two equal), spelled out here so that the
# parser needs no torch.
DTYPES = ("bf16", "bfloat16", "float16", "float32", "fp16", "fp32")
FORMATS = ("torch", "safetensors", "dcp")


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


# The library's messages name its Python arguments; where a flag differs they add it as
# "ARG (CLI: FLAG)". The command line shows FLAG alone, and an argument of the running
# subcommand's (strategy='reshard', overwrite=True) as that subcommand's flag.
_MARKED = re.compile(r"(?<![\w.])(?:[\w.]+\([^()]*\)|[\w.]+=(?:'[^']*'|\S*?)) \(CLI:? ([^)]*)\)")
_ASIDE = re.compile(r"\(CLI:? ([^)]*)\)")
_ARG = re.compile(r"(?<![\w.\-/])([a-z_][a-z0-9_]*)=('[^']*'|\"[^\"]*\"|[\w.+\-]*)")
_SUBPARSER: Optional[argparse.ArgumentParser] = None  # the running subcommand's, set by main


def cli_words(message: str, parser: Optional[argparse.ArgumentParser] = None) -> str:
    """``message`` in the command line's words: flags, not Python arguments."""
    message = _ASIDE.sub(r"(\1)", _MARKED.sub(r"\1", message))
    parser = parser or _SUBPARSER
    if parser is None:
        return message

    def flag(m: "re.Match") -> str:
        name, raw = m.group(1), m.group(2)
        value = raw[1:-1] if raw[:1] in "'\"" else raw
        for a in parser._actions:
            if a.dest != name or not a.option_strings:
                continue
            long = max(a.option_strings, key=len)
            if a.nargs == 0:  # a switch: the one whose value this is
                if str(a.const) == value:
                    return long
                continue
            return f"{long} {value}".rstrip()
        return m.group(0)

    return _ARG.sub(flag, message)


def warn(message: str) -> None:
    """One ``warning: ...`` line on stderr."""
    print(f"warning: {cli_words(message)}", file=sys.stderr)


def _progress(args) -> Optional[bool]:
    # None: a bar when stderr is a terminal (the library's default); never under --json.
    return False if (getattr(args, "no_progress", False) or args.json) else None


# The source and destination arguments, worded once: the same in every subcommand.
_PATH_HELP = "any file of the checkpoint, its folder, its un-suffixed name, or a glob"


def _add_path(p: argparse.ArgumentParser, help: str = _PATH_HELP) -> None:
    p.add_argument("path", metavar="PATH", help=help)


def _add_chunk_mb(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--chunk-mb", type=float, default=64, help=f"{help} (default 64)")


def _add_no_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true", help="no progress bar, even on a terminal")


# --------------------------------------------------------------------------- inspect


def _describe(layout, claim=None) -> str:
    kinds = {
        "singleton": ("one file, unflattened weights" if len(layout.files[0]) == 1
                      else f"one state dict over {len(layout.files[0])} files, unflattened weights"),
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
    if claim is not None:  # what the set says about itself: shown as said, not checked here
        out += ["", "recorded digest  (a claim by its writer, not checked: `metaseq-oneload digest` reads the bytes)"]
        rows = [["by", f"{claim.writer}, in {claim.source}"]]
        if claim.model:
            rows.append(["model", claim.model])
        if claim.tensors:
            rows.append(["tensors", f"{len(claim.tensors)} tensor digests"])
        if claim.stored:
            rows.append(["stored", f"{claim.stored} stored-tensor digests (a load with verify='digest' checks them)"])
        if claim.source_digest:
            rows.append(["source", f"{claim.source_digest} (the checkpoint it was made from)"])
        rows += [["problem", p] for p in claim.problems[:5]]
        out.append(table(rows))
    if layout.notes:  # normal for such files, so part of the report, not warnings
        out += ["", "notes"] + [f"  - {n}" for n in layout.notes]
    return "\n".join(out)


def _inspect(args) -> int:
    from . import inspect

    from ._claims import recorded

    layout = inspect(args.path, trust_pickle=args.trust_pickle)
    claim = recorded(layout)
    if args.json:
        print(json.dumps(dict(layout.to_dict(), recorded_digest=claim.to_dict() if claim else None), indent=2))
        return 0
    print(_describe(layout, claim))
    for w in layout.warnings:
        warn(w)
    return 0


def _configure_inspect(p: argparse.ArgumentParser) -> None:
    _add_path(p)


# --------------------------------------------------------------------------- convert, consolidate


def _add_write_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=FORMATS, default="torch",
                   help="torch (metaseq's files, default), safetensors (+ a JSON of the metadata) or dcp "
                        "(a torch.distributed.checkpoint folder DST: .metadata and --shards .distcp files)")
    p.add_argument("--drop-optimizer", action="store_true", help="leave the optimizer state out")
    p.add_argument("--overwrite", action="store_true",
                   help="replace existing destination files (never a source file)")
    p.add_argument("--jobs", type=int, default=None, help="files written concurrently (default: CPUs)")
    p.add_argument("--memory-budget", default=None,
                   help="buffer memory of all jobs together, e.g. 512M, 2G (default 1G)")
    _add_chunk_mb(p, "I/O chunk per read and write")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="cast the weights")
    p.add_argument("--qkv", choices=("auto", "fused", "split"), default="auto",
                   help="attention projections: metaseq's fused qkv_proj (auto) or split k/v/q_proj")
    _add_no_progress(p)


def _write_kwargs(args) -> dict:
    return dict(format=args.format, drop_optimizer=args.drop_optimizer, overwrite=args.overwrite, jobs=args.jobs,
                memory_budget=args.memory_budget, chunk_mb=args.chunk_mb, dtype=args.dtype, qkv=args.qkv,
                trust_pickle=args.trust_pickle, progress=_progress(args))


def _convert_table(r) -> str:
    layout = f"{r.model_parallel}x{r.shards} {'flat' if r.flat else 'unflattened'}"
    rows = [
        ["source", f"{r.src}  ({r.source})"],
        ["target", f"{r.dst}  ({layout}, {r.format})"],
        ["optimizer", r.optimizer],
        ["written", f"{len(r.files) + len(r.sidecars)} file(s), {human_bytes(r.bytes_written)} of tensors in "
                    f"{r.seconds:.2f} s ({r.jobs} job(s), {human_bytes(r.chunk_bytes)} chunks)"],
        ["read", human_bytes(r.bytes_read)],
        ["digest", r.digest or "stored digests recorded in the index (see the notes)"
         if r.format == "torch" else r.digest or "-"],
    ]
    out = [table(rows), "", "files"]
    out.append(table([[os.path.basename(p), human_bytes(os.path.getsize(p))]
                      for p in list(r.files) + list(r.sidecars)]))
    if r.notes:
        out += ["", "notes"] + [f"  - {cli_words(n)}" for n in r.notes]
    if r.removed:
        out += ["", "removed"] + [f"  - {p}" for p in r.removed]
    return "\n".join(out)


def _convert(args) -> int:
    from . import convert

    r = convert(args.path, args.dst, model_parallel=args.model_parallel, shards=args.shards,
                flat=args.flat, wrapping=args.wrapping, **_write_kwargs(args))
    print(json.dumps(r.to_dict(), indent=2) if args.json else _convert_table(r))
    return 0


def _configure_convert(p: argparse.ArgumentParser) -> None:
    _add_path(p)
    p.add_argument("dst", metavar="DST",
                   help="destination prefix, e.g. /out/checkpoint_last (files get metaseq's suffixes); with "
                        "--format dcp, the folder to write")
    p.add_argument("--model-parallel", "-m", type=int, default=None, help="model-parallel parts (default: the source's)")
    p.add_argument("--shards", "-s", type=int, default=None,
                   help="FSDP shards per part (default: the source's); with --format dcp, .distcp files (default 1)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--flat", dest="flat", action="store_true", default=None,
                   help="fairscale flat-parameter shards with shard_metadata (default when --shards > 1)")
    g.add_argument("--unflat", dest="flat", action="store_false",
                   help="unflattened weights, one file per part (needs --shards 1)")
    p.add_argument("--wrapping", default=None,
                   help="a flat shard whose FSDP wrapping a flat output of an unflattened source follows")
    _add_write_options(p)


def _consolidate(args) -> int:
    from . import consolidate

    r = consolidate(args.path, args.dst, **_write_kwargs(args))
    print(json.dumps(r.to_dict(), indent=2) if args.json else _convert_table(r))
    return 0


def _configure_consolidate(p: argparse.ArgumentParser) -> None:
    _add_path(p)
    p.add_argument("dst", metavar="DST", help="the output file, e.g. /out/consolidated.pt")
    _add_write_options(p)


# --------------------------------------------------------------------------- verify


def _verify(args) -> int:
    from . import verify
    from ._options import check_option

    check_option("top", args.top)
    r = verify(args.path, args.other, atol=args.atol, rtol=args.rtol, chunk_mb=args.chunk_mb,
               trust_pickle=args.trust_pickle, progress=_progress(args))
    if args.json:
        print(json.dumps(r.to_dict(), indent=2))
        return 0 if r.match else 1
    if r.against_digest:
        print(_verify_digest_table(r))
        return 0 if r.match else 1
    out = [table([["a", f"{r.a}  ({r.source_a})"], ["b", f"{r.b}  ({r.source_b})"],
                  ["tolerance", f"|a-b| <= {r.atol:g} + {r.rtol:g} * |b|"],
                  ["digests", f"a {r.digest_a or 'not computed (not every tensor was read)'}"],
                  ["", f"b {r.digest_b or 'not computed (not every tensor was read)'}"
                       + (" (the same content)" if r.digest_a and r.digest_a == r.digest_b else "")]])]
    out += _claim_lines(r)
    if r.only_in_a or r.only_in_b or r.shape_mismatches:
        out += ["", "structure"]
        out += [f"  only in a: {n}" for n in r.only_in_a[:20]]
        out += [f"  only in b: {n}" for n in r.only_in_b[:20]]
        out += [f"  shape: {n}: a {sa} vs b {sb}" for n, sa, sb in r.shape_mismatches[:20]]
    top = [d for d in r.largest(args.top) if d.max_abs > 0 or d.mismatched]
    if top:
        out += ["", f"largest differences (of {len(r.diffs)} tensors)",
                table([[d.name, "x".join(map(str, d.shape)) or "scalar", f"{d.max_abs:.3g}", f"{d.max_rel:.3g}",
                        f"{d.mismatched:,}"] for d in top],
                      header=["tensor", "shape", "max |a-b|", "max rel", "over tol"])]
    bad = sum(1 for d in r.diffs if d.mismatched)
    if r.match:
        verdict = (f"MATCH: {len(r.diffs)} tensors, {r.elements:,} elements"
                   + (", bit-identical" if r.identical else " within tolerance"))
    else:
        verdict = (f"DIFFER: {bad} of {len(r.diffs)} tensors out of tolerance"
                   + (f", {len(r.only_in_a) + len(r.only_in_b)} names unmatched" if r.only_in_a or r.only_in_b else "")
                   + (f", {len(r.shape_mismatches)} shapes differ" if r.shape_mismatches else ""))
    out += ["", verdict]
    print("\n".join(out))
    return 0 if r.match else 1


def _claim_lines(r) -> list:
    lines = []
    for side, source, writer, model, agrees in r.claims:
        held = {True: "its bytes have it", False: "its bytes do NOT have it", None: "not compared"}[agrees]
        lines.append(f"  {side}: recorded by {writer} in {source}: {model} (a claim: {held})")
    return ["", "recorded digests"] + lines if lines else []


def _verify_digest_table(r) -> str:
    out = [table([["a", f"{r.a}  ({r.source_a})"], ["b", r.b], ["digest a", r.digest_a], ["digest b", r.digest_b]])]
    out += _claim_lines(r)
    if r.digest_mismatches or r.only_in_a or r.only_in_b:
        out += ["", "tensors"] + [f"  differ: {n}" for n in r.digest_mismatches[:50]]
        out += [f"  only in a: {n}" for n in r.only_in_a[:20]] + [f"  only in b: {n}" for n in r.only_in_b[:20]]
    if r.match:
        out += ["", "MATCH: a's content digest is the one given (a was read; b was not)"]
    else:
        named = len(r.digest_mismatches) + len(r.only_in_a) + len(r.only_in_b)
        out += ["", "DIFFER: a's content digest is not the one given"
                + (f" ({named} tensors named above)" if named else
                   " (b gives only a model digest: which tensors differ is not known)")]
    return "\n".join(out)


def _configure_verify(p: argparse.ArgumentParser) -> None:
    _add_path(p, "a checkpoint (any layout): " + _PATH_HELP)
    p.add_argument("other", metavar="OTHER",
                   help="the checkpoint to compare it with (any layout), or a digest: blake3:... or a file "
                        "`digest --json` wrote (then only PATH is read)")
    p.add_argument("--atol", type=float, default=1e-8, help="absolute tolerance (default 1e-8)")
    p.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance (default 1e-5)")
    p.add_argument("--top", type=int, default=10, help="how many of the largest differences to print")
    _add_chunk_mb(p, "MiB read and compared at a time from each checkpoint")
    _add_no_progress(p)


# --------------------------------------------------------------------------- digest


def _digest_table(r) -> str:
    rows = [["checkpoint", r.path], ["model", r.model],
            ["tensors", f"{len(r.tensors)}, {human_bytes(r.nbytes)} ({human_bytes(r.bytes_read)} read in "
                        f"{r.seconds:.2f} s)"]]
    rec = r.recorded
    if rec is not None:
        rows.append(["recorded", f"{rec.claim.source}, by {rec.claim.writer} (a claim; the bytes were read)"])
    out = [table(rows), "", table([[t.name, t.dtype, "x".join(map(str, t.shape)) or "scalar", human_bytes(t.nbytes),
                                   t.digest] for t in r.tensors], header=["tensor", "dtype", "shape", "bytes", "digest"])]
    if rec is None or not rec.compared:
        out += ["", "no content digest recorded in the checkpoint: nothing to compare"
                + (f" ({rec.claim.stored} stored-tensor digests: a load with verify='digest' checks them)"
                   if rec is not None and rec.claim.stored else "")]
        return "\n".join(out)
    claimed = dict(rec.claim.tensors)
    computed = {t.name: t.digest for t in r.tensors}
    problems = [f"  {n}: recorded {claimed[n]}, computed {computed[n]} (read from "
                f"{', '.join(r.files_of(n)) or 'no file'})" for n in rec.differing]
    problems += [f"  {n}: not in the recorded digests" for n in rec.unrecorded]
    problems += [f"  {n}: recorded, but the checkpoint has no such tensor" for n in rec.unknown]
    if rec.model_matches is False:
        problems.append(f"  model: recorded {rec.claim.model}, computed {r.model}")
    who = f"{rec.claim.writer} ({rec.claim.source})"
    if rec.matched:
        out += ["", f"MATCH: the digest recorded by {who} is the bytes' digest"]
    else:
        out += ["", f"DIFFER: the bytes do not have the digest recorded by {who}"] + problems
    return "\n".join(out)


def _digest(args) -> int:
    from . import digest
    from ._options import check_option

    check_option("threads", args.threads, "count")
    r = digest(args.path, chunk_mb=args.chunk_mb, threads=args.threads, trust_pickle=args.trust_pickle,
               progress=_progress(args))
    print(json.dumps(r.to_dict(), indent=2) if args.json else _digest_table(r))
    return 0 if r.match else 1


def _configure_digest(p: argparse.ArgumentParser) -> None:
    _add_path(p)
    _add_chunk_mb(p, "MiB of read buffers in all")
    p.add_argument("--threads", type=int, default=None, help="hashing threads (default: up to 4, one per core)")
    _add_no_progress(p)


# --------------------------------------------------------------------------- export-hf


def _export_hf(args) -> int:
    from . import export_hf
    from ._convert import DTYPE_BY_NAME

    result = export_hf(args.path, args.dst, max_shard_size=args.max_shard_size,
                       dtype=DTYPE_BY_NAME[args.dtype] if args.dtype else None, overwrite=args.overwrite,
                       chunk_mb=args.chunk_mb, trust_pickle=args.trust_pickle, progress=_progress(args))
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    c = result.config
    print(table([
        ["source", f"{result.src}  ({result.kind})"],
        ["written", result.dst],
        ["files", ", ".join(result.files)],
        ["tensors", f"{result.num_tensors} ({result.num_params:,} params, {human_bytes(result.total_bytes)})"],
        ["architecture", f"OPT: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, {c['num_attention_heads']} "
                         f"heads, ffn {c['ffn_dim']}, vocab {c['vocab_size']}, {c['max_position_embeddings']} positions"],
        ["", f"{c['activation_function']}, {'pre' if c['do_layer_norm_before'] else 'post'}-LN, "
             f"{'tied' if c['tie_word_embeddings'] else 'untied'} lm_head, {c['torch_dtype']}"],
        ["digest", f"{result.digest} (the exported tensors)"],
        ["", f"{result.source_digest} (the source's content)" if result.source_digest
         else "the source's content digest: not recorded (see the warning)"],
        ["seconds", f"{result.seconds:.1f}"],
    ]))
    for w in result.warnings:
        warn(w)
    return 0


def _configure_export_hf(p: argparse.ArgumentParser) -> None:
    _add_path(p, "the metaseq checkpoint: " + _PATH_HELP)
    p.add_argument("dst", metavar="DST",
                   help="the Hugging Face folder to create (must not exist, unless --overwrite)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest safetensors file; above it, model-0000k-of-0000n.safetensors + index (default 5GB)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="write the weights in this dtype (default: as stored)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing DST once the export is complete; only a folder an earlier export wrote "
                        "(config.json, model*.safetensors, the index) or an empty one")
    _add_chunk_mb(p, "bytes read and written at a time (peak memory)")
    _add_no_progress(p)


# --------------------------------------------------------------------------- plan


def _plan_table(plan) -> str:
    dp = plan.world // plan.model_parallel
    nodes = len({r.node for r in plan.ranks})
    saved = (f"{plan.kind}, saved {plan.saved_model_parallel}x{plan.saved_shards} "
             f"{'flat' if plan.saved_flat else 'unflattened'}")
    ratio = plan.bytes_read / plan.model_bytes if plan.model_bytes else 0.0
    rows = [
        ["checkpoint", f"{plan.path}  ({saved})"],
        ["target", f"world {plan.world} = {plan.model_parallel} model-parallel x {dp} data-parallel, "
                   f"{'flat' if plan.flat else 'unflattened'}"],
        ["strategy", f"{plan.strategy}: {cli_words(plan.reason)}"],
        ["read", f"{human_bytes(plan.bytes_read)} by the ranks in all ({ratio:.2f}x the checkpoint's "
                 f"{human_bytes(plan.model_bytes)} of tensors)"
                 + ("" if plan.storage_bytes >= plan.bytes_read else
                    f"; the storage serves {human_bytes(plan.storage_bytes)} "
                    f"({plan.storage_bytes / max(plan.model_bytes, 1):.2f}x), the node's page cache the rest")],
        ["network", f"{human_bytes(plan.network_bytes)} between ranks"
                    + (f", {human_bytes(sum(r.bytes_from_other_nodes for r in plan.ranks))} of it between nodes"
                       if nodes > 1 else "")],
        ["nodes", f"{nodes} ({len(plan.ranks) // max(nodes, 1)} rank(s) each)"],
        ["peak", f"{human_bytes(max(r.peak_bytes for r in plan.ranks))} on the busiest rank "
                 "(output + the strategy's buffers, docs/loading.md)"],
    ]
    shown = plan.ranks[:16]
    ranks = table([[r.rank, r.model_parallel_rank, r.data_parallel_rank, len(r.files), r.reads,
                    human_bytes(r.bytes_read), human_bytes(r.bytes_out), human_bytes(r.bytes_received),
                    human_bytes(r.bytes_sent), human_bytes(r.peak_bytes), r.node] for r in shown],
                  header=["rank", "part", "dp", "files", "reads", "read", "out", "received", "sent", "peak", "node"])
    out = [table(rows), "", ranks]
    if len(plan.ranks) > len(shown):
        out.append(f"... and {len(plan.ranks) - len(shown)} more ranks (--json lists every one)")
    return "\n".join(out)


def _plan(args) -> int:
    from ._convert import DTYPE_BY_NAME
    from ._loadplan import plan_load

    plan = plan_load(args.path, world=args.world, model_parallel=args.model_parallel, nodes=args.nodes,
                     ranks_per_node=args.ranks_per_node, blind_nodes=tuple(args.blind_node or ()),
                     storage=args.storage, flat=args.flat, strategy=args.strategy, bucket_mb=args.bucket_mb,
                     chunk_mb=args.chunk_mb, dtype=DTYPE_BY_NAME[args.dtype] if args.dtype else None,
                     trust_pickle=args.trust_pickle, wrapping=args.wrapping)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else _plan_table(plan))
    return 0


def _configure_plan(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a folder, any file of the set, the un-suffixed name, or a glob")
    p.add_argument("--world", "-w", type=int, required=True, help="ranks in the job (all of them)")
    p.add_argument("--model-parallel", "-m", type=int, default=1, help="target model-parallel size (default 1)")
    p.add_argument("--nodes", type=int, default=None, help="nodes the world runs on (default 1)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="instead of --nodes: ranks on each node (consecutive ranks share one, as torchrun places them)")
    p.add_argument("--blind-node", type=int, action="append", default=None, metavar="N",
                   help="node N (from 0) cannot see the files: its ranks receive (repeat for several)")
    p.add_argument("--storage", choices=("shared", "page_cache", "private"), default=None,
                   help="what the files lie on: shared (network or object storage), page_cache (shared storage "
                        "read through each node's page cache), private (each node's own copy on a local disk); "
                        "default: as this machine sees them")
    p.add_argument("--flat", action="store_true", help="plan load_state_dict(flat=True): each rank its FSDP shard")
    p.add_argument("--wrapping", default=None,
                   help="with --flat on unflattened weights: a flat shard whose FSDP wrapping the model follows "
                        "(default: metaseq's, each *.layers.N its own instance)")
    p.add_argument("--strategy", choices=("auto", "own_shard", "reshard", "broadcast", "parallel"), default="auto",
                   help="as load_state_dict's (default auto: the plan says which it picks and why)")
    p.add_argument("--bucket-mb", type=float, default=256, help="broadcast bucket (default 256)")
    p.add_argument("--chunk-mb", type=float, default=64, help="staging chunk (default 64)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="the destination dtype (default: as stored)")


# --------------------------------------------------------------------------- main

_COMMANDS.update({
    "inspect": (_inspect, "describe a checkpoint from its metadata (no tensor data is read)", _configure_inspect),
    "convert": (_convert, "rewrite a checkpoint as M model-parallel parts x N shards, streaming, never over its source",
                _configure_convert),
    "consolidate": (_consolidate, "write a checkpoint as one unflattened file (DST.pt)", _configure_consolidate),
    "verify": (_verify, "compare two checkpoints of any layouts tensor by tensor (exit 0 only if they match)",
               _configure_verify),
    "digest": (_digest, "the content digest of a checkpoint (any layout; docs/digest.md), checked against the "
                        "one it records (exit 1 if they differ)", _configure_digest),
    "export-hf": (_export_hf, "convert a metaseq checkpoint (any layout) into a Hugging Face OPT folder",
                  _configure_export_hf),
    "plan": (_plan, "what a load onto W ranks would do, from metadata only: each rank's reads, the strategy "
                    "and why, peak memory, network bytes", _configure_plan),
})


_WRITERS = frozenset({"convert", "consolidate", "export-hf"})


@contextlib.contextmanager
def _quiet_unraisable() -> Iterator[None]:
    """While a verb runs, an exception Python cannot raise (in a finalizer, a generator
    closed by the collector) is not printed as "Exception ignored ... Traceback" when it is
    a MemoryError (the machine ran short: the verb's own error, :func:`._errors.out_of_resources`,
    says so once, with what to do) or an interrupt (recorded by :func:`._threads.interruptible`:
    raised again before any commit and when the verb ends). Anything else goes to the hook
    as before."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:  # (allocates nothing: memory may be short)
        if not isinstance(unraisable.exc_value, (MemoryError, KeyboardInterrupt, SystemExit)):
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; building it (and printing any --help) imports no torch."""
    parser = argparse.ArgumentParser(
        prog="metaseq-oneload",
        description="Inspect, load, convert and export metaseq/fairseq checkpoints of any layout.",
    )
    parser.add_argument("--version", action="version", version=f"metaseq-oneload {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (fn, help_text, configure) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        configure(p)
        p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
        p.add_argument("--debug", action="store_true", help="print the traceback on errors")
        p.add_argument("--trust-pickle", action="store_true",
                       help="UNSAFE: unpickle without the allowlist (runs code from the file)")
        p.set_defaults(_fn=fn, _parser=p)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``metaseq-oneload`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    global _SUBPARSER
    args = build_parser().parse_args(argv)
    _SUBPARSER = args._parser
    try:
        # SIGINT (and SIGTERM, for the verbs that write) unwinds, so temporary files go, and is
        # recorded: no output is moved into place after it, even where its exception was lost
        with interruptible(term=args.command in _WRITERS), _quiet_unraisable():
            code = int(args._fn(args) or 0)
            check_signals(commit=True)  # an interrupt whose exception was lost still ends as one
            return code
    except BrokenPipeError:  # stdout closed early (| head): stop quietly, as cat does
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141
    except (OneloadError, OSError, ValueError, KeyboardInterrupt) as e:
        if args.debug:
            raise
        if isinstance(e, KeyboardInterrupt):
            print("metaseq-oneload: interrupted", file=sys.stderr)
            return 130
        if not isinstance(e, OneloadError) and (short := resource_problem(e)) is not None:
            return _short_exit(args, short)  # an mmap's ENOMEM is no file's fault
        # An OSError that no reader or writer turned into ours (one the system raised while
        # this command opened, listed or wrote something): it names the file and what to do.
        stray = isinstance(e, OSError) and not isinstance(e, OneloadError)
        message = cli_words(os_error_message(e, doing="access") if stray else str(e), args._parser)
        if args.json:
            print(json.dumps({"error": message, "type": type(e).__name__}))
        print(f"metaseq-oneload {args.command}: error: {message}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001  (not a refusal: a bug; its traceback is what a report needs)
        if args.debug:
            raise
        short = resource_problem(e)
        if short is not None:  # the machine ran short outside a file's reading: not a bug either
            return _short_exit(args, short)
        import traceback

        traceback.print_exc()
        if args.json:
            print(json.dumps({"error": f"internal error: {type(e).__name__}: {e}", "type": type(e).__name__}))
        print(f"metaseq-oneload {args.command}: internal error: {type(e).__name__}: {e}. This is a bug in "
              "metaseq-oneload, not a refusal of the input as far as it can tell: please report it with the "
              "traceback above.", file=sys.stderr)
        return 3


def _short_exit(args, short: str) -> int:
    """Exit 2 with the shortage's message (``short``: from resource_problem)."""
    message = str(out_of_resources(short))
    if args.json:
        print(json.dumps({"error": message, "type": "OutOfResourcesError"}))
    print(f"metaseq-oneload {args.command}: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    # ``python -m metaseq_oneload.cli`` runs this file as __main__, a second copy of the
    # module: delegate to the package's.
    from metaseq_oneload.cli import main as _main

    sys.exit(_main())
