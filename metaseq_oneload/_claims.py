"""What a checkpoint set says about its own content: the digests our writers record.

``convert`` and ``consolidate`` record them in the signed index beside their output
(``formats/_index.py``: per stored tensor, and the set's canonical ``content``), in the JSON
sidecar of a safetensors output, and ``export-hf`` in each file's safetensors
``__metadata__`` (``oneload.digest``, ``oneload.tensor_digests``, ``oneload.source_digest``).

Every one of them is a claim: it says what someone wrote, not what the bytes hold. ``digest``
and ``verify`` compare it with digests computed from the bytes, ``inspect`` shows it labelled
"recorded, not checked", and nothing uses it to skip reading. A claim that does not parse is
no claim (a warning says why), never an error: the bytes are still there to be read.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from typing import Optional

from ._digest import model_digest, name_bytes, parse_digest
from ._errors import DigestError, OneloadError
from ._layout import CheckpointLayout
from .formats import _index
from .formats.huggingface import read_safetensors_header

__all__ = ["Claim", "recorded"]

_MAX_SIDECAR = 64 << 20


@dataclass(frozen=True)
class Claim:
    """The canonical digests a set records about itself (``model`` and ``tensors`` describe
    the set as a one-process ``load_state_dict`` returns it), where, and by whom."""

    source: str  # the file the claim was read from (several: the first, "+ N more")
    writer: str  # who the record says wrote it ("metaseq-oneload convert"), or "unknown"
    model: Optional[str]  # the set's canonical model digest, if recorded
    tensors: tuple  # ((canonical name, digest), ...), possibly empty
    stored: int = 0  # how many stored-tensor digests the set records (checked by verify="digest")
    source_digest: Optional[str] = None  # export-hf: the digest of the checkpoint it was made from
    problems: tuple = ()  # why parts of what was recorded were not taken (malformed values)

    def to_dict(self) -> dict:
        return {"source": self.source, "writer": self.writer, "model": self.model, "tensors": dict(self.tensors),
                "stored": self.stored, "source_digest": self.source_digest, "problems": list(self.problems),
                "checked": False}


def _checked(value, what: str, problems: list) -> Optional[str]:
    try:
        parse_digest(value, what)
        return value
    except DigestError as e:
        problems.append(str(e))
        return None


def _named(mapping, what: str, problems: list) -> dict:
    if not isinstance(mapping, dict):
        if mapping is not None:
            problems.append(f"{what}: found a {type(mapping).__name__}, expected an object of tensor digests")
        return {}
    out = {}
    for n, d in mapping.items():
        try:
            name_bytes(n)
        except DigestError as e:
            problems.append(f"{what}: {e}")
            continue
        if _checked(d, f"{what}: {n!r}", problems) is not None:
            out[n] = d
    return out


def _read_json(path: str) -> Optional[dict]:
    """A small JSON file beside the set: a plain file, not through a link, bounded."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_SIDECAR:
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            d = json.loads(f.read(_MAX_SIDECAR))
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _from_index(layout: CheckpointLayout, stored: int, problems: list) -> Optional[Claim]:
    content = _index.recorded_content(layout)
    if not content:
        return None
    model = _checked(content.get("model"), f"{layout.index}: content model digest", problems)
    tensors = _named(content.get("tensors"), f"{layout.index}: content", problems)
    return Claim(layout.index, str(content.get("by") or "unknown"), model, tuple(tensors.items()), stored,
                 problems=tuple(problems))


def _from_safetensors(layout: CheckpointLayout, stored: int, problems: list) -> Optional[Claim]:
    files = [f.path for row in layout.files for f in row if f.path.endswith(".safetensors")]
    models, tensors, sources, writers, source_digests, seen = set(), {}, [], set(), set(), []
    for p in files:
        try:
            meta = read_safetensors_header(p)[0].get("__metadata__") or {}
        except OneloadError:
            continue
        if not isinstance(meta, dict):
            continue
        found = False
        if "oneload.digest" in meta:  # export-hf
            found = True
            models.add(_checked(meta["oneload.digest"], f"{p}: oneload.digest", problems))
            try:
                tensors.update(_named(json.loads(meta.get("oneload.tensor_digests") or "{}"),
                                      f"{p}: oneload.tensor_digests", problems))
            except (TypeError, ValueError) as e:
                problems.append(f"{p}: oneload.tensor_digests is not JSON ({e})")
            if meta.get("oneload.source_digest"):
                source_digests.add(_checked(meta["oneload.source_digest"], f"{p}: oneload.source_digest", problems))
            writers.add(str(meta.get("oneload.by") or "metaseq-oneload export-hf"))
        side = meta.get("metaseq_oneload")
        if isinstance(side, str) and os.path.basename(side) == side and side not in seen:  # convert's sidecar
            seen.append(side)
            doc = _read_json(os.path.join(os.path.dirname(p), side)) or {}
            content = (doc.get("oneload_digest") or {}).get("content") if isinstance(doc.get("oneload_digest"), dict) else None
            whole = (doc.get("model_parallel_size"), doc.get("shards")) == (1, 1)
            if isinstance(content, dict) and not whole:
                # The digest of a set of several files, read here as the one file it is.
                problems.append(f"{side}: its content digest describes a set of "
                                f"{doc.get('model_parallel_size')} x {doc.get('shards')} files, read here as one file")
            elif isinstance(content, dict):
                found = True
                models.add(_checked(content.get("model"), f"{side}: content model digest", problems))
                tensors.update(_named(content.get("tensors"), f"{side}: content", problems))
                writers.add(str(content.get("by") or "unknown"))
        if found:
            sources.append(p)
    if not sources:
        return None
    models.discard(None)
    source_digests.discard(None)
    if len(models) > 1:
        problems.append(f"the files record {len(models)} different model digests: none is taken")
    source = sources[0] + (f" + {len(sources) - 1} more" if len(sources) > 1 else "")
    return Claim(source, " / ".join(sorted(writers)) or "unknown", models.pop() if len(models) == 1 else None,
                 tuple(sorted(tensors.items())), stored,
                 source_digests.pop() if len(source_digests) == 1 else None, tuple(problems))


def recorded(layout: CheckpointLayout) -> Optional[Claim]:
    """(local) The content digests ``layout``'s set records about itself, or None. Reads
    only small metadata (the verified index again, safetensors headers, sidecars)."""
    stored = sum(1 for p in layout.parts for t in p.tensors.values() if getattr(t, "digest", None))
    problems: list = []
    claim = (_from_index(layout, stored, problems) if layout.index else None) or \
        _from_safetensors(layout, stored, problems)
    if claim is None and stored:
        claim = Claim(layout.index or layout.display_name, "unknown", None, (), stored, problems=tuple(problems))
    if claim is not None and claim.model is not None and claim.tensors:
        try:
            why = None if model_digest(dict(claim.tensors)) == claim.model else \
                "the recorded tensor digests do not give the recorded model digest"
        except (DigestError, UnicodeError) as e:  # _named refuses such names: a last guard
            why = f"the recorded tensor digests give no model digest ({e})"
        if why:
            claim = Claim(claim.source, claim.writer, claim.model, claim.tensors, claim.stored,
                          claim.source_digest, claim.problems + (why,))
    return claim
