"""The conformance corpus: every set that real metaseq and fairseq writers made, as listed
in ``tests/fixtures/{metaseq,fairseq}/corpus.json`` (how each was made: the README beside
it), and an independent reading of each set's weights for the tests to compare with.

The independent reading uses only ``torch.load`` and the rules metaseq, fairseq and
fairscale document (flat parameters are their members' bytes concatenated in shard order,
padding at the end; Megatron splits column-parallel weights on dim 0 and row-parallel ones
on dim 1). It shares no code with the package under test.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parent / "fixtures"
FAMILIES = ("metaseq", "fairseq")

_NAME = re.compile(r"^(?P<prefix>.+?)(?:-model_part-(?P<part>\d+))?(?:-shard(?P<shard>\d+)|_part(?P<kpart>\d+))?\.pt$")
# Megatron's splits, as metaseq and fairseq document them (see the corpus READMEs).
_DIM0 = (".k_proj.weight", ".k_proj.bias", ".v_proj.weight", ".v_proj.bias", ".q_proj.weight", ".q_proj.bias",
         ".fc1.weight", ".fc1.bias", "embed_tokens.weight", "output_projection.weight")
_DIM1 = (".out_proj.weight", ".fc2.weight")


@dataclass(frozen=True)
class Entry:
    family: str
    set: str
    entry: str
    writer: str
    source: str
    expect: dict
    weights: str
    notes: str
    refuse: str = ""

    @property
    def refused(self) -> bool:
        """A file a real writer makes that is not a checkpoint of any layout (e.g. metaseq's
        FasterTransformer export): the package must refuse it, clearly."""
        return bool(self.refuse)

    @property
    def folder(self) -> Path:
        return ROOT / self.family / self.set

    @property
    def path(self) -> Path:
        return self.folder / self.entry if self.entry else self.folder

    @property
    def id(self) -> str:
        return f"{self.family}/{self.set}"

    @property
    def mp(self) -> int:
        return int(self.expect["model_parallel_size"])

    @property
    def metaseq_model(self) -> bool:
        """The tiny OPT-style metaseq model (Hugging Face OPT reproduces its logits)."""
        return self.family == "metaseq"


def entries(family: Optional[str] = None) -> list:
    out = []
    for fam in FAMILIES if family is None else (family,):
        manifest = ROOT / fam / "corpus.json"
        if not manifest.exists():
            continue
        for e in json.loads(manifest.read_text()):
            out.append(Entry(fam, e["set"], e.get("entry", ""), e.get("writer", ""), e.get("source", ""),
                             e["expect"], e.get("weights", "exact"), e.get("notes", ""), e.get("refuse") or ""))
    return out


def by_id(ident: str) -> Entry:
    return next(e for e in entries() if e.id == ident)


def _needed_globals() -> list:
    """What the corpus pickles need beyond torch's allowlist (its manifests' ``load_needs``):
    Namespaces, and the omegaconf containers metaseq's convert_to_singleton writes."""
    import collections
    import typing

    out = [argparse.Namespace, collections.defaultdict, typing.Any, int, dict, list]
    try:
        from omegaconf import DictConfig, ListConfig
        from omegaconf.base import ContainerMetadata, Metadata
        from omegaconf.nodes import AnyNode

        out += [DictConfig, ListConfig, ContainerMetadata, Metadata, AnyNode]
    except ImportError:
        pass
    return out


def raw(path) -> dict:
    with torch.serialization.safe_globals(_needed_globals()):
        return torch.load(path, map_location="cpu", weights_only=True)


def _is_checkpoint(p: Path) -> bool:
    # Text pointers (a link after a copy) are tiny; reference_logits.pt is not a checkpoint.
    return p.suffix == ".pt" and p.name != "reference_logits.pt" and not p.is_symlink() and p.stat().st_size > 4096


def grid(e: Entry) -> list:
    """[part][shard] of the set's real files, from the names alone."""
    target = e.path
    if target.is_symlink() or (target.is_file() and target.stat().st_size <= 4096):
        target = Path(os.path.realpath(target))
        if target.stat().st_size <= 4096:  # a text pointer
            target = target.parent / target.read_text().strip()
    names = [p for p in sorted(e.folder.iterdir()) if _is_checkpoint(p)]
    prefix = None
    if target.is_file():
        prefix = _NAME.match(target.name).group("prefix")
    rows: dict = {}
    for p in names:
        m = _NAME.match(p.name)
        if m is None or (prefix is not None and m.group("prefix") != prefix):
            continue
        shard = m.group("shard") or m.group("kpart") or 0
        rows.setdefault(int(m.group("part") or 0), {})[int(shard)] = p
    if prefix is None and len({_NAME.match(p.name).group("prefix") for r in rows.values() for p in r.values()}) > 1:
        raise ValueError(f"{e.id}: name the entry file in corpus.json, the folder holds several prefixes")
    return [[rows[m][d] for d in sorted(rows[m])] for m in sorted(rows)]


def _metadata(obj: dict):
    for key in ("shard_metadata", "fsdp_metadata"):
        if isinstance(obj.get(key), dict):
            return obj[key]
    return None


def part_weights(files: list) -> dict:
    """One model part's unflattened weights from its files, by fairscale's documented rules."""
    objs = [raw(p) for p in files]
    models = [o["model"] if isinstance(o.get("model"), dict) else o for o in objs]
    md = _metadata(objs[0])
    flat_keys = []
    if md is not None:
        for pm in md["param_metadata"]:
            for name in pm["params"]:
                flat_keys.append((pm["fsdp_path"], name))
    held = [(p, n) for p, n in flat_keys if (f"{p}.{n}" if p else n) in models[0]]
    out = {}
    if not held:
        assert len(files) == 1, files
        out = dict(models[0])
    else:
        for pm in md["param_metadata"]:
            path = pm["fsdp_path"]
            for name, v in pm["params"].items():
                key = f"{path}.{name}" if path else name
                pieces = []
                for o, m in zip(objs, models):
                    pad = next(q for q in _metadata(o)["param_metadata"] if q["fsdp_path"] == path)["params"][name]["padding"]
                    t = m[key]
                    pieces.append(t[: t.numel() - pad] if pad else t)
                full = torch.cat(pieces)
                for n, shape, numel in zip(v["names"], v["shapes"], full.split(list(v["numels"]))):
                    out[f"{path}.{n}" if path else n] = numel.view(shape)
        for k, t in models[0].items():
            if not any(k == (f"{p}.{n}" if p else n) for p, n in flat_keys):
                out[k] = t
    if md is not None:
        for pm in md["param_metadata"]:
            for src, dst in pm.get("shared_param_info", ()) or ():
                src = f"{pm['fsdp_path']}.{src}" if pm["fsdp_path"] else src
                dst = f"{pm['fsdp_path']}.{dst}" if pm["fsdp_path"] else dst
                if src in out and dst not in out:
                    out[dst] = out[src]
    return out


def canonical(sd: dict) -> dict:
    """Split fused ``qkv_proj`` (rows k, v, q, as metaseq stores them per part) into
    ``k_proj``/``v_proj``/``q_proj``, so that fused and split writers compare; drop fairseq's
    dummy ``_float_tensor`` buffer (fairseq replaces it on every load)."""
    out = {}
    for k, v in sd.items():
        if k.endswith("._float_tensor"):
            continue
        if ".qkv_proj." in k:
            for name, piece in zip(("k_proj", "v_proj", "q_proj"), v.chunk(3)):
                out[k.replace("qkv_proj", name)] = piece
        else:
            out[k] = v
    return out


def fused(sd: dict) -> dict:
    """The inverse of :func:`canonical` for metaseq's names."""
    out = {}
    for k, v in sd.items():
        if ".self_attn.k_proj." in k:
            out[k.replace("k_proj", "qkv_proj")] = torch.cat(
                [v, sd[k.replace("k_proj", "v_proj")], sd[k.replace("k_proj", "q_proj")]])
        elif ".self_attn.v_proj." in k or ".self_attn.q_proj." in k:
            continue
        else:
            out[k] = v
    return out


def _dim(name: str) -> Optional[int]:
    if name.endswith(_DIM0):
        return 0
    if name.endswith(_DIM1):
        return 1
    return None


def merged(parts: list) -> dict:
    """Megatron parts (canonical names) merged into the full model."""
    if len(parts) == 1:
        return dict(parts[0])
    out = {}
    for k, v in parts[0].items():
        d = _dim(k)
        out[k] = v if d is None else torch.cat([p[k] for p in parts], dim=d)
    return out


def split(full: dict, part: int, nparts: int) -> dict:
    """Megatron's part ``part`` of ``nparts`` of the full model (canonical names)."""
    if nparts == 1:
        return dict(full)
    out = {}
    for k, v in full.items():
        d = _dim(k)
        out[k] = v if d is None else v.chunk(nparts, dim=d)[part]
    return out


def full_weights(e: Entry) -> dict:
    """The whole model of a corpus set (canonical names), read without the package."""
    return merged([canonical(part_weights(row)) for row in grid(e)])


def reference_logits(e: Entry) -> dict:
    return raw(e.folder / "reference_logits.pt")


def assert_same(got: dict, want: dict, *, what: str, tol: float = 0.0) -> None:
    """Every wanted tensor present with its shape and dtype and (within ``tol``) its values;
    ``got`` may also hold the tied ``output_projection`` alias, equal to ``embed_tokens``."""
    missing = sorted(set(want) - set(got))
    extra = sorted(k for k in set(got) - set(want) if not k.endswith("output_projection.weight"))
    assert not missing and not extra, f"{what}: missing {missing[:5]}, unexpected {extra[:5]}"
    for k, v in want.items():
        g = got[k]
        assert g.shape == v.shape and g.dtype == v.dtype, f"{what}: {k}: {g.dtype}{tuple(g.shape)} vs {v.dtype}{tuple(v.shape)}"
        if tol == 0.0:
            assert torch.equal(g, v), f"{what}: {k} differs by {float((g.double() - v.double()).abs().max())}"
        else:
            diff = float((g.double() - v.double()).abs().max()) if v.numel() else 0.0
            assert diff <= tol, f"{what}: {k} differs by {diff} > {tol}"
    for k in set(got) - set(want):
        emb = k.replace("output_projection", "embed_tokens")
        if emb in got:
            assert torch.equal(got[k], got[emb]), f"{what}: {k} is not a copy of {emb}"
