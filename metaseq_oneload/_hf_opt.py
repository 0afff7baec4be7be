"""metaseq/fairseq language models as Hugging Face OPT: the config and the tensor mapping.

:func:`plan_opt` (metadata only) reads the checkpoint's ``cfg.model`` and tensor shapes,
decides the ``OPTConfig`` and which metaseq tensor becomes which Hugging Face tensor, and
refuses -- before anything is written -- whatever OPT cannot express (sinusoidal or no
positions, scaled embeddings, alibi, gated activations, post-LN with a final layer norm...),
naming the setting. :func:`shard_files` packs the tensors into ``model.safetensors`` or
``model-0000k-of-0000n.safetensors`` files of at most ``max_shard_size`` bytes each (a larger
tensor gets a file of its own). Writing them is :mod:`._hf_export`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

import torch

from ._errors import ConversionError, UnsupportedArchitectureError
from ._layout import CheckpointLayout
from ._errors import OptionError
from ._plan import TargetTensor, plan_part
from ._writing import SAFETENSORS_DTYPES

__all__ = ["OPTTensor", "OPTExportPlan", "plan_opt", "shard_files", "parse_size"]

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



# The training flags that give the setting OPT needs, for the refusal's last line.
_TRAIN_FLAGS = {
    "decoder_learned_pos=False": "--decoder-learned-pos",
    "sinusoidal positions": "--decoder-learned-pos",
    "no_scale_embedding=False": "--no-scale-embedding",
    "layernorm_embedding=True": "without --layernorm-embedding",
    "alibi=True": "without --alibi",
}


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
    if layout.flavor not in ("metaseq", "fairseq"):
        raise ConversionError(
            f"{layout.display_name}: a {layout.flavor} checkpoint; export-hf converts metaseq/fairseq language models "
            "(it needs their cfg.model for the architecture). Point it at a metaseq checkpoint.")
    r = _Reading(layout, plan_part(layout, 1, 0, qkv="split", dtype=dtype))
    # Settings first: they explain missing or extra tensors better than the names do.
    activation = r.settings()
    r.map_tensors()
    dims = r.dimensions()
    pre_ln, affine = r.layer_norms()
    enable_bias = r.biases(dims["layers"])
    r.projections(dims["word_dim"], dims["hidden"])
    max_positions = r.positions(dims["hidden"])
    tied = r.output_projection()
    r.raise_problems()
    floats = [t.dtype for t in r.hf if t.dtype.is_floating_point]
    config_dtype = max(set(floats), key=floats.count) if floats else torch.float32
    config = {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "vocab_size": dims["vocab"],
        "hidden_size": dims["hidden"],
        "num_hidden_layers": len(dims["layers"]),
        "ffn_dim": dims["ffn"],
        "num_attention_heads": dims["heads"],
        "max_position_embeddings": max_positions,
        "word_embed_proj_dim": dims["word_dim"],
        "do_layer_norm_before": pre_ln,
        "activation_function": activation,
        "enable_bias": enable_bias,
        "layer_norm_elementwise_affine": affine,
        "tie_word_embeddings": tied,
        "dropout": float(_arg(r.args, "dropout", 0.1)),
        "attention_dropout": float(_arg(r.args, "attention_dropout", 0.0)),
        "layerdrop": 0.0,
        "init_std": 0.02,
        "use_cache": True,
        # fairseq/metaseq dictionaries: <s>=0, <pad>=1, </s>=2; OPT starts sequences with </s>.
        "pad_token_id": 1,
        "bos_token_id": 2,
        "eos_token_id": 2,
        "torch_dtype": str(config_dtype).replace("torch.", ""),
    }
    for t in r.hf:
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ConversionError(f"{layout.display_name}: {t.source.name}: dtype {t.dtype} has no safetensors name.")
    return OPTExportPlan(config, tuple(r.hf), layout, tuple(r.warnings))


class _Reading:
    """(local) What :func:`plan_opt` has found so far: the problems (setting, why), in the
    order the refusal lists them, the Hugging Face tensors, the warnings."""

    def __init__(self, layout: CheckpointLayout, targets: Mapping[str, TargetTensor]):
        self.layout, self.targets = layout, targets
        self.args = layout.model_args()
        self.problems: list = []
        self.warnings: list = []
        self.hf: list = []
        self.by_name: dict = {}

    def refuse(self, setting: str, why: str) -> None:
        self.problems.append((setting, why))

    def shape(self, name: str) -> Optional[tuple]:
        t = self.by_name.get(name)
        return None if t is None else t.shape

    def settings(self) -> str:
        """Refuse what OPT cannot express; returns OPT's name of the activation."""
        args, targets, flavor = self.args, self.targets, self.layout.flavor
        # An argument the file holds as an interpolation is unknown (a file's values are never
        # resolved): a default in its place could describe another model.
        for key in sorted(set(getattr(args, "unresolved", {})) & _READ_ARGS):
            self.refuse(key, args.why_missing(key) + "; give the checkpoint a cfg.model with the value itself")
        if _arg(args, "alibi", False):
            self.refuse("alibi=True", "OPT has learned absolute positions, not ALiBi attention biases")
        if not _arg(args, "decoder_learned_pos", "decoder.embed_positions.weight" in targets):
            self.refuse("decoder_learned_pos=False",
                        "the model has no learned position table ("
                        + ("fairseq's default: sinusoidal positions" if flavor == "fairseq" else "metaseq then has none")
                        + "); OPT needs a learned table with offset 2")
        if "decoder.embed_positions._float_tensor" in targets:
            self.refuse("sinusoidal positions", "decoder.embed_positions is fairseq's SinusoidalPositionalEmbedding")
        if not _arg(args, "no_scale_embedding", False):
            # The factor metaseq applies, sqrt of the embedding width: cfg.model's, else the
            # stored table's (a cfg may leave decoder_embed_dim out).
            dim = _arg(args, "decoder_embed_dim", None)
            embed = targets.get("decoder.embed_tokens.weight")
            if not dim and embed is not None and len(embed.shape) == 2:
                dim = embed.shape[1]
            factor = f"sqrt(decoder_embed_dim)={math.sqrt(dim):.4g}" if dim else "sqrt(decoder_embed_dim)"
            note = "" if "no_scale_embedding" in args else f" (not in cfg.model: {flavor} defaults to scaling)"
            self.refuse("no_scale_embedding=False",
                        f"{flavor} multiplies token embeddings by {factor}{note}; OPT does not scale them")
        activation = str(_arg(args, "activation_fn", "relu"))
        table = _ACTIVATIONS["metaseq" if flavor == "metaseq" else "fairseq"]
        if activation in _GATED:
            self.refuse(f"activation_fn={activation}", "a gated feed-forward (an extra gate projection) has no OPT "
                        "counterpart")
        elif activation not in table:
            self.refuse(f"activation_fn={activation}", f"OPT export knows {', '.join(sorted(table))}")
        doc_sep = _arg(args, "self_attn_doc_sep", -1)
        if doc_sep != -1:
            self.refuse(f"self_attn_doc_sep={doc_sep}", "positions reset at document separators; OPT counts them "
                        "straight through")
        variant = _arg(args, "attn_variant", "default")
        if variant not in ("default", "xformers_default"):
            self.refuse(f"attn_variant={variant}", "OPT implements standard scaled dot-product attention only")
        if _arg(args, "layernorm_embedding", False) or "decoder.layernorm_embedding.weight" in targets:
            self.refuse("layernorm_embedding=True", "OPT has no layer norm on the embeddings")
        return table.get(activation)

    def map_tensors(self) -> None:
        """Every stored weight must have an OPT place."""
        unknown: list = []
        for name, t in self.targets.items():
            if name.endswith(_SKIPPED):
                continue
            if name == "decoder.output_projection.weight" and t.alias_of is not None:
                continue  # tied to embed_tokens: OPT's lm_head is tied by config
            mapped = _FIXED.get(name) or ("model." + name if _LAYER.fullmatch(name) else None)
            if mapped is None:
                unknown.append(name)
                continue
            self.hf.append(OPTTensor(mapped, t))
        if unknown:
            self.refuse("tensors without an OPT counterpart",
                        ", ".join(unknown[:6]) + (f" (+{len(unknown) - 6} more)" if len(unknown) > 6 else ""))
        self.by_name = {t.name: t for t in self.hf}

    def dimensions(self) -> dict:
        """vocab, word_dim, hidden, ffn, layers, heads, from the tensors (and cfg.model's heads)."""
        layers = sorted({int(m.group(1)) for m in (_LAYER.fullmatch(t.name[len("model."):]) for t in self.hf
                                                    if t.name.startswith("model.decoder.layers.")) if m})
        embed = self.shape("model.decoder.embed_tokens.weight")
        q = self.shape("model.decoder.layers.0.self_attn.q_proj.weight")
        fc1 = self.shape("model.decoder.layers.0.fc1.weight")
        if embed is None or q is None or fc1 is None or not layers:
            missing = [n for n, s in (("decoder.embed_tokens.weight", embed), ("decoder.layers.0 self_attn", q),
                                      ("decoder.layers.0.fc1", fc1)) if s is None]
            raise ConversionError(
                f"{self.layout.display_name}: not a decoder-only transformer language model: no "
                f"{', '.join(missing) or 'decoder layers'}. export-hf converts metaseq/fairseq transformer_lm checkpoints.")
        hidden = q[1]
        if layers != list(range(len(layers))):
            self.refuse("decoder.layers", f"layer indices {layers} are not 0..{len(layers) - 1}")
        declared = self.args.get("decoder_layers")
        if declared is not None and declared != len(layers):
            self.refuse(f"decoder_layers={declared}", f"the checkpoint holds {len(layers)} layers")
        for i in layers:  # OPT layers are all alike
            for leaf, want in (("self_attn.q_proj.weight", q), ("fc1.weight", fc1)):
                got = self.shape(f"model.decoder.layers.{i}.{leaf}")
                if got != want:
                    self.refuse(f"decoder.layers.{i}.{leaf}",
                                f"shape {got} differs from layer 0's {want}; OPT layers are uniform")
        heads = self.args.get("decoder_attention_heads")
        if heads is None:
            if "decoder_attention_heads" not in getattr(self.args, "unresolved", {}):  # (else refused above)
                self.refuse("decoder_attention_heads", "not in cfg.model; the head count cannot be read from the weights")
        elif hidden % heads:
            self.refuse(f"decoder_attention_heads={heads}", f"does not divide the hidden size {hidden}")
        return {"vocab": embed[0], "word_dim": embed[1], "hidden": hidden, "ffn": fc1[0], "layers": layers,
                "heads": heads}

    def layer_norms(self) -> tuple:
        """(pre-LN, affine). metaseq (main) is always pre-LN with a final layer norm; fairseq
        says decoder_normalize_before and no_decoder_final_norm. Where the setting is absent
        (old-style args), the tensors tell: fairseq and metaseq keep a final layer norm
        exactly when the layers are pre-LN."""
        args = self.args
        default_pre = self.layout.flavor == "metaseq" or "model.decoder.final_layer_norm.weight" in self.by_name
        pre_ln = bool(_arg(args, "decoder_normalize_before", default_pre))
        affine = not _arg(args, "disable_affine_ln", False)
        if affine:
            final_ln = "model.decoder.final_layer_norm.weight" in self.by_name
        else:
            final_ln = pre_ln and not _arg(args, "no_decoder_final_norm", False)
            if any("layer_norm" in t.name for t in self.hf):
                self.refuse("disable_affine_ln=True", "but the checkpoint stores layer-norm weights")
        if pre_ln and not final_ln:
            self.refuse("no final layer norm with pre-LN",
                        "OPT with do_layer_norm_before=True always applies model.decoder.final_layer_norm")
        if not pre_ln and final_ln:
            self.refuse("decoder_normalize_before=False with a final layer norm",
                        "post-LN OPT (do_layer_norm_before=False) has no final layer norm")
        return pre_ln, affine

    def biases(self, layers: Sequence[int]) -> bool:
        """OPT's enable_bias switches all six linear biases of a layer together."""
        names = [f"model.decoder.layers.{i}.{leaf}.bias" for i in layers
                 for leaf in ("self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj", "self_attn.out_proj",
                              "fc1", "fc2")]
        present = [n in self.by_name for n in names]
        if any(present) and not all(present):
            self.refuse("linear biases",
                        "some attention/feed-forward biases are present and others not; OPT has them all or none")
        return all(present)

    def projections(self, word_dim: int, hidden: int) -> None:
        """Embedding projections (OPT-350m style): both or neither, and only when the sizes differ."""
        p_in, p_out = self.shape("model.decoder.project_in.weight"), self.shape("model.decoder.project_out.weight")
        if word_dim != hidden:
            if p_in != (hidden, word_dim) or p_out != (word_dim, hidden):
                self.refuse("decoder_input_dim/decoder_output_dim",
                            f"embeddings of size {word_dim} and layers of size {hidden} need project_in_dim "
                            f"{(hidden, word_dim)} and project_out_dim {(word_dim, hidden)}; found {p_in} and {p_out}")
        elif p_in is not None or p_out is not None:
            self.refuse("project_in_dim/project_out_dim",
                        "present although embedding and hidden sizes are equal; OPT drops them then")

    def positions(self, hidden: int) -> Optional[int]:
        """OPT's max_position_embeddings, from the learned table (offset 2)."""
        pos = self.shape("model.decoder.embed_positions.weight")
        if pos is None:
            if not any(s.startswith(("decoder_learned_pos", "sinusoidal")) for s, _ in self.problems):
                self.refuse("decoder_learned_pos=True without decoder.embed_positions.weight",
                            "cfg.model asks for a learned position table but the checkpoint holds none; OPT's "
                            "max_position_embeddings and position embeddings come from that table")
            return None
        if len(pos) != 2 or pos[0] <= _POSITION_OFFSET or pos[1] != hidden:
            self.refuse("decoder.embed_positions.weight",
                        f"shape {pos}; OPT needs (positions + 2, hidden size {hidden}) with at least one position")
            return None
        max_positions = pos[0] - _POSITION_OFFSET
        declared = self.args.get("max_target_positions")
        if declared is not None and declared != max_positions:
            self.warnings.append(f"the position table has {pos[0]} rows, i.e. {max_positions} positions after OPT's "
                                 f"offset of 2, but cfg.model.max_target_positions={declared}; using {max_positions}.")
        return max_positions

    def output_projection(self) -> bool:
        """Whether lm_head is tied to the embeddings (then not written)."""
        tied = bool(_arg(self.args, "share_decoder_input_output_embed", "lm_head.weight" not in self.by_name))
        if not tied and "lm_head.weight" not in self.by_name:
            self.refuse("share_decoder_input_output_embed=False",
                        "but the checkpoint has no decoder.output_projection.weight (adaptive softmax?)")
        if tied and "lm_head.weight" in self.by_name:
            self.hf = [t for t in self.hf if t.name != "lm_head.weight"]  # stored, yet tied: equal to embed_tokens
        return tied

    def raise_problems(self) -> None:
        if not self.problems:
            return
        layout = self.layout
        settings = [s for s, _ in self.problems]
        lines = "\n".join(f"  - {s}: {why}" for s, why in self.problems)
        # export-hf writes OPT only: there is no other architecture to suggest. The training
        # flags named are the writer's own (fairseq-train's or metaseq-train's).
        flags = list(dict.fromkeys(f for s in settings for k, f in _TRAIN_FLAGS.items() if s.startswith(k)))
        trainer = "fairseq-train" if layout.flavor == "fairseq" else "metaseq-train"
        raise UnsupportedArchitectureError(
            f"{layout.display_name}: cannot be expressed as a Hugging Face OPT model; nothing was written.\n{lines}\n"
            "OPT is a pre-LN (or post-LN without final norm) decoder with learned positions (offset 2), unscaled "
            "embeddings and a relu/gelu/tanh/linear feed-forward, and export-hf writes OPT only, so this "
            f"{layout.flavor} model has no Hugging Face export here; its checkpoint still loads and converts as "
            "it is. A model trained with OPT's settings exports"
            + (f" ({trainer} {' '.join(flags)})." if flags else "."), settings)

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

