"""metaseq checkpoints (any layout) -> a Hugging Face OPT folder, streamed.

What the folder holds is planned in :mod:`._hf_opt` (``plan_opt``: the ``OPTConfig`` and
which metaseq tensor becomes which Hugging Face tensor, refusing before anything is written
whatever OPT cannot express; ``shard_files``: the safetensors files). :func:`export_hf`
writes each file with the package's file sink (``_writing.write_safetensors``: the header,
then the tensor bytes chunk by chunk, ``chunk_mb`` at a time): each tensor is one read item
of its planned metaseq tensor, which the one executor (``_execute.stream``) carries out
straight from the checkpoint's byte ranges: fused ``qkv_proj`` rows k, v, q become
``k_proj``/``v_proj``/``q_proj``, model-parallel parts are merged, FSDP flat shards
unflattened. Peak memory is one chunk (twice that while merging row-parallel weights), never
a tensor group or the model. Everything lands in one hidden folder beside the destination
that is renamed into place at the end, so an interrupted export leaves nothing at the
destination. The destination is never a file, link or folder of the source checkpoint, and
``overwrite`` replaces only a folder an export wrote (``_refuse_source``,
``_why_not_an_export``); what a killed export left is cleaned up, or put back, by the next one
to the same destination (``_clean_stale``).

The mapping checked end to end: ``OPTForCausalLM.from_pretrained`` of the exported folder
reproduces the logits metaseq computed from the fixture checkpoints (tests/unit/test_hf_export.py).
"""

from __future__ import annotations

import errno
import glob
import os
import re
import shutil
import stat
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping, Optional, Union

import torch

from ._errors import ConversionError, OneloadError, OutputExistsError, UnsupportedArchitectureError
from ._hf_opt import OPTExportPlan, OPTTensor, parse_size, plan_opt, shard_files
from ._layout import CheckpointLayout
from ._options import check_option
from ._outputs import local_destination, make_temp, source_clash, stale_temps
from ._reading import RangeReader
from ._threads import check_signals
from ._digest_record import ExportDigests
from ._writing import Meter, executor_chunks, whole_record, write_json, write_safetensors
from .formats import discover
from .formats._torchsave import scan

__all__ = [
    "UnsupportedArchitectureError",
    "OPTTensor",
    "OPTExportPlan",
    "HFExport",
    "plan_opt",
    "shard_files",
    "export_hf",
    "parse_size",
]


@dataclass(frozen=True)
class HFExport:
    """What :func:`export_hf` wrote."""

    src: str
    dst: str
    kind: str
    files: tuple  # file names inside dst
    num_tensors: int
    num_params: int
    total_bytes: int
    seconds: float
    config: Mapping
    warnings: tuple = field(default=())
    # Recorded in every file's ``__metadata__`` (docs/digest.md): the model digest of the
    # exported tensors ("oneload.digest") and the source's content digest, metaseq names and
    # fused qkv_proj ("oneload.source_digest"; None where the export's bytes are not the source's).
    digest: Optional[str] = None
    source_digest: Optional[str] = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["files"] = list(self.files)
        d["config"] = dict(self.config)
        d["warnings"] = list(self.warnings)
        return d



# --------------------------------------------------------------------------- the destination


# What an export writes into DST: the only names --overwrite and the stale cleanup ever remove.
_EXPORT_NAME = re.compile(
    r"config\.json|model\.safetensors|model-\d+-of-\d+\.safetensors|model\.safetensors\.index\.json")
_TMP, _OLD = "tmp", "old"  # _outputs.make_temp kinds: .DST.oneload-tmp+HOST+PID+RANDOM, .DST.oneload-old+...


def _export_names(folder: str) -> Optional[list]:
    """The entries of ``folder`` when all are regular files an export writes, else None."""
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    for n in names:
        try:
            regular = stat.S_ISREG(os.lstat(os.path.join(folder, n)).st_mode)
        except OSError:
            return None
        if not regular or not _EXPORT_NAME.fullmatch(n):
            return None
    return names


def _remove_export(folder: str) -> bool:
    """Remove a folder an export wrote, file by file; anything else in it (or put there
    meanwhile) is left, and so is the folder. Returns whether it is gone."""
    names = _export_names(folder)
    if names is None:
        return False
    for n in names:
        try:
            os.unlink(os.path.join(folder, n))
        except FileNotFoundError:
            pass
    try:
        os.rmdir(folder)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def _clean_stale(dst: str) -> list:
    """(local) Leftovers of exports to ``dst`` killed on this host; returns notes for the user.

    Found by :func:`._outputs.stale_temps`: this host's names, of pids that are gone.
    ``.oneload-tmp+*``: an unfinished export, removed. ``.oneload-old+*``: the previous DST,
    moved aside by an ``--overwrite`` killed before it moved the new folder in (DST missing:
    it is put back) or while removing the old one (DST present: removed). Only folders
    holding nothing but export files are touched."""
    notes = []
    olds = stale_temps(dst, kinds=(_OLD,))
    if olds and not os.path.lexists(dst):
        # Not an empty one: killed after naming it, before moving DST there (DST since removed).
        complete = [o for o in olds if _why_not_an_export(o) is None and os.listdir(o)]
        if complete:
            back = max(complete, key=lambda o: os.stat(o).st_mtime)
            try:
                os.rename(back, dst)
                olds.remove(back)
                notes.append(f"{dst} was put back from {os.path.basename(back)}, where an export with overwrite=True "
                             "(CLI: --overwrite) killed before it finished had moved it")
            except OSError:
                pass
    for folder in olds + stale_temps(dst, kinds=(_TMP,)):
        if not _remove_export(folder) and os.path.lexists(folder):
            notes.append(f"{folder}: left in place; it holds files an export does not write")
    return notes


def _source_paths(layout: CheckpointLayout, src) -> dict:
    """{path: the checkpoint file it is or names}: the checkpoint's files, and the links and
    text pointers naming them in its folder and in the folder of the path given (that path
    included)."""
    members = {os.path.realpath(f.path): os.path.abspath(f.path) for f in layout.all_files}
    paths = {os.path.abspath(f.path): os.path.abspath(f.path) for f in layout.all_files}
    folders = {layout.directory}
    if not isinstance(src, CheckpointLayout):
        given = os.path.abspath(os.fspath(src))
        for g in (glob.glob(given) if glob.has_magic(given) else [given]):
            if os.path.isdir(g):
                folders.add(g)
            elif os.path.lexists(g):
                paths.setdefault(g, members.get(os.path.realpath(g), os.path.realpath(g)))
                folders.add(os.path.dirname(g))
    for d in folders:
        try:
            entries = scan(d)
        except OneloadError:
            continue
        for e in entries:
            member = members.get(os.path.realpath(e.real))
            if member is not None:
                paths[os.path.join(d, e.name)] = member
    return paths


def _ids(path: str) -> set:
    out = set()
    for f in (os.stat, os.lstat):
        try:
            st = f(path)
            out.add((st.st_dev, st.st_ino))
        except OSError:
            pass
    return out


def _within(path: str, folder: str) -> bool:
    return path != folder and os.path.commonpath([path, folder]) == folder



def _refuse_source(dst: str, sources: Mapping[str, str]) -> None:
    """Refuse a destination that is a file or link of the source checkpoint (by path, real
    path or inode), a folder above one (through links too), or a path inside one."""
    clash = source_clash(dst, sources)  # is one, links to one, or a folder (not a link) holding one
    real = os.path.realpath(dst)
    holds = inside = None
    for s in sources:
        s_real = os.path.realpath(s)
        if holds is None and (_within(s, dst) or _within(s_real, real)):
            holds = s
        if inside is None and (_within(dst, s) or _within(real, s_real)):
            inside = s
    if clash is not None and not os.path.isdir(dst):
        member = sources[clash]
        what = "the source checkpoint file" if dst == member else "a link to the source checkpoint file"
        raise OutputExistsError(f"{dst}: is {what} {os.path.basename(member)}; export-hf never writes over its "
                                "source. Choose another destination.")
    if clash is not None or holds is not None:
        raise OutputExistsError(
            f"{dst}: holds the source checkpoint ({os.path.basename(holds or clash)}); export-hf never replaces its "
            "source. Choose another destination.")
    if inside is not None:
        raise OutputExistsError(f"{dst}: lies inside the source checkpoint file {inside}. Choose another destination.")


def _why_not_an_export(path: str, source_ids: "set | frozenset" = frozenset()) -> Optional[str]:
    """None when ``path`` may be replaced: a folder an export wrote (``config.json``,
    ``model*.safetensors``, perhaps the index, nothing else) or an empty folder; else why not."""
    if os.path.islink(path):
        return f"is a symbolic link (to {os.path.realpath(path)})"
    if not os.path.isdir(path):
        return "is not a folder"
    names = _export_names(path)
    if names is None:
        try:
            others = sorted(n for n in os.listdir(path) if not _EXPORT_NAME.fullmatch(n)
                            or not stat.S_ISREG(os.lstat(os.path.join(path, n)).st_mode))
        except OSError as e:
            return f"cannot be listed ({e.strerror or e})"
        return (f"holds {', '.join(others[:4])}{' ...' if len(others) > 4 else ''}, which an export does not write")
    if not names:
        return None
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        return "is not a complete export (it needs config.json and model*.safetensors)"
    linked = [n for n in names if _ids(os.path.join(path, n)) & source_ids]
    if linked:
        return f"holds {linked[0]}, a link to a file of the source checkpoint"
    return None


def _refuse_replacing(dst: str, why: str) -> None:
    raise OutputExistsError(
        f"{dst}: not replaced: it {why}. overwrite=True (CLI: --overwrite) replaces only a folder export-hf wrote "
        "(config.json, model*.safetensors, model.safetensors.index.json) or an empty folder. Choose another "
        "destination, or move it away yourself.")


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# Threads of one process exporting to one destination move into place one at a time (other
# processes doing so get a clear error and lose nothing).
_move_lock = threading.Lock()


def _move_into_place(tmp: str, dst: str, overwrite: bool, source_ids: set) -> list:
    """(local) Rename the finished ``tmp`` to ``dst``; an existing ``dst`` (checked again:
    it may have appeared or changed during the export) is moved aside first and removed after.
    Killed between the two renames, the next export to ``dst`` puts the old folder back
    (:func:`_clean_stale`); interrupted (SIGTERM, Ctrl-C), it is put back here."""
    parent = os.path.dirname(dst)
    old = None
    check_signals(commit=True)  # interrupted (also where its exception was lost): never commit
    with _move_lock:
        try:
            if os.path.lexists(dst):
                if not overwrite:
                    raise OutputExistsError(f"{dst}: appeared during the export (another export to it?); nothing "
                                            "was replaced. Pass overwrite=True (CLI: --overwrite) to replace it.")
                why = _why_not_an_export(dst, source_ids)
                if why:
                    _refuse_replacing(dst, why)
                old = make_temp(dst, folder=True, kind=_OLD)  # empty: the rename replaces it
                os.rename(dst, old)
            try:
                os.rename(tmp, dst)
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise OutputExistsError(f"{dst}: appeared while this export moved into place (another process "
                                            "exporting to it?); this export was not moved in.") from e
                raise ConversionError(f"{dst}: could not move the finished export into place "
                                      f"({e.strerror or e}).") from e
        except BaseException:
            if old is not None and os.path.lexists(old):
                if not os.path.lexists(dst) and os.listdir(old):
                    os.rename(old, dst)  # put back
                else:  # the rename aside never ran (an empty name), or another export took DST's place
                    _remove_export(old)
            raise
    _fsync_dir(parent)
    if old is not None and not _remove_export(old) and os.path.lexists(old):
        return [f"{old}: the replaced folder was left in place; something was added to it during the export"]
    return []




def export_hf(
    path: "str | os.PathLike | CheckpointLayout",
    dst: "str | os.PathLike",
    *,
    max_shard_size: Union[int, str] = "5GB",
    dtype: Optional[torch.dtype] = None,
    overwrite: bool = False,
    chunk_mb: float = 64,
    trust_pickle: bool = False,
    progress: "Optional[bool] | Callable[[int, int], None]" = None,
) -> HFExport:
    """(local, one process) Convert a metaseq checkpoint of any layout into a Hugging Face OPT folder.

    Writes ``config.json`` and ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors``
    with ``model.safetensors.index.json`` when the tensors exceed ``max_shard_size``) that
    ``transformers.OPTForCausalLM.from_pretrained(dst)`` loads.

    Args:
        path: any file of the checkpoint, its folder, un-suffixed name or glob (see
            :func:`metaseq_oneload.inspect`): singleton, model-parallel parts, FSDP shards.
        dst: the folder to create.
        max_shard_size: largest safetensors file, e.g. ``"5GB"`` (10^9 bytes), ``"2GiB"``.
        dtype: write floating-point weights in this dtype (default: as stored).
        overwrite: replace an existing ``dst``, only once the new folder is complete, and only
            when it is a folder an export wrote (config.json, model*.safetensors, the index) or
            an empty one.
        chunk_mb: bytes read and written at a time; the export's peak extra memory.
        trust_pickle: unpickle without the allowlist. Unsafe: runs code from the file.
        progress: a progress bar (default: when stderr is a terminal), or a callable
            ``(bytes written so far, bytes in all)``.

    Returns:
        :class:`HFExport` (files, sizes, the config written).

    Raises:
        UnsupportedArchitectureError: the architecture cannot be expressed as OPT (names the
            settings); nothing is written.
        OutputExistsError: ``dst`` exists without ``overwrite``; it is, holds, or lies inside a
            file or link of the source checkpoint; or, with ``overwrite``, it is not a folder an
            export wrote.
        ConversionError: the source is not a language model, or writing failed.
        CheckpointLayoutError: the checkpoint files are incomplete or damaged.

    Example::

        export_hf("/ckpt/checkpoint_last.pt", "/out/opt-hf", max_shard_size="2GB")
    """
    t0 = time.perf_counter()
    check_option("chunk_mb", chunk_mb)
    parse_size(max_shard_size)  # a bad size is refused before anything is read
    dst = os.path.abspath(local_destination(dst))
    layout = path if isinstance(path, CheckpointLayout) else discover(path, trust_pickle=trust_pickle)
    sources = _source_paths(layout, path)
    _refuse_source(dst, sources)
    source_ids = set().union(*(_ids(s) for s in sources.values()))
    parent = os.path.dirname(dst)
    notes = _clean_stale(dst) if os.path.isdir(parent) else []
    if os.path.lexists(dst):
        if not overwrite:
            raise OutputExistsError(
                f"{dst} already exists; export-hf writes a new folder. Choose another destination, or pass "
                "overwrite=True (CLI: --overwrite) to replace it once the export is complete."
                + "".join(f" Note: {n}." for n in notes))
        why = _why_not_an_export(dst, source_ids)
        if why:
            _refuse_replacing(dst, why)
    plan = plan_opt(layout, dtype=dtype)
    files = shard_files(plan.tensors, parse_size(max_shard_size))
    if not os.path.isdir(parent):
        raise ConversionError(f"{dst}: the parent folder {parent} does not exist. Create it first.")
    # One hidden folder renamed into place at the end: DST appears complete or not at all.
    meter = Meter(progress, plan.total_bytes, len(plan.tensors), "export-hf")
    tmp = None  # ours to remove, once made
    try:
        tmp = make_temp(dst, folder=True, kind=_TMP)
        digests = _write_folder(tmp, plan, files, max(1 << 16, int(chunk_mb * (1 << 20))), trust_pickle, meter)
        notes += _move_into_place(tmp, dst, overwrite, source_ids)
        tmp = None
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OneloadError):
            raise
        hint = ("the disk is full: free space or choose another folder" if e.errno == errno.ENOSPC
                else "check the destination folder's permissions and free space")
        raise ConversionError(f"{dst}: cannot write ({e.strerror or e}); {hint}. Nothing was left at {dst}.") from e
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        meter.close()
    return HFExport(
        src=layout.display_name,
        dst=dst,
        kind=layout.kind,
        files=tuple(n for n, _ in files) + (("model.safetensors.index.json",) if len(files) > 1 else ())
        + ("config.json",),
        num_tensors=len(plan.tensors),
        num_params=plan.num_params,
        total_bytes=plan.total_bytes,
        seconds=time.perf_counter() - t0,
        config=plan.config,
        warnings=plan.warnings + tuple(layout.warnings) + tuple(notes) + digests.notes,
        digest=digests.model,
        source_digest=digests.source_digest,
    )


def _write_folder(tmp: str, plan: OPTExportPlan, files: list, chunk_bytes: int, trust_pickle: bool,
                  meter: Meter) -> ExportDigests:
    """(local) The export's files into the folder ``tmp``: each tensor the one read item of
    its planned metaseq tensor, carried out by the executor into its safetensors file, and
    hashed on the way (:class:`ExportDigests`); each file's header, with the digests, last."""
    metadata = {"format": "pt", "source": plan.layout.display_name, "converted_by": "metaseq-oneload export-hf"}
    sources = {t.name: t.source for t in plan.tensors}
    digests = ExportDigests(plan)
    late: list = []
    try:
        with RangeReader(chunk_bytes=chunk_bytes, trust_pickle=trust_pickle) as reader:
            chunks = executor_chunks(sources, reader, chunk_bytes, tap=digests.tap)
            for name, group in files:
                entries = [(t.name, t.shape, t.dtype, whole_record(t.name, t.source)) for t in group]
                write_safetensors(os.path.join(tmp, name), entries, {**metadata, **digests.placeholder(group)}, chunks,
                                  progress=meter, late=late)
            digests.finish(reader, chunk_bytes)
        for header, (name, group) in zip(late, files):
            header.finish({**metadata, **digests.metadata(group)})
    finally:
        for header in late:
            header.close()
    if len(files) > 1:
        write_json(os.path.join(tmp, "model.safetensors.index.json"),
                   {"metadata": {"total_size": plan.total_bytes, **digests.folder_metadata()},
                    "weight_map": {t.name: name for name, group in files for t in group}})
    write_json(os.path.join(tmp, "config.json"), plan.config)
    _fsync_dir(tmp)
    return digests
