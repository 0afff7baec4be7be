"""``load_into(module, path, optimizer=...)``: a torch optimizer's state from the checkpoint,
resharded exactly like the parameters it belongs to.

A DCP folder saved with ``get_state_dict(model, optim)`` holds the optimizer's state dict
flattened under a container key (``optim.state.<fqn>.exp_avg``, ``optim.param_groups.0.lr``).
Each per-parameter state tensor is a shadow :class:`~._layout.StoredTensor` of the layout
(:func:`.formats.dcp.describe_with_optimizer`, its saved FQN its name, its chunks those of
its parameter), so the one planner and executor read it once per cluster into a tensor of
its parameter's placement (a DTensor shard under FSDP2, the whole tensor on a plain module),
in the same load as the weights. The pickled values (``param_groups``, non-tensor state) are
read by the allowlisted reader only (:func:`._dcp_items.item_value`). The FQN-keyed state
dict is then handed to torch's ``set_optimizer_state_dict``, the call torch's own recipe
(``dcp.load`` + ``set_optimizer_state_dict``) ends with, so torch checks and places it.

Metaseq and fairseq sets keep their optimizer state as positions in a flattened trainer
state (:mod:`._optim`); resuming one is the trainer integration's (``install()``) work, and
``optimizer=`` refuses them by name rather than guess positions.

Which ranks: :func:`prepare` is (local) on each rank before the check-in (it reads the
``.metadata`` and each item's small header, as discovery does); the wants run inside the
engine's collective ``make_wants`` step; :meth:`OptimizerLoad.finish` is (local).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ._dcp_items import item_value
from ._dcp_meta import metadata_of
from ._errors import OptionError, StateDictMismatchError, cap_list
from ._execute import Want
from ._header import read_header
from ._into import dtensor_want, is_dtensor
from ._optim import state_of
from .formats import discover
from .formats import dcp as dcp_format

__all__ = ["OptimizerLoad", "prepare"]


@dataclass
class OptimizerLoad:
    """One rank's optimizer state under construction: the shadows to read, the pickled
    values already read, and (after the engine's ``make_wants``) the state tensors."""

    path: str
    shadows: Any  # formats.dcp.OptimizerShadows
    strict: bool
    values: dict  # saved FQN -> plain value
    state: dict = field(default_factory=dict)  # parameter FQN -> {key: tensor or value}

    def wrap(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, post: list,
             make_model_wants: Callable) -> Callable:
        """The engine's ``make_wants``: the module's wants over the model's targets (the
        shadows withheld from its key check), then one want per state tensor, made after the
        module is materialised so that each takes its parameter's final placement."""

        def make_wants(targets, structure, layout):
            model = {n: t for n, t in targets.items() if n not in self.shadows.tensors}
            wants = make_model_wants(model, structure, layout)
            return wants + self._state_wants(module, optimizer, targets, post)

        return make_wants

    def _state_wants(self, module, optimizer, targets, post: list) -> list:
        params = dict(module.named_parameters())
        held = {id(p) for p in params.values()}
        strangers = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in held)
        if strangers:
            raise OptionError(
                f"optimizer holds {strangers} parameter(s) that are not {type(module).__name__}'s "
                "(as its parameters are after loading: a module built on the meta device gets new ones). Build "
                "the optimizer over module.parameters() after the module is materialised or sharded.")
        self._check_groups(module, optimizer, params)
        wants, wrong, missing = [], [], []
        for name, (fqn, key) in sorted(self.shadows.tensors.items()):
            p, t = params.get(fqn), targets.get(name)
            if t is None:
                continue  # not this model-parallel part's (never with one part)
            if p is None:
                missing.append(fqn)
                continue
            if tuple(t.shape) == tuple(p.shape):
                out, want = _like(name, p, t.dtype, post)
            elif t.numel == 1:  # a per-parameter scalar (Adam's step)
                out = torch.zeros(t.shape, dtype=t.dtype)
                want = Want(name, 0, out.view(-1))
            else:
                wrong.append(f"{name}: checkpoint {list(t.shape)} vs parameter {fqn} {list(p.shape)}")
                continue
            self.state.setdefault(fqn, {})[key] = out
            wants.append(want)
        problems = (["shaped unlike its parameter: " + cap_list(wrong, sep="; ")] if wrong else []) + (
            ["for parameters the module lacks: " + cap_list(sorted(set(missing)))] if missing and self.strict else [])
        if problems:
            raise StateDictMismatchError(
                f"{self.path}: the optimizer state does not match {type(module).__name__}: " + " | ".join(problems)
                + ". Nothing was loaded. Check the model config against the checkpoint.")
        return wants

    def _groups(self) -> list:
        """The checkpoint's param_groups, in order, as the pickled values hold them."""
        groups: dict = {}
        for fqn, where in self.shadows.values.items():
            if where[0] == "param_groups" and len(where) == 3 and type(where[1]) is int:
                groups.setdefault(where[1], {})[where[2]] = self.values[fqn]
        return [groups[i] for i in sorted(groups)]

    def _check_groups(self, module, optimizer, params: dict) -> None:
        """(local) The checkpoint's param_groups against the optimizer's, as torch's
        ``get_optimizer_state_dict`` names them (params by FQN): the same number of groups,
        each with the same keys and parameters, before any byte moves; torch's own check
        comes after the weights are written and misses a key set of another optimizer."""
        fqn_of = {id(p): n for n, p in params.items()}
        theirs, ours = self._groups(), optimizer.param_groups
        problems = []
        if len(theirs) != len(ours):
            problems.append(f"{len(theirs)} param group(s) in the checkpoint, {len(ours)} in the "
                            f"{type(optimizer).__name__}")
        for i, (got, want) in enumerate(zip(theirs, ours)):
            extra, lacking = sorted(set(got) - set(want)), sorted(set(want) - set(got))
            if extra or lacking:
                problems.append(f"param group {i}: keys {extra} only in the checkpoint, {lacking} only in the "
                                f"{type(optimizer).__name__}'s")
            names = got.get("params")
            if type(names) not in (list, tuple) or not all(type(n) is str for n in names):
                problems.append(f"param group {i}: params {str(names)[:80]} is not a list of parameter names")
                continue
            mine = [fqn_of.get(id(p), "?") for p in want["params"]]
            if set(names) != set(mine):
                only = [cap_list(sorted(a - b)) or "none" for a, b in ((set(names), set(mine)), (set(mine), set(names)))]
                problems.append(f"param group {i}: parameters {only[0]} only in the checkpoint, {only[1]} only in "
                                "the optimizer")
        if problems:
            raise StateDictMismatchError(
                f"{self.path}: the checkpoint's optimizer param_groups do not match the "
                f"{type(optimizer).__name__} given: " + " | ".join(problems) + ". Nothing was loaded. Build the "
                "optimizer as the run that saved it did (same class, same parameter groups), or leave out optimizer=.")

    def finish(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """(local) Hand the loaded state to torch's ``set_optimizer_state_dict``."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        for fqn, where in self.shadows.values.items():
            if where[0] == "state" and len(where) == 3:
                self.state.setdefault(where[1], {})[where[2]] = self.values[fqn]
        params = {n for n, _ in module.named_parameters()}
        state = {fqn: v for fqn, v in self.state.items() if self.strict or fqn in params}
        osd = {"state": state, "param_groups": self._groups()}
        set_optimizer_state_dict(module, optimizer, optim_state_dict=osd, options=StateDictOptions(strict=self.strict))


def _like(name: str, p, dtype: torch.dtype, post: list) -> tuple:
    """(a state tensor placed as parameter ``p`` is, the want that fills it)."""
    if is_dtensor(p):
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # torch < 2.4
            from torch.distributed._tensor import DTensor
        local = torch.zeros(p.to_local().shape, dtype=dtype, device=p.to_local().device)
        out = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                 stride=p.stride())
        return out, dtensor_want(name, out, post)
    out = torch.zeros(p.shape, dtype=dtype, device=p.device)
    return out, Want(name, 0, out.view(-1))


def _flattened(folder: str) -> bool:
    """Whether the DCP folder's optimizer state is torch's flattened form (torchtitan's):
    one key per value under the container, ``state.<fqn>.<key>``, ``param_groups.<fqn>.<key>``."""
    return any(len(p) == 2 and p[0] in dcp_format.NOT_MODEL and type(p[1]) is str
               and p[1].startswith(("state.", "param_groups.")) for p in metadata_of(folder).planner_data.values())


def _refusal(path, trust_pickle: bool) -> OptionError:
    """Why a checkpoint that is not a DCP folder with optimizer state cannot fill one."""
    layout = discover(path, trust_pickle=trust_pickle)
    if layout.flavor in ("metaseq", "fairseq"):
        held = any(state_of(read_header(f.path, trust_pickle=trust_pickle)) is not None for f in layout.all_files)
        if held:
            return OptionError(
                f"optimizer given, and {path} is a {layout.flavor} set whose optimizer state is a "
                f"{layout.flavor} trainer's (last_optimizer_state, by parameter position in its flattened layout), "
                "which load_into does not map onto a torch optimizer. To resume a metaseq or fairseq run, let its "
                "trainer load it through metaseq_oneload.install(); to start a fresh optimizer, leave out optimizer=.")
    if layout.flavor == "dcp" and _flattened(layout.directory):
        return OptionError(
            f"optimizer given, and {path} holds flattened optimizer state (torchtitan's: "
            "get_optimizer_state_dict(..., flatten_optimizer_state_dict=True), keys state.<fqn>.<key> and "
            "param_groups.<fqn>.<key>): not read yet. Load it with torch.distributed.checkpoint.load and "
            "set_optimizer_state_dict, or leave out optimizer= to load the weights.")
    how = ("as get_state_dict saves it: {'optim': {'state': ..., 'param_groups': ...}} beside the model"
           if layout.flavor == "dcp" else f"{layout.flavor} checkpoint with the model's weights only")
    return OptionError(f"optimizer given, but {path} holds no optimizer state ({how}). Leave out optimizer= to "
                       "load the weights, or point at a checkpoint saved with the optimizer (get_state_dict(model, "
                       "optim) into dcp.save).")


def prepare(path, optimizer: torch.optim.Optimizer, *, model_parallel: int, strict: bool,
            trust_pickle: bool) -> tuple:
    """(local) (the layout to load, with the optimizer's state tensors as shadows, the
    :class:`OptimizerLoad`) for ``load_into(..., optimizer=optimizer)``.

    Raises:
        OptionError: the checkpoint holds no optimizer state this path reads (a metaseq or
            fairseq trainer's state: resumed through ``install()``), or a model-parallel load.
        UnsafeCheckpointError: a pickled value (``param_groups``) is not plain data.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise OptionError(f"optimizer is a {type(optimizer).__name__}, expected a "
                          "torch.optim.Optimizer built over the module's parameters.")
    if model_parallel > 1:
        raise OptionError(f"optimizer given with a model-parallel group of {model_parallel} ranks; "
                          "optimizer state loads onto data-parallel (FSDP2) or single-process worlds only. Load it "
                          "with torch.distributed.checkpoint.load and set_optimizer_state_dict.")
    shadows = None
    if dcp_format.detect(os.fspath(path)):
        layout, shadows = dcp_format.describe_with_optimizer(os.fspath(path), trust_pickle=trust_pickle)
    if shadows is None or not (shadows.tensors or shadows.values):
        raise _refusal(path, trust_pickle)
    values = {fqn: item_value(shadows.folder, fqn) for fqn in shadows.values}
    return layout, OptimizerLoad(str(os.fspath(path)), shadows, strict, values)
