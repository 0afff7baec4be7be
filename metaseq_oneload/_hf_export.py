"""metaseq checkpoints (any layout) -> a Hugging Face OPT folder, streamed.

Three steps, each in its own function:

``plan_opt`` (metadata only)
    Reads the checkpoint's ``cfg.model`` and tensor shapes, decides the ``OPTConfig`` and which
    metaseq tensor becomes which Hugging Face tensor, and refuses -- before anything is
    written -- whatever OPT cannot express (sinusoidal or no positions, scaled embeddings,
    alibi, gated activations, post-LN with a final layer norm...), naming the setting.
``shard_files``
    Packs the tensors into ``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` files
    of at most ``max_shard_size`` bytes each (a larger tensor gets a file of its own).
``export_hf``
    Writes each file with the package's streaming writer (``_writing.write_safetensors``:
    the header, then the tensor bytes chunk by chunk, ``chunk_mb`` at a time), each chunk
    filled straight from the checkpoint's byte ranges by the loading engine's planner: fused
    ``qkv_proj`` rows k, v, q become ``k_proj``/``v_proj``/``q_proj``, model-parallel parts
    are merged, FSDP flat shards unflattened. Peak memory is one chunk (twice that while
    merging row-parallel weights), never a tensor group or the model. Everything lands in one
    hidden folder beside the destination that is renamed into place at the end, so an
    interrupted export leaves nothing at the destination. The destination is never a file,
    link or folder of the source checkpoint, and ``overwrite`` replaces only a folder an
    export wrote (``_refuse_source``, ``_why_not_an_export``); what a killed export left is
    cleaned up, or put back, by the next one to the same destination (``_clean_stale``).

The mapping checked end to end: ``OPTForCausalLM.from_pretrained`` of the exported folder
reproduces the logits metaseq computed from the fixture checkpoints (tests/unit/test_hf_export.py).
"""

from __future__ import annotations

import errno
import glob
import math
import os
import re
import shutil
import stat
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping, Optional, Sequence, Union

import torch

from ._errors import ConversionError, OneloadError, OutputExistsError, UnsupportedArchitectureError
from ._layout import CheckpointLayout
from .formats import discover
from .formats._torchsave import _scan
from ._execute import fill as fill_target
from ._loading import OptionError, check_option
from ._plan import TargetTensor, plan_part
from ._reading import RangeReader
from ._writing import (SAFETENSORS_DTYPES, Piece, Record, make_temp, progress_bar, source_clash, stale_temps,
                       write_json, write_safetensors)

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

# metaseq's "gelu" is the tanh approximation (metaseq/modules/activation_functions.py);
# fairseq's "gelu" is the exact erf form and its "gelu_fast"/"gelu_accurate" the tanh one.
_ACTIVATIONS = {
    "metaseq": {"relu": "relu", "gelu": "gelu_new", "tanh": "tanh", "linear": "linear", "relu_squared": "relu2"},
    "fairseq": {"relu": "relu", "gelu": "gelu", "gelu_fast": "gelu_new", "gelu_accurate": "gelu_new",
                "tanh": "tanh", "linear": "linear"},
}
_GATED = ("swiglu", "geglu")

_LAYER = re.compile(
    r"decoder\.layers\.(\d+)\.(self_attn\.(?:k_proj|v_proj|q_proj|out_proj)|self_attn_layer_norm|fc1|fc2"
    r"|final_layer_norm)\.(weight|bias)$")
_FIXED = {
    "decoder.embed_tokens.weight": "model.decoder.embed_tokens.weight",
    "decoder.embed_positions.weight": "model.decoder.embed_positions.weight",
    "decoder.layer_norm.weight": "model.decoder.final_layer_norm.weight",
    "decoder.layer_norm.bias": "model.decoder.final_layer_norm.bias",
    "decoder.project_in_dim.weight": "model.decoder.project_in.weight",
    "decoder.project_out_dim.weight": "model.decoder.project_out.weight",
    "decoder.output_projection.weight": "lm_head.weight",
}
# Stored, but not weights of the model: metaseq's version marker, fairseq's sinusoidal
# position buffer (refused separately, with its setting).
_SKIPPED = (".version", "embed_positions._float_tensor")
# What metaseq's learned position table adds to a position: its padding index (1 in every
# fairseq/metaseq dictionary) + 1, exactly the offset Hugging Face OPT hard-codes.
_POSITION_OFFSET = 2


@dataclass(frozen=True)
class OPTTensor:
    """One tensor of the exported folder: its Hugging Face name and the planned metaseq
    tensor (fused qkv already split, model-parallel parts merged) its elements come from."""

    name: str
    source: TargetTensor

    @property
    def shape(self) -> tuple:
        return tuple(self.source.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.source.dtype

    @property
    def nbytes(self) -> int:
        return self.source.nbytes


@dataclass(frozen=True)
class OPTExportPlan:
    """What an export writes: the ``config.json`` contents and the tensors, in order."""

    config: Mapping
    tensors: tuple  # of OPTTensor
    layout: CheckpointLayout
    warnings: tuple = ()

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def num_params(self) -> int:
        return sum(t.source.numel for t in self.tensors)


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

    def to_dict(self) -> dict:
        d = asdict(self)
        d["files"] = list(self.files)
        d["config"] = dict(self.config)
        d["warnings"] = list(self.warnings)
        return d


# --------------------------------------------------------------------------- planning


# Every cfg.model argument plan_opt reads.
_READ_ARGS = frozenset((
    "activation_fn", "alibi", "attention_dropout", "attn_variant", "decoder_attention_heads", "decoder_embed_dim",
    "decoder_layers", "decoder_learned_pos", "decoder_normalize_before", "disable_affine_ln", "dropout",
    "layernorm_embedding", "max_target_positions", "no_decoder_final_norm", "no_scale_embedding",
    "self_attn_doc_sep", "share_decoder_input_output_embed"))


def _arg(args: Mapping, key: str, default=None):
    v = args.get(key, default)
    return default if v is None else v


def plan_opt(layout: CheckpointLayout, *, dtype: Optional[torch.dtype] = None) -> OPTExportPlan:
    """(local, metadata only) The OPT config and tensor mapping of a metaseq checkpoint.

    Args:
        layout: the checkpoint, from :func:`metaseq_oneload.inspect`.
        dtype: write the floating-point tensors in this dtype (default: as stored).

    Raises:
        UnsupportedArchitectureError: a setting OPT cannot express, or tensors it has no
            place for; the message lists every one found.
        ConversionError: the checkpoint is not a decoder-only metaseq/fairseq language model.
    """
    where = layout.display_name
    if layout.flavor not in ("metaseq", "fairseq"):
        raise ConversionError(
            f"{where}: a {layout.flavor} checkpoint; export-hf converts metaseq/fairseq language models "
            "(it needs their cfg.model for the architecture). Point it at a metaseq checkpoint.")
    args = layout.model_args()
    targets = plan_part(layout, 1, 0, qkv="split", dtype=dtype)
    problems: list = []  # (setting, why)

    def refuse(setting: str, why: str) -> None:
        problems.append((setting, why))

    # An argument the file holds as an interpolation is unknown (a file's values are never
    # resolved): a default in its place could describe another model.
    for key in sorted(set(getattr(args, "unresolved", {})) & _READ_ARGS):
        refuse(key, args.why_missing(key) + "; give the checkpoint a cfg.model with the value itself")

    # Settings first: they explain missing or extra tensors better than the names do.
    if _arg(args, "alibi", False):
        refuse("alibi=True", "OPT has learned absolute positions, not ALiBi attention biases")
    if not _arg(args, "decoder_learned_pos", "decoder.embed_positions.weight" in targets):
        refuse("decoder_learned_pos=False",
               "the model has no learned position table ("
               + ("fairseq's default: sinusoidal positions" if layout.flavor == "fairseq" else "metaseq then has none")
               + "); OPT needs a learned table with offset 2")
    if "decoder.embed_positions._float_tensor" in targets:
        refuse("sinusoidal positions", "decoder.embed_positions is fairseq's SinusoidalPositionalEmbedding")
    scaled = not _arg(args, "no_scale_embedding", False)
    if scaled:
        # The factor metaseq applies, sqrt of the embedding width: cfg.model's, else the
        # stored table's (a cfg may leave decoder_embed_dim out).
        dim = _arg(args, "decoder_embed_dim", None)
        embed = targets.get("decoder.embed_tokens.weight")
        if not dim and embed is not None and len(embed.shape) == 2:
            dim = embed.shape[1]
        factor = f"sqrt(decoder_embed_dim)={math.sqrt(dim):.4g}" if dim else "sqrt(decoder_embed_dim)"
        note = "" if "no_scale_embedding" in args else f" (not in cfg.model: {layout.flavor} defaults to scaling)"
        refuse("no_scale_embedding=False",
               f"{layout.flavor} multiplies token embeddings by {factor}{note}; OPT does not scale them")
    activation = str(_arg(args, "activation_fn", "relu"))
    table = _ACTIVATIONS["metaseq" if layout.flavor == "metaseq" else "fairseq"]
    if activation in _GATED:
        refuse(f"activation_fn={activation}", "a gated feed-forward (an extra gate projection) has no OPT counterpart")
    elif activation not in table:
        refuse(f"activation_fn={activation}", f"OPT export knows {', '.join(sorted(table))}")
    doc_sep = _arg(args, "self_attn_doc_sep", -1)
    if doc_sep != -1:
        refuse(f"self_attn_doc_sep={doc_sep}", "positions reset at document separators; OPT counts them straight through")
    variant = _arg(args, "attn_variant", "default")
    if variant not in ("default", "xformers_default"):
        refuse(f"attn_variant={variant}", "OPT implements standard scaled dot-product attention only")
    if _arg(args, "layernorm_embedding", False) or "decoder.layernorm_embedding.weight" in targets:
        refuse("layernorm_embedding=True", "OPT has no layer norm on the embeddings")

    # Tensors: every stored weight must have an OPT place.
    hf: list = []
    unknown: list = []
    for name, t in targets.items():
        if name.endswith(_SKIPPED):
            continue
        if name == "decoder.output_projection.weight" and t.alias_of is not None:
            continue  # tied to embed_tokens: OPT's lm_head is tied by config
        mapped = _FIXED.get(name) or ("model." + name if _LAYER.fullmatch(name) else None)
        if mapped is None:
            unknown.append(name)
            continue
        hf.append(OPTTensor(mapped, t))
    if unknown:
        refuse("tensors without an OPT counterpart",
               ", ".join(unknown[:6]) + (f" (+{len(unknown) - 6} more)" if len(unknown) > 6 else ""))
    by_name = {t.name: t for t in hf}

    def shape(name: str) -> Optional[tuple]:
        t = by_name.get(name)
        return None if t is None else t.shape

    layers = sorted({int(m.group(1)) for m in (_LAYER.fullmatch(t.name[len("model."):]) for t in hf
                                                if t.name.startswith("model.decoder.layers.")) if m})
    embed = shape("model.decoder.embed_tokens.weight")
    q = shape("model.decoder.layers.0.self_attn.q_proj.weight")
    fc1 = shape("model.decoder.layers.0.fc1.weight")
    if embed is None or q is None or fc1 is None or not layers:
        missing = [n for n, s in (("decoder.embed_tokens.weight", embed), ("decoder.layers.0 self_attn", q),
                                  ("decoder.layers.0.fc1", fc1)) if s is None]
        raise ConversionError(
            f"{where}: not a decoder-only transformer language model: no {', '.join(missing) or 'decoder layers'}. "
            "export-hf converts metaseq/fairseq transformer_lm checkpoints.")
    vocab, word_dim = embed
    hidden = q[1]
    ffn = fc1[0]
    if layers != list(range(len(layers))):
        refuse("decoder.layers", f"layer indices {layers} are not 0..{len(layers) - 1}")
    declared = args.get("decoder_layers")
    if declared is not None and declared != len(layers):
        refuse(f"decoder_layers={declared}", f"the checkpoint holds {len(layers)} layers")
    for i in layers:  # OPT layers are all alike
        for leaf, want in (("self_attn.q_proj.weight", q), ("fc1.weight", fc1)):
            got = shape(f"model.decoder.layers.{i}.{leaf}")
            if got != want:
                refuse(f"decoder.layers.{i}.{leaf}", f"shape {got} differs from layer 0's {want}; OPT layers are uniform")
    heads = args.get("decoder_attention_heads")
    if heads is None:
        if "decoder_attention_heads" not in getattr(args, "unresolved", {}):  # (else refused above)
            refuse("decoder_attention_heads", "not in cfg.model; the head count cannot be read from the weights")
    elif hidden % heads:
        refuse(f"decoder_attention_heads={heads}", f"does not divide the hidden size {hidden}")

    # Layer norms. metaseq (main) is always pre-LN with a final layer norm; fairseq says
    # decoder_normalize_before and no_decoder_final_norm.
    # Where the setting is absent (old-style args), the tensors tell: fairseq and metaseq
    # keep a final layer norm exactly when the layers are pre-LN.
    default_pre = layout.flavor == "metaseq" or "model.decoder.final_layer_norm.weight" in by_name
    pre_ln = bool(_arg(args, "decoder_normalize_before", default_pre))
    affine = not _arg(args, "disable_affine_ln", False)
    if affine:
        final_ln = "model.decoder.final_layer_norm.weight" in by_name
    else:
        final_ln = pre_ln and not _arg(args, "no_decoder_final_norm", False)
        if any("layer_norm" in t.name for t in hf):
            refuse("disable_affine_ln=True", "but the checkpoint stores layer-norm weights")
    if pre_ln and not final_ln:
        refuse("no final layer norm with pre-LN",
               "OPT with do_layer_norm_before=True always applies model.decoder.final_layer_norm")
    if not pre_ln and final_ln:
        refuse("decoder_normalize_before=False with a final layer norm",
               "post-LN OPT (do_layer_norm_before=False) has no final layer norm")

    # Biases: OPT's enable_bias switches all six linear biases of a layer together.
    bias_names = [f"model.decoder.layers.{i}.{leaf}.bias" for i in layers
                  for leaf in ("self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj", "self_attn.out_proj",
                               "fc1", "fc2")]
    present = [n in by_name for n in bias_names]
    if any(present) and not all(present):
        refuse("linear biases", "some attention/feed-forward biases are present and others not; OPT has them all or none")
    enable_bias = all(present)

    # Embedding projections (OPT-350m style): both or neither, and only when the sizes differ.
    p_in, p_out = shape("model.decoder.project_in.weight"), shape("model.decoder.project_out.weight")
    if word_dim != hidden:
        if p_in != (hidden, word_dim) or p_out != (word_dim, hidden):
            refuse("decoder_input_dim/decoder_output_dim",
                   f"embeddings of size {word_dim} and layers of size {hidden} need project_in_dim {(hidden, word_dim)} "
                   f"and project_out_dim {(word_dim, hidden)}; found {p_in} and {p_out}")
    elif p_in is not None or p_out is not None:
        refuse("project_in_dim/project_out_dim", "present although embedding and hidden sizes are equal; OPT drops them then")

    # Positions.
    pos = shape("model.decoder.embed_positions.weight")
    warnings: list = []
    max_positions = None
    if pos is None:
        if not any(s.startswith(("decoder_learned_pos", "sinusoidal")) for s, _ in problems):
            refuse("decoder_learned_pos=True without decoder.embed_positions.weight",
                   "cfg.model asks for a learned position table but the checkpoint holds none; OPT's "
                   "max_position_embeddings and position embeddings come from that table")
    elif len(pos) != 2 or pos[0] <= _POSITION_OFFSET or pos[1] != hidden:
        refuse("decoder.embed_positions.weight",
               f"shape {pos}; OPT needs (positions + 2, hidden size {hidden}) with at least one position")
    else:
        max_positions = pos[0] - _POSITION_OFFSET
        declared = args.get("max_target_positions")
        if declared is not None and declared != max_positions:
            warnings.append(f"the position table has {pos[0]} rows, i.e. {max_positions} positions after OPT's offset "
                            f"of 2, but cfg.model.max_target_positions={declared}; using {max_positions}.")

    # Output projection.
    tied = bool(_arg(args, "share_decoder_input_output_embed", "lm_head.weight" not in by_name))
    if not tied and "lm_head.weight" not in by_name:
        refuse("share_decoder_input_output_embed=False", "but the checkpoint has no decoder.output_projection.weight "
                                                         "(adaptive softmax?)")
    if tied and "lm_head.weight" in by_name:
        hf = [t for t in hf if t.name != "lm_head.weight"]  # stored, yet tied: equal to embed_tokens

    if problems:
        settings = [s for s, _ in problems]
        lines = "\n".join(f"  - {s}: {why}" for s, why in problems)
        # export-hf writes OPT only: there is no other architecture to suggest. The training
        # flags named are the writer's own (fairseq-train's or metaseq-train's).
        flags = list(dict.fromkeys(f for s in settings for k, f in _TRAIN_FLAGS.items() if s.startswith(k)))
        trainer = "fairseq-train" if layout.flavor == "fairseq" else "metaseq-train"
        raise UnsupportedArchitectureError(
            f"{where}: cannot be expressed as a Hugging Face OPT model; nothing was written.\n{lines}\n"
            "OPT is a pre-LN (or post-LN without final norm) decoder with learned positions (offset 2), unscaled "
            "embeddings and a relu/gelu/tanh/linear feed-forward, and export-hf writes OPT only, so this "
            f"{layout.flavor} model has no Hugging Face export here; its checkpoint still loads and converts as "
            "it is. A model trained with OPT's settings exports"
            + (f" ({trainer} {' '.join(flags)})." if flags else "."), settings)

    floats = [t.dtype for t in hf if t.dtype.is_floating_point]
    config_dtype = max(set(floats), key=floats.count) if floats else torch.float32
    config = {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": len(layers),
        "ffn_dim": ffn,
        "num_attention_heads": heads,
        "max_position_embeddings": max_positions,
        "word_embed_proj_dim": word_dim,
        "do_layer_norm_before": pre_ln,
        "activation_function": table[activation],
        "enable_bias": enable_bias,
        "layer_norm_elementwise_affine": affine,
        "tie_word_embeddings": tied,
        "dropout": float(_arg(args, "dropout", 0.1)),
        "attention_dropout": float(_arg(args, "attention_dropout", 0.0)),
        "layerdrop": 0.0,
        "init_std": 0.02,
        "use_cache": True,
        # fairseq/metaseq dictionaries: <s>=0, <pad>=1, </s>=2; OPT starts sequences with </s>.
        "pad_token_id": 1,
        "bos_token_id": 2,
        "eos_token_id": 2,
        "torch_dtype": str(config_dtype).replace("torch.", ""),
    }
    for t in hf:
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ConversionError(f"{where}: {t.source.name}: dtype {t.dtype} has no safetensors name.")
    return OPTExportPlan(config, tuple(hf), layout, tuple(warnings))


# --------------------------------------------------------------------------- files


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(size: Union[int, str]) -> int:
    """Bytes from ``5GB`` (10^9, as Hugging Face counts), ``2GiB``, ``500MB`` or an int."""
    if isinstance(size, int):
        n = size
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?i?b?)\s*", str(size).lower())
        if not m or m.group(2) not in _UNITS:
            raise OptionError(f"max_shard_size={size!r} (CLI: --max-shard-size {size}): expected bytes or a size "
                              "like 5GB, 500MB, 2GiB.")
        n = int(float(m.group(1)) * _UNITS[m.group(2)])
    if n <= 0:
        raise OptionError(f"max_shard_size={size!r} (CLI: --max-shard-size {size}): must be positive, e.g. 5GB.")
    return n


def shard_files(tensors: Sequence[OPTTensor], max_shard_bytes: int) -> list:
    """[(file name, [OPTTensor])]: greedy, in order; one file when everything fits."""
    groups: list = []
    current, used = [], 0
    for t in tensors:
        if current and used + t.nbytes > max_shard_bytes:
            groups.append(current)
            current, used = [], 0
        current.append(t)
        used += t.nbytes
    if current or not groups:
        groups.append(current)
    if len(groups) == 1:
        return [("model.safetensors", groups[0])]
    n = len(groups)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


# What an export writes into DST: the only names --overwrite and the stale cleanup ever remove.
_EXPORT_NAME = re.compile(
    r"config\.json|model\.safetensors|model-\d+-of-\d+\.safetensors|model\.safetensors\.index\.json")
_TMP, _OLD = "tmp", "old"  # _writing.make_temp kinds: .DST.oneload-tmp+HOST+PID+RANDOM, .DST.oneload-old+...


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

    Found by :func:`_writing.stale_temps`: this host's names, of pids that are gone.
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
            entries = _scan(d)
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


# The training flags that give the setting OPT needs, for the refusal's last line.
_TRAIN_FLAGS = {
    "decoder_learned_pos=False": "--decoder-learned-pos",
    "sinusoidal positions": "--decoder-learned-pos",
    "no_scale_embedding=False": "--no-scale-embedding",
    "layernorm_embedding=True": "without --layernorm-embedding",
    "alibi=True": "without --alibi",
}


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
    src: "str | os.PathLike | CheckpointLayout",
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
        src: any file of the checkpoint, its folder, un-suffixed name or glob (see
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
            ``(bytes written since the last call, tensors completed)``.

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
    dst = os.path.abspath(os.fspath(dst))
    layout = src if isinstance(src, CheckpointLayout) else discover(src, trust_pickle=trust_pickle)
    sources = _source_paths(layout, src)
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
    metadata = {"format": "pt", "source": layout.display_name, "converted_by": "metaseq-oneload export-hf"}
    total = plan.total_bytes
    chunk_bytes = max(1 << 16, int(chunk_mb * (1 << 20)))
    update, close_bar = progress_bar(progress, total, len(plan.tensors), "export-hf")
    tmp = None  # ours to remove, once made
    try:
        tmp = make_temp(dst, folder=True, kind=_TMP)
        with RangeReader(chunk_bytes=chunk_bytes, trust_pickle=trust_pickle) as reader:
            def fill(target, out, start):
                fill_target(target, out, start, reader)

            for name, group in files:
                entries = [(t.name, t.shape, t.dtype, Record((Piece(t.source, 0, t.source.numel, t.dtype),)))
                           for t in group]
                write_safetensors(os.path.join(tmp, name), entries, metadata, fill, chunk_bytes=chunk_bytes,
                                  progress=update)
        if len(files) > 1:
            write_json(os.path.join(tmp, "model.safetensors.index.json"),
                       {"metadata": {"total_size": total},
                        "weight_map": {t.name: name for name, group in files for t in group}})
        write_json(os.path.join(tmp, "config.json"), plan.config)
        _fsync_dir(tmp)
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
        close_bar()
    return HFExport(
        src=layout.display_name,
        dst=dst,
        kind=layout.kind,
        files=tuple(n for n, _ in files) + (("model.safetensors.index.json",) if len(files) > 1 else ())
        + ("config.json",),
        num_tensors=len(plan.tensors),
        num_params=plan.num_params,
        total_bytes=total,
        seconds=time.perf_counter() - t0,
        config=plan.config,
        warnings=plan.warnings + tuple(layout.warnings) + tuple(notes),
    )
