"""A checkpoint's ``cfg`` is data (issue 21, class 1 and class 4's shared-list DAG).

Real crafted checkpoints: a real fairseq training file with its ``cfg`` re-saved as a live
OmegaConf ``DictConfig`` (as fairseq writes one from a running app) holding interpolations,
in a process that registered a resolver that would evaluate its argument (the common Hydra
``eval`` idiom; here it only records its calls). ``torch.load(weights_only=True)`` runs
nothing on such a file; neither may inspect, load or convert. And a cfg that is a deep DAG of
shared lists (60 levels: 2**60 paths, a few hundred bytes pickled) must cost one visit per
object, not one per path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

omegaconf = pytest.importorskip("omegaconf")
from omegaconf import OmegaConf  # noqa: E402

import metaseq_oneload as mo  # noqa: E402
from metaseq_oneload._layout import model_args_of  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
PLAIN = FIXTURES / "fairseq" / "plain" / "checkpoint_last.pt"
SECRET_VAR = "ONELOAD_TEST_SECRET_21"
SECRET = "hunter2-do-not-copy-me"


@pytest.fixture
def evil_calls():
    """An ``evil`` resolver, registered as an app would, that records every call."""
    calls: list = []
    OmegaConf.register_new_resolver("evil", lambda arg: calls.append(arg) or 1, replace=True)
    try:
        yield calls
    finally:
        OmegaConf.clear_resolver("evil")


def _crafted(tmp_path: Path, **extra_model) -> Path:
    """fairseq's plain checkpoint with a DictConfig cfg whose values the attacker chose."""
    obj = torch.load(PLAIN, weights_only=False, map_location="cpu")
    cfg = OmegaConf.create(obj["cfg"])
    cfg.model.share_decoder_input_output_embed = "${evil:share_decoder_input_output_embed}"
    cfg.model.decoder_attention_heads = "${evil:decoder_attention_heads}"
    cfg.model.leak = "${oc.env:" + SECRET_VAR + "}"
    cfg.common.model_parallel_size = "${evil:common.model_parallel_size}"
    cfg.distributed_training.distributed_world_size = "${evil:distributed_world_size}"
    cfg.checkpoint.checkpoint_shard_count = "${oc.env:" + SECRET_VAR + "}"
    # a whole section that is an interpolation, and one that reaches into another section
    cfg.bmuf = "${evil:bmuf}"
    cfg.model.decoder_layers = "${model.decoder_embed_dim}"
    for k, v in extra_model.items():
        cfg.model[k] = v
    obj["cfg"] = cfg
    out = tmp_path / "crafted" / "checkpoint_last.pt"
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, out)
    return out


def _torch_runs_nothing(path: Path, calls: list) -> None:
    """The premise: torch's own safe loader, with the same classes allowed, calls no resolver."""
    from metaseq_oneload._allowlist import safe_globals

    with torch.serialization.safe_globals(list(safe_globals())):
        torch.load(path, weights_only=True, map_location="cpu")
    assert calls == []


def test_inspect_never_resolves_an_interpolation_from_the_file(tmp_path, evil_calls, monkeypatch):
    monkeypatch.setenv(SECRET_VAR, SECRET)
    path = _crafted(tmp_path)
    _torch_runs_nothing(path, evil_calls)
    layout = mo.inspect(str(path))
    summary = json.dumps(layout.to_dict(), default=str)
    args = layout.model_args()
    assert evil_calls == [], f"inspect ran the file's resolver calls: {evil_calls}"
    assert SECRET not in summary and SECRET not in json.dumps(args, default=str)
    # Interpolated values are unknown, never a resolved value.
    assert "decoder_attention_heads" not in args and "leak" not in args
    assert args["decoder_embed_dim"] == 32
    assert layout.cfg.model_parallel_size is None and layout.cfg.checkpoint_shard_count is None
    assert evil_calls == []


def test_model_args_name_the_interpolations_they_left_out(tmp_path, evil_calls):
    path = _crafted(tmp_path)
    args = mo.inspect(str(path)).model_args()
    assert evil_calls == []
    assert "${evil:decoder_attention_heads}" in args.unresolved["decoder_attention_heads"]
    assert "${model.decoder_embed_dim}" in args.unresolved["decoder_layers"]


def test_single_process_load_never_resolves_an_interpolation_from_the_file(tmp_path, evil_calls, monkeypatch):
    monkeypatch.setenv(SECRET_VAR, SECRET)
    path = _crafted(tmp_path)
    sd = mo.load_state_dict(str(path))
    assert evil_calls == [], f"load_state_dict ran the file's resolver calls: {evil_calls}"
    ref = torch.load(PLAIN, weights_only=False, map_location="cpu")["model"]
    assert set(sd) == set(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_convert_writes_nothing_from_the_callers_environment(tmp_path, evil_calls, monkeypatch, fmt):
    monkeypatch.setenv(SECRET_VAR, SECRET)
    path = _crafted(tmp_path)
    out = tmp_path / "out"
    mo.convert(str(path), str(out / "ck"), shards=2, format=fmt)
    assert evil_calls == [], f"convert ran the file's resolver calls: {evil_calls}"
    written = sorted(out.iterdir())
    # torch outputs get an index, safetensors ones a JSON sidecar per file with the cfg
    side = [p for p in written if p.name.endswith(".json")]
    assert side
    for p in written:
        assert SECRET.encode() not in p.read_bytes(), f"{p.name} holds the caller's {SECRET_VAR}"
    for p in side:
        doc = json.loads(p.read_text())
        assert "leak" not in doc.get("model_args", {})  # an index leaves unknown arguments out
        if isinstance(doc.get("cfg"), dict) and "model" in doc["cfg"]:  # a sidecar: the raw text
            assert doc["cfg"]["model"]["leak"] == "${oc.env:" + SECRET_VAR + "}"
    assert evil_calls == []


def test_an_unset_variable_is_no_raw_resolution_error(tmp_path, evil_calls, monkeypatch):
    monkeypatch.delenv(SECRET_VAR, raising=False)
    OmegaConf.clear_resolver("evil")  # an app without the resolver: resolving would raise
    path = _crafted(tmp_path)
    layout = mo.inspect(str(path))
    layout.to_dict()
    mo.convert(str(path), str(tmp_path / "out" / "ck"), shards=2)
    mo.load_state_dict(str(path))


def test_a_needed_value_that_is_an_interpolation_is_named_in_the_refusal(tmp_path, evil_calls):
    """export_hf needs the head count; an interpolation is unknown, and the message says so."""
    path = _crafted(tmp_path)
    with pytest.raises(mo.OneloadError) as e:
        mo.export_hf(str(path), str(tmp_path / "hf"))
    msg = str(e.value)
    assert evil_calls == []
    assert "decoder_attention_heads" in msg and "${evil:decoder_attention_heads}" in msg
    assert "interpolation" in msg and str(path.parent) in msg


def test_plain_dict_cfg_strings_that_look_like_interpolations_are_unknown(tmp_path):
    """A cfg of plain dicts is turned into a DictConfig by metaseq/fairseq/Hydra code
    downstream: its ``${...}`` strings are interpolations there, so unknown here too."""
    obj = torch.load(PLAIN, weights_only=False, map_location="cpu")
    obj["cfg"]["model"]["decoder_attention_heads"] = "${oc.env:" + SECRET_VAR + "}"
    obj["cfg"]["common"]["model_parallel_size"] = "${oc.env:" + SECRET_VAR + "}"
    path = tmp_path / "checkpoint_last.pt"
    torch.save(obj, path)
    layout = mo.inspect(str(path))  # no int("${...}") ValueError
    assert layout.cfg.model_parallel_size is None
    assert "decoder_attention_heads" not in layout.model_args()


# --------------------------------------------------------------------------- shared-list DAG
_DAG_SCRIPT = r"""
import sys, time, torch, argparse
import metaseq_oneload as mo
src, out, where, fmt = sys.argv[1:5]
obj = torch.load(src, weights_only=False, map_location="cpu")
a = []
for _ in range(60):
    a = [a, a]
if where == "model":
    obj["cfg"]["model"]["dag"] = a
else:
    obj["cfg"]["dag"] = a
path = out + "/checkpoint_last.pt"
torch.save(obj, path)
t = time.monotonic()
layout = mo.inspect(path)
layout.to_dict()
mo.convert(path, out + "/conv/ck", shards=2, format=fmt)
print("SECONDS", time.monotonic() - t)
"""


@pytest.mark.parametrize("where,fmt", [("model", "torch"), ("cfg", "safetensors")])
def test_a_cfg_of_shared_lists_is_walked_once(tmp_path, where, fmt):
    """2**60 paths through 61 lists: convert (index writer, sidecar) must finish in seconds."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    t = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", _DAG_SCRIPT, str(PLAIN), str(tmp_path), where, fmt],
                              env=env, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"convert of a cfg with a shared-list DAG in {where} still running after 90 s")
    assert done.returncode == 0, done.stderr[-3000:]
    assert time.monotonic() - t < 60
    for side in (tmp_path / "conv").glob("*.json"):  # the index, or the safetensors sidecars
        assert side.stat().st_size < 1 << 20


def test_model_args_bound_a_shared_list_dag(tmp_path):
    a: list = []
    for _ in range(60):
        a = [a, a]
    import argparse

    header = {"cfg": {"model": argparse.Namespace(dag=a, decoder_layers=2)}}
    t = time.monotonic()
    args = model_args_of(header)
    json.dumps(args)
    assert time.monotonic() - t < 5
    assert args["decoder_layers"] == 2 and "dag" not in args and "dag" in args.unresolved


# --------------------------------------------------------------------------- OmegaConf outside cfg
# Only a checkpoint's top-level ``cfg``/``args`` are read raw. Every other ``header.get`` /
# ``in`` / ``.values()`` on a DictConfig resolves, so a header, a state dict or an
# ``extra_state`` that is an OmegaConf container ran the file's resolvers on inspect, load and
# convert (5 calls each for a top-level DictConfig, 3 on convert for a DictConfig extra_state),
# and tensors inside one were never checked ("saved without data").


def _header_dictconfig(tmp_path: Path) -> Path:
    """The whole checkpoint a DictConfig (allow_objects, so it holds the state dict's tensors)
    whose cfg/args/extra_state are the attacker's interpolations; torch.load reads it."""
    from omegaconf import DictConfig, open_dict

    obj = torch.load(PLAIN, weights_only=False, map_location="cpu")
    top = DictConfig({"cfg": "${evil:top_cfg}", "args": "${evil:top_args}", "extra_state": "${evil:top_extra}"},
                     flags={"allow_objects": True})
    with open_dict(top):
        top["model"] = dict(obj["model"])
    out = tmp_path / "top" / "checkpoint_last.pt"
    out.parent.mkdir(parents=True)
    torch.save(top, out)
    return out


def _omegaconf_at(tmp_path: Path, where: str) -> Path:
    obj = torch.load(PLAIN, weights_only=False, map_location="cpu")
    if where == "model":
        obj["model"] = OmegaConf.create(dict(obj["model"]), flags={"allow_objects": True})
    elif where == "extra_state":  # convert asks it for "ema" and "rng_tracker_states"
        it = {k: v for k, v in dict(obj["extra_state"]["train_iterator"]).items()
              if isinstance(v, (int, float, str, bool))}
        obj["extra_state"] = OmegaConf.create({"ema": "${evil:ema}", "rng_tracker_states": "${evil:rng}",
                                               "train_iterator": it})
    else:  # deep inside a plain extra_state
        obj["extra_state"]["metrics"]["evil"] = [OmegaConf.create({"x": "${evil:nested}"})]
    out = tmp_path / where / "checkpoint_last.pt"
    out.parent.mkdir(parents=True)
    torch.save(obj, out)
    return out


def _refused(fn, path: Path, calls: list, where: str) -> str:
    with pytest.raises(mo.CheckpointLayoutError) as e:
        fn()
    msg = str(e.value)
    assert calls == [], f"the file's resolvers ran: {calls}"
    assert str(path) in msg and "OmegaConf" in msg and where in msg and "torch.load" in msg, msg
    assert "saved without data" not in msg
    return msg


def test_a_header_that_is_a_dictconfig_runs_nothing_and_is_refused(tmp_path, evil_calls):
    path = _header_dictconfig(tmp_path)
    _torch_runs_nothing(path, evil_calls)
    for fn in (lambda: mo.inspect(str(path)), lambda: mo.load_state_dict(str(path), no_dist=True),
               lambda: mo.convert(str(path), str(tmp_path / "out" / "x"), model_parallel=1, shards=2, flat=True)):
        msg = _refused(fn, path, evil_calls, "top level")
        assert "expected a dict" in msg
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("where,shown", [("model", "at model is"), ("extra_state", "at extra_state is"),
                                         ("nested", "at extra_state.metrics.evil.0 is")])
def test_an_omegaconf_container_outside_cfg_runs_nothing_and_is_refused(tmp_path, evil_calls, where, shown):
    path = _omegaconf_at(tmp_path, where)
    _torch_runs_nothing(path, evil_calls)
    for fn in (lambda: mo.inspect(str(path)), lambda: mo.load_state_dict(str(path), no_dist=True),
               lambda: mo.convert(str(path), str(tmp_path / "out" / "x"), model_parallel=1, shards=2, flat=True)):
        _refused(fn, path, evil_calls, shown)


def test_carry_extra_state_reads_a_dictconfigs_keys_raw(evil_calls):
    """The convert step itself, handed a DictConfig extra_state: its keys, never its values."""
    from metaseq_oneload._optim import carry_extra_state

    extra = OmegaConf.create({"ema": "${evil:ema}", "rng_tracker_states": "${evil:rng}", "x": 1})
    out, notes = carry_extra_state(extra, same_parts=False, same_weights=False)
    assert evil_calls == []
    assert "ema" not in out.keys() and "rng_tracker_states" not in out.keys() and len(notes) == 2


def test_a_tensor_inside_an_omegaconf_cfg_is_refused(tmp_path):
    """A cfg may be a DictConfig, but a tensor in it is never walked or checked: refused."""
    obj = torch.load(PLAIN, weights_only=False, map_location="cpu")
    cfg = OmegaConf.create(obj["cfg"], flags={"allow_objects": True})
    cfg.model.hidden = torch.zeros(4)
    obj["cfg"] = cfg
    path = tmp_path / "checkpoint_last.pt"
    torch.save(obj, path)
    with pytest.raises(mo.CheckpointLayoutError) as e:
        mo.inspect(str(path))
    msg = str(e.value)
    assert "cfg.model.hidden" in msg and "tensor" in msg and str(path) in msg


def test_a_cfg_that_fairseqs_loader_made_still_loads(tmp_path):
    """fairseq's and metaseq's load_checkpoint_to_cpu make cfg a DictConfig with
    allow_objects; a state re-saved after it is a real checkpoint and loads."""
    obj = torch.load(PLAIN, weights_only=False, map_location="cpu")
    obj["cfg"] = OmegaConf.create(obj["cfg"], flags={"allow_objects": True})
    path = tmp_path / "checkpoint_last.pt"
    torch.save(obj, path)
    assert mo.inspect(str(path)).model_args()["decoder_embed_dim"] == 32
    sd = mo.load_state_dict(str(path), no_dist=True)
    ref = torch.load(PLAIN, weights_only=False, map_location="cpu")["model"]
    assert set(sd) == set(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)


def test_the_header_readers_take_a_dictconfig_header_raw(evil_calls):
    """Behind the boundary too: what reads a header's cfg, args, optimizer_history,
    extra_state or state dict never resolves, whatever object it is handed."""
    from metaseq_oneload.formats import _torchsave, metaseq

    header = OmegaConf.create({"cfg": "${evil:cfg}", "args": "${evil:args}", "model": "${evil:model}",
                               "optimizer_history": "${evil:hist}", "extra_state": "${evil:extra}",
                               "oneload_save": "${evil:save}"})
    assert model_args_of(header) == {}
    metaseq._settings(header)
    metaseq._run_id(header)
    assert _torchsave.model_dict(header) is None
    assert evil_calls == []
