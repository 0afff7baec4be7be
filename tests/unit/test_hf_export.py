"""`metaseq-oneload export-hf`: every fixture layout becomes a Hugging Face OPT folder that
reproduces metaseq's own logits; architectures OPT cannot express are refused before
anything is written; an interrupted export leaves nothing at the destination; memory stays
at one chunk, not the model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import metaseq_oneload

from metaseq_oneload.cli import main
from metaseq_oneload._errors import ConversionError, OutputExistsError
from metaseq_oneload._hf_export import UnsupportedArchitectureError, export_hf, parse_size, plan_opt, shard_files
from tests.conftest import FIXTURES, SETS, needs_fixtures
from tests.hf_tiny import big_singleton, config_of, edited_singleton

pytestmark = needs_fixtures

CLI = [sys.executable, "-c", "import sys; from metaseq_oneload.cli import main; sys.exit(main())"]


def opt_logits(folder, tokens):
    pytest.importorskip("transformers")
    from transformers import OPTForCausalLM

    model = OPTForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(tokens).logits


def reference(name):
    return torch.load(FIXTURES / name / "reference_logits.pt")


def leftovers(parent: Path, base: str) -> list:
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{base}.oneload-")]


@pytest.mark.parametrize("name", SETS)
def test_every_layout_reproduces_metaseq_logits(tmp_path, name):
    dst = tmp_path / "opt"
    result = export_hf(FIXTURES / name, dst)
    assert sorted(os.listdir(dst)) == ["config.json", "model.safetensors"]
    ref = reference(name)
    diff = (opt_logits(dst, ref["tokens"]) - ref["logits"]).abs().max().item()
    assert diff <= 1e-4, (name, diff)
    assert result.num_params == 21548 and result.num_tensors == 36
    assert not leftovers(tmp_path, "opt")


def test_config_matches_the_architecture(tmp_path):
    export_hf(FIXTURES / "mp2_ddp", tmp_path / "opt")
    c = config_of(tmp_path / "opt")
    want = {"model_type": "opt", "architectures": ["OPTForCausalLM"], "vocab_size": 64, "hidden_size": 34,
            "num_hidden_layers": 2, "ffn_dim": 64, "num_attention_heads": 2, "max_position_embeddings": 16,
            "word_embed_proj_dim": 34, "do_layer_norm_before": True, "activation_function": "relu",
            "enable_bias": True, "tie_word_embeddings": True, "torch_dtype": "float32", "pad_token_id": 1}
    assert {k: c[k] for k in want} == want


def test_any_file_of_the_set_and_sharded_output(tmp_path):
    """A single shard file names the whole set; a small --max-shard-size splits the output
    into model-0000k-of-0000n files with an index that transformers follows."""
    src = FIXTURES / "mp2_dp2" / "checkpoint_last-model_part-1-shard0.pt"
    result = export_hf(src, tmp_path / "opt", max_shard_size="30KB")
    files = sorted(os.listdir(tmp_path / "opt"))
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "opt" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == result.total_bytes == 21548 * 4
    assert set(index["weight_map"].values()) == set(shards)
    ref = reference("mp2_dp2")
    assert (opt_logits(tmp_path / "opt", ref["tokens"]) - ref["logits"]).abs().max() <= 1e-4


def test_tensors_are_split_and_renamed(tmp_path):
    """k/v/q rows of the fused qkv_proj land in k_proj/v_proj/q_proj (model-parallel parts
    merged), positions keep metaseq's table (offset 2), the final layer norm is renamed."""
    from safetensors.torch import load_file

    from tests.conftest import raw_load

    export_hf(FIXTURES / "mp2_dp2", tmp_path / "opt")
    got = load_file(tmp_path / "opt" / "model.safetensors")
    sd = raw_load(FIXTURES / "singleton" / "checkpoint_2_consolidated.pt")["model"]
    assert "lm_head.weight" not in got  # tied by config
    for ours, theirs in [("model.decoder.layers.1.self_attn.q_proj.weight", "decoder.layers.1.self_attn.q_proj.weight"),
                         ("model.decoder.layers.0.self_attn.v_proj.bias", "decoder.layers.0.self_attn.v_proj.bias"),
                         ("model.decoder.layers.0.fc2.weight", "decoder.layers.0.fc2.weight"),
                         ("model.decoder.embed_positions.weight", "decoder.embed_positions.weight"),
                         ("model.decoder.final_layer_norm.weight", "decoder.layer_norm.weight")]:
        assert got[ours].shape == sd[theirs].shape
        assert (got[ours] - sd[theirs]).abs().max() <= 1e-5, ours


def test_untied_output_projection(tmp_path):
    """share_decoder_input_output_embed=False: lm_head.weight is written and not tied."""
    from tests.conftest import raw_load

    emb = raw_load(FIXTURES / "singleton" / "checkpoint_2_consolidated.pt")["model"]["decoder.embed_tokens.weight"]
    src = edited_singleton(tmp_path / "src", cfg={"share_decoder_input_output_embed": False},
                           add={"decoder.output_projection.weight": emb.clone()})
    export_hf(src, tmp_path / "opt")
    assert config_of(tmp_path / "opt")["tie_word_embeddings"] is False
    pytest.importorskip("transformers")
    from transformers import OPTForCausalLM

    model = OPTForCausalLM.from_pretrained(tmp_path / "opt").eval()
    assert model.lm_head.weight.data_ptr() != model.model.decoder.embed_tokens.weight.data_ptr()
    ref = reference("singleton")
    with torch.no_grad():
        assert (model(ref["tokens"]).logits - ref["logits"]).abs().max() <= 1e-4


def test_dtype_cast(tmp_path):
    from safetensors.torch import load_file

    export_hf(FIXTURES / "fsdp_dp3", tmp_path / "fp32")
    export_hf(FIXTURES / "fsdp_dp3", tmp_path / "bf16", dtype=torch.bfloat16)
    assert config_of(tmp_path / "bf16")["torch_dtype"] == "bfloat16"
    a, b = load_file(tmp_path / "fp32" / "model.safetensors"), load_file(tmp_path / "bf16" / "model.safetensors")
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, a[k].to(torch.bfloat16)) for k, v in b.items())


@pytest.mark.parametrize("cfg,drop,add,setting", [
    ({"no_scale_embedding": False}, (), None, "no_scale_embedding=False"),
    ({"decoder_learned_pos": False}, ("decoder.embed_positions.weight",), None, "decoder_learned_pos=False"),
    ({"alibi": True}, (), None, "alibi=True"),
    ({"activation_fn": "swiglu"}, (), None, "activation_fn=swiglu"),
    ({"activation_fn": "mish"}, (), None, "activation_fn=mish"),
    ({"decoder_normalize_before": False}, (), None, "decoder_normalize_before=False with a final layer norm"),
    ({}, ("decoder.layer_norm.weight", "decoder.layer_norm.bias"), None, "no final layer norm with pre-LN"),
    ({}, (), {"decoder.layernorm_embedding.weight": torch.ones(34)}, "layernorm_embedding=True"),
    ({"self_attn_doc_sep": 2}, (), None, "self_attn_doc_sep=2"),
    # Learned positions asked for but no table stored: used to write max_position_embeddings: null.
    ({"decoder_learned_pos": True}, ("decoder.embed_positions.weight",), None,
     "decoder_learned_pos=True without decoder.embed_positions.weight"),
    ({}, ("decoder.embed_positions.weight",), {"decoder.embed_positions.weight": torch.zeros(2, 34)},
     "decoder.embed_positions.weight"),
])
def test_refuses_what_opt_cannot_express(tmp_path, cfg, drop, add, setting):
    src = edited_singleton(tmp_path / "src", cfg=cfg, drop=drop, add=add)
    with pytest.raises(UnsupportedArchitectureError, match="cannot be expressed as a Hugging Face OPT model") as e:
        export_hf(src, tmp_path / "opt")
    assert setting in e.value.settings
    assert f"  - {setting}: " in str(e.value) and "nothing was written" in str(e.value)
    assert not (tmp_path / "opt").exists() and not leftovers(tmp_path, "opt")


def test_refusal_lists_every_setting_and_cli_exit(tmp_path, capsys):
    src = edited_singleton(tmp_path / "src", cfg={"no_scale_embedding": False, "alibi": True})
    assert main(["export-hf", str(src), str(tmp_path / "opt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("metaseq-oneload export-hf: error: ")
    assert "alibi=True" in err and "no_scale_embedding=False" in err and "sqrt(decoder_embed_dim)=5.831" in err
    assert not (tmp_path / "opt").exists()


def test_the_fixture_with_unchanged_cfg_passes(tmp_path):
    """The control for the refusals: the same rewrite without edits exports."""
    src = edited_singleton(tmp_path / "src")
    export_hf(src, tmp_path / "opt")
    ref = reference("singleton")
    assert (opt_logits(tmp_path / "opt", ref["tokens"]) - ref["logits"]).abs().max() <= 1e-4


def test_existing_destination(tmp_path, capsys):
    dst = tmp_path / "opt"
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    with pytest.raises(OutputExistsError, match=r"opt already exists; export-hf writes a new folder.*--overwrite"):
        export_hf(FIXTURES / "singleton", dst)
    # --overwrite replaces a folder an export wrote, never one holding anything else.
    with pytest.raises(OutputExistsError, match=r"opt: not replaced: it holds keep.txt, which an export does not "
                                                r"write\. overwrite=True \(CLI: --overwrite\) replaces only a folder "
                                                r"export-hf wrote"):
        export_hf(FIXTURES / "singleton", dst, overwrite=True)
    assert sorted(os.listdir(dst)) == ["keep.txt"]
    src = edited_singleton(dst / "src")
    with pytest.raises(OutputExistsError, match=r"holds the source checkpoint \(checkpoint_2_consolidated.pt\); "
                                                r"export-hf never replaces its source"):
        export_hf(src, dst, overwrite=True)
    assert src.exists() and (dst / "keep.txt").exists()
    assert not leftovers(tmp_path, "opt")

    fresh = tmp_path / "fresh"
    export_hf(FIXTURES / "singleton", fresh, max_shard_size="30KB")  # a sharded export with an index
    assert main(["export-hf", str(FIXTURES / "singleton"), str(fresh), "--overwrite", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["dst"] == str(fresh) and summary["files"] == ["model.safetensors", "config.json"]
    assert summary["config"]["num_hidden_layers"] == 2 and summary["num_params"] == 21548
    assert sorted(os.listdir(fresh)) == ["config.json", "model.safetensors"]  # the old shards went with it
    empty = tmp_path / "empty"
    empty.mkdir()
    export_hf(FIXTURES / "singleton", empty, overwrite=True)  # nothing to lose
    assert sorted(os.listdir(empty)) == ["config.json", "model.safetensors"]
    assert not leftovers(tmp_path, "fresh") and not leftovers(tmp_path, "empty")


# --------------------------------------------------------------------------- never the source


def _snapshot(*folders) -> dict:
    """Every entry under ``folders``: what it is and its bytes (links as their target)."""
    out = {}
    for folder in folders:
        for p in sorted(Path(folder).rglob("*")):
            if p.is_symlink():
                out[str(p)] = ("link", os.readlink(p))
            elif p.is_file():
                out[str(p)] = ("file", p.read_bytes())
            else:
                out[str(p)] = ("dir",)
    return out


def _all_leftovers(*folders) -> list:
    return [str(p) for f in folders for p in Path(f).rglob("*") if ".oneload-" in p.name]


def _source_case(tmp_path, case):
    """(src, dst, expected message) on copies of the fixtures."""
    from tests.conftest import copy_set

    single = copy_set("singleton", tmp_path)
    mp = copy_set("mp2_dp2", tmp_path)
    ckpt = single / "checkpoint_2_consolidated.pt"
    other = tmp_path / "other"
    other.mkdir()
    if case == "the file itself":
        return ckpt, ckpt, r"checkpoint_2_consolidated.pt: is the source checkpoint file checkpoint_2_consolidated.pt"
    if case == "another file of the set":
        return (mp / "checkpoint_2-model_part-0-shard0.pt", mp / "checkpoint_2-model_part-1-shard1.pt",
                r"is the source checkpoint file checkpoint_2-model_part-1-shard1.pt")
    if case == "a text pointer of the set":
        return (mp / "checkpoint_2-model_part-0-shard0.pt", mp / "checkpoint_last-model_part-1-shard0.pt",
                r"checkpoint_last-model_part-1-shard0.pt: is a link to the source checkpoint file "
                r"checkpoint_2-model_part-1-shard0.pt")
    if case == "the pointer given as the source":
        p = mp / "checkpoint_last-model_part-0-shard1.pt"
        return p, p, r"is a link to the source checkpoint file checkpoint_2-model_part-0-shard1.pt"
    if case == "a symlink to a source file":
        link = other / "linked.pt"
        link.symlink_to(ckpt)
        return single, link, r"linked.pt: is a link to the source checkpoint file checkpoint_2_consolidated.pt"
    if case == "a hard link to a source file":
        link = other / "hard.pt"
        os.link(ckpt, link)
        return single, link, r"hard.pt: is a link to the source checkpoint file checkpoint_2_consolidated.pt"
    if case == "the checkpoint folder":
        return mp, mp, r"mp2_dp2: holds the source checkpoint \(checkpoint_2-model_part-0-shard0.pt\)"
    if case == "a link to the checkpoint folder":
        link = other / "ckpt"
        link.symlink_to(single, target_is_directory=True)
        return ckpt, link, r"ckpt: holds the source checkpoint \(checkpoint_2_consolidated.pt\)"
    if case == "a folder above it":
        return ckpt, tmp_path, r"holds the source checkpoint \(checkpoint_2_consolidated.pt\)"
    if case == "the folder of the link given as the source":
        link = other / "checkpoint_9.pt"
        link.symlink_to(ckpt)
        return link, other, r"other: holds the source checkpoint \(checkpoint_9.pt\)"
    if case == "inside a source file":
        return ckpt, ckpt / "opt", r"opt: lies inside the source checkpoint file .*checkpoint_2_consolidated.pt"
    raise ValueError(case)


@pytest.mark.parametrize("case", [
    "the file itself", "another file of the set", "a text pointer of the set", "the pointer given as the source",
    "a symlink to a source file", "a hard link to a source file", "the checkpoint folder",
    "a link to the checkpoint folder", "a folder above it", "the folder of the link given as the source",
    "inside a source file"])
def test_never_writes_over_its_source(tmp_path, case):
    """export_hf(p, p, overwrite=True) used to move the checkpoint aside and delete it. Any
    destination that is, holds or lies inside a file or link of the source is refused, with
    and without --overwrite, before anything is written."""
    src, dst, message = _source_case(tmp_path, case)
    before = _snapshot(tmp_path)
    for overwrite in (True, False):
        with pytest.raises(OutputExistsError, match=message + r".*(never writes over|never replaces its source|"
                                                              r"Choose another destination)"):
            export_hf(src, dst, overwrite=overwrite)
        assert _snapshot(tmp_path) == before and not _all_leftovers(tmp_path)
    assert main(["export-hf", str(src), str(dst), "--overwrite"]) == 2
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("case,why", [
    ("a file", r"it is not a folder"),
    ("a link to an export", r"it is a symbolic link \(to .*/real\)"),
    ("an export with a tokenizer", r"it holds tokenizer.json, which an export does not write"),
    ("an export with a sub-folder", r"it holds checkpoints, which an export does not write"),
    ("a config alone", r"it is not a complete export \(it needs config.json and model\*.safetensors\)"),
    ("a model folder of something else", r"it holds generation_config.json, pytorch_model.bin, which an export"),
])
def test_overwrite_replaces_only_a_previous_export(tmp_path, case, why):
    dst = tmp_path / "opt"
    if case == "a file":
        dst.write_text("my notes")
    elif case == "a link to an export":
        export_hf(FIXTURES / "singleton", tmp_path / "real")
        dst.symlink_to(tmp_path / "real", target_is_directory=True)
    else:
        export_hf(FIXTURES / "singleton", dst)
        if case == "an export with a tokenizer":
            (dst / "tokenizer.json").write_text("{}")
        elif case == "an export with a sub-folder":
            (dst / "checkpoints").mkdir()
        elif case == "a config alone":
            os.remove(dst / "model.safetensors")
        else:
            os.remove(dst / "model.safetensors")
            (dst / "pytorch_model.bin").write_bytes(b"weights")
            (dst / "generation_config.json").write_text("{}")
    before = _snapshot(tmp_path)
    with pytest.raises(OutputExistsError, match=r"opt: not replaced: " + why + r".*Choose another destination, or "
                                                                               r"move it away yourself"):
        export_hf(FIXTURES / "mp2_ddp", dst, overwrite=True)
    assert _snapshot(tmp_path) == before and not _all_leftovers(tmp_path)


_KILL_BETWEEN_RENAMES = textwrap.dedent("""
    import os, sys
    from metaseq_oneload._hf_export import export_hf
    real = os.rename
    def rename(a, b):
        real(a, b)
        if ".oneload-old+" in str(b):  # the previous export is aside, the new one not yet in place
            os._exit(9)
    os.rename = rename
    export_hf(sys.argv[1], sys.argv[2], overwrite=True)
""")


def test_killed_between_the_two_renames(tmp_path):
    """An --overwrite killed after moving the previous export aside and before moving the
    new one in leaves DST missing: the next export to DST puts the previous one back (it
    never deletes it) and removes the unfinished one."""
    dst = tmp_path / "opt"
    export_hf(FIXTURES / "singleton", dst, dtype=torch.bfloat16)  # the previous export, told apart by its dtype
    r = subprocess.run([sys.executable, "-c", _KILL_BETWEEN_RENAMES, str(FIXTURES / "mp2_ddp"), str(dst)],
                       capture_output=True, text=True)
    assert r.returncode == 9, r.stderr
    left = sorted(leftovers(tmp_path, "opt"))
    assert not dst.exists() and len(left) == 2 and ".opt.oneload-old+" in left[0] and ".opt.oneload-tmp+" in left[1]
    with pytest.raises(OutputExistsError, match=r"opt already exists.*Note: .*opt was put back from "
                                                r"\.opt\.oneload-old\+"):
        export_hf(FIXTURES / "mp2_ddp", dst)
    assert config_of(dst)["torch_dtype"] == "bfloat16" and not leftovers(tmp_path, "opt")
    export_hf(FIXTURES / "mp2_ddp", dst, overwrite=True)
    assert config_of(dst)["torch_dtype"] == "float32" and not leftovers(tmp_path, "opt")


def test_interrupted_between_the_two_renames(tmp_path, monkeypatch):
    """In-process (Ctrl-C, SIGTERM turned into SystemExit by the CLI) at the same point:
    the previous export is put back at once."""
    import metaseq_oneload._hf_export as hx

    dst = tmp_path / "opt"
    export_hf(FIXTURES / "singleton", dst, dtype=torch.bfloat16)
    real = os.rename

    def rename(a, b):
        real(a, b)
        if ".oneload-old+" in str(b):
            raise KeyboardInterrupt

    monkeypatch.setattr(hx.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        export_hf(FIXTURES / "mp2_ddp", dst, overwrite=True)
    assert config_of(dst)["torch_dtype"] == "bfloat16" and not leftovers(tmp_path, "opt")


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_cleanup_touches_only_this_hosts_dead_exports(tmp_path, monkeypatch):
    """Hidden folders carry the host and pid that wrote them: only this host's, of a pid
    that is gone, holding nothing but export files, are removed."""
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "node")
    dead = _dead_pid()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        def folder(name, files=("model.safetensors",)):
            (tmp_path / name).mkdir()
            for f in files:
                (tmp_path / name / f).write_bytes(b"x")
            return name

        removed = [folder(f".opt.oneload-tmp+node+{dead}+0a1b2c3d"),
                   folder(f".opt.oneload-tmp-node-{dead}"),  # as earlier versions named them
                   folder(f".opt.oneload-old+node+{dead}+99aa", ("config.json", "model-00001-of-00002.safetensors")),
                folder(f".opt.oneload-old+node+{dead}+77bb", ())]  # named, killed before DST was moved there
        kept = [folder(f".opt.oneload-tmp+node+{alive.pid}+0a1b2c3d"),  # still running
                folder(f".opt.oneload-tmp+other+{dead}+0a1b2c3d"),  # another host
                folder(f".opt.oneload-tmp+node-7+{dead}+0a1b2c3d"),  # host "node-7", not "node"
                folder(f".opt.oneload-tmp+node+{dead}+ffff", ("model.safetensors", "notes.txt")),  # not only ours
                folder(f".opt.oneload-tmp+node+{os.getpid()}+0a1b2c3d"),  # this process (another thread)
                folder(f".other.oneload-tmp+node+{dead}+0a1b2c3d")]  # another destination
        (tmp_path / "opt").mkdir()  # DST present: the old folder is a leftover of its removal
        (tmp_path / "opt" / "config.json").write_text("{}")
        (tmp_path / "opt" / "model.safetensors").write_bytes(b"x")
        result = export_hf(FIXTURES / "singleton", tmp_path / "opt", overwrite=True)
        names = set(os.listdir(tmp_path))
        assert not names & set(removed) and set(kept) <= names
        assert any(f".opt.oneload-tmp+node+{dead}+ffff: left in place" in w for w in result.warnings)
        assert sorted(os.listdir(tmp_path / "opt")) == ["config.json", "model.safetensors"]
    finally:
        alive.kill()
        alive.wait()


def test_an_empty_old_folder_is_not_put_back(tmp_path, monkeypatch):
    """Killed after naming the folder DST was to move to, before moving it, and DST removed
    since: there is nothing to put back, and no empty DST appears."""
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "node")
    (tmp_path / f".opt.oneload-old+node+{_dead_pid()}+1234").mkdir()
    export_hf(FIXTURES / "singleton", tmp_path / "opt")
    assert sorted(os.listdir(tmp_path / "opt")) == ["config.json", "model.safetensors"]
    assert not leftovers(tmp_path, "opt")


def test_threads_exporting_to_one_destination(tmp_path):
    """Two exports of one process have one pid: their temporary folders must still differ."""
    import threading

    dst, errors = tmp_path / "opt", []
    export_hf(FIXTURES / "singleton", dst)
    start = threading.Barrier(4)

    def run(src):
        start.wait()
        try:
            export_hf(FIXTURES / src, dst, overwrite=True)
        except Exception as e:  # pragma: no cover - the failure is reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in ("singleton", "mp2_ddp", "fsdp_dp3", "shard_only")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(os.listdir(dst)) == ["config.json", "model.safetensors"] and not leftovers(tmp_path, "opt")
    ref = reference("singleton")
    assert (opt_logits(dst, ref["tokens"]) - ref["logits"]).abs().max() <= 1e-4


def test_cli_table(tmp_path, capsys):
    assert main(["export-hf", str(FIXTURES / "shard_only"), str(tmp_path / "opt"), "--max-shard-size", "40KB"]) == 0
    out = capsys.readouterr().out
    assert "architecture  OPT: 2 layers, hidden 34, 2 heads, ffn 64, vocab 64, 16 positions" in out
    assert "model-00001-of-00003.safetensors" in out and "relu, pre-LN, tied lm_head, float32" in out


def test_not_a_language_model(tmp_path):
    torch.save({"model": {"encoder.weight": torch.ones(3)}}, tmp_path / "plain.pt")
    with pytest.raises(ConversionError, match=r"a pytorch checkpoint; export-hf converts metaseq/fairseq language"):
        export_hf(tmp_path / "plain.pt", tmp_path / "opt")
    assert not (tmp_path / "opt").exists()


def test_sizes_and_packing():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30 and parse_size(123) == 123
    with pytest.raises(ValueError, match="expected bytes or a size like 5GB"):
        parse_size("lots")
    plan = plan_opt(metaseq_oneload.inspect(FIXTURES / "singleton"))
    files = shard_files(plan.tensors, 10_000)
    assert all(sum(t.nbytes for t in g) <= 10_000 or len(g) == 1 for _, g in files)
    assert [t.name for _, g in files for t in g] == [t.name for t in plan.tensors]


# --------------------------------------------------------------------------- streaming


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    return big_singleton(tmp_path_factory.mktemp("big"))


_MEASURE = textwrap.dedent("""
    import json, sys
    import metaseq_oneload
    from metaseq_oneload._hf_export import export_hf
    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current RSS
    base = hwm()
    r = export_hf(sys.argv[1], sys.argv[2], chunk_mb=16, max_shard_size="150MB")
    print(json.dumps({"base": base, "peak": hwm(), "bytes": r.total_bytes, "files": list(r.files)}))
""")


def test_peak_memory_is_a_chunk_not_the_model(tmp_path, big):
    r = subprocess.run([sys.executable, "-c", _MEASURE, str(big), str(tmp_path / "opt")], capture_output=True,
                       text=True, check=True)
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["bytes"] > 300 << 20 and len([f for f in m["files"] if f.startswith("model-")]) >= 3
    growth = m["peak"] - m["base"]
    assert growth < 80 << 20, f"export grew RSS by {growth >> 20} MiB for a {m['bytes'] >> 20} MiB model"


def _start(src, dst):
    return subprocess.Popen(CLI + ["export-hf", str(src), str(dst), "--chunk-mb", "1", "--max-shard-size", "100MB"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stop_mid_write(proc, parent: Path, base: str) -> Path:
    """Freeze the export once a weight file is partly written; returns its temporary folder."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        tmps = [p for p in parent.iterdir() if p.name.startswith(f".{base}.oneload-tmp+")]
        if tmps and any(f.stat().st_size > (1 << 20) for f in tmps[0].iterdir()):
            proc.send_signal(signal.SIGSTOP)
            return tmps[0]
        assert proc.poll() is None, f"the export ended before it could be interrupted: {proc.communicate()}"
        time.sleep(0.002)
    proc.kill()
    pytest.fail("the export never started writing")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_interrupted_export_leaves_nothing_at_dst(tmp_path, big, sig):
    dst = tmp_path / "opt"
    proc = _start(big, dst)
    tmp = _stop_mid_write(proc, tmp_path, "opt")
    assert not dst.exists() and "config.json" not in os.listdir(tmp)  # mid-way, frozen
    proc.send_signal(sig)
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert not dst.exists()
    if sig != signal.SIGKILL:  # it could unwind: its temporary folder is gone too
        assert not tmp.exists(), err
        assert "Traceback" not in err
    else:  # killed outright: the next export to the same destination clears the leftover
        assert tmp.exists()
        export_hf(FIXTURES / "singleton", dst)
        assert not tmp.exists() and dst.exists()




@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the lost one, on purpose
def test_an_interrupt_whose_exception_was_lost_still_stops_the_export_moving_into_place(tmp_path):
    # CPython drops an exception raised in a finalizer ("Exception ignored"), and a signal
    # another thread took reaches the main thread's handler at any later point: a Ctrl-C whose
    # KeyboardInterrupt was lost so must still keep the export from being moved into place.
    from metaseq_oneload import _threads

    dst = tmp_path / "opt"
    with _threads.interruptible():  # as the command line runs its verbs
        _lose_an_interrupt()
        _threads.check_signals()  # nothing pending: the handler already ran (and its exception was lost)
        with pytest.raises(KeyboardInterrupt):
            export_hf(FIXTURES / "singleton", dst)
    assert os.listdir(tmp_path) == []  # neither the export nor its temporary folder
    _threads.check_signals(commit=True)  # the record ends with the verb
    export_hf(FIXTURES / "singleton", dst)
    assert (dst / "config.json").exists()



def _lose_an_interrupt() -> None:
    """A SIGINT whose KeyboardInterrupt CPython drops: raised inside a finalizer."""
    import gc

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            signal.pthread_sigmask(signal.SIG_BLOCK, ())  # its handler raises here, in the finalizer

    Finalized()
    gc.collect()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the lost one, on purpose
def test_an_interrupted_dcp_convert_over_an_existing_folder_leaves_it_whole(tmp_path):
    from metaseq_oneload import _threads, convert

    dst = tmp_path / "dcp"
    convert(str(FIXTURES / "singleton"), str(dst), format="dcp")
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    with _threads.interruptible():
        _lose_an_interrupt()
        with pytest.raises(KeyboardInterrupt):
            convert(str(FIXTURES / "singleton"), str(dst), format="dcp", overwrite=True)
    # the .metadata (unlinked before an overwrite's renames) included
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before


def test_interruptible_puts_the_handlers_back_and_forgets_what_it_recorded():
    from metaseq_oneload import _threads

    mine = signal.signal(signal.SIGINT, lambda *a: None)
    try:
        term = signal.getsignal(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            with _threads.interruptible():
                assert signal.getsignal(signal.SIGTERM) is term  # a verb that writes nothing: the default
                os.kill(os.getpid(), signal.SIGINT)
                signal.pthread_sigmask(signal.SIG_BLOCK, ())
        assert signal.getsignal(signal.SIGINT) is not None and signal.getsignal(signal.SIGTERM) is term
        assert signal.getsignal(signal.SIGINT).__name__ == "<lambda>"
        _threads.check_signals(commit=True)  # nothing recorded any more
        with _threads.interruptible(term=True):
            assert signal.getsignal(signal.SIGTERM) is not term
        assert signal.getsignal(signal.SIGTERM) is term
    finally:
        signal.signal(signal.SIGINT, mine)


_INSPECT_LOSING_AN_INTERRUPT = textwrap.dedent("""
    import gc, os, signal, sys
    from metaseq_oneload import cli

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            signal.pthread_sigmask(signal.SIG_BLOCK, ())  # its handler raises here, in the finalizer

    real = cli._COMMANDS["inspect"]

    def losing(args):
        Finalized()
        gc.collect()
        return real[0](args)

    cli._COMMANDS["inspect"] = (losing,) + real[1:]
    sys.exit(cli.main(["inspect", sys.argv[1]]))
""")


def test_a_command_whose_interrupt_was_lost_still_ends_as_interrupted_and_quietly():
    r = subprocess.run([sys.executable, "-c", _INSPECT_LOSING_AN_INTERRUPT, str(FIXTURES / "singleton")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 130, r.stderr
    assert r.stderr.strip() == "metaseq-oneload: interrupted"  # no "Exception ignored ... Traceback"
