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
    assert (dst / "keep.txt").exists()
    src = edited_singleton(dst / "src")
    with pytest.raises(OutputExistsError, match=r"holds the source checkpoint \(checkpoint_2_consolidated.pt\); "
                                                r"export-hf never replaces its source"):
        export_hf(src, dst, overwrite=True)
    assert src.exists()
    assert main(["export-hf", str(FIXTURES / "singleton"), str(dst), "--overwrite", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["dst"] == str(dst) and summary["files"] == ["model.safetensors", "config.json"]
    assert summary["config"]["num_hidden_layers"] == 2 and summary["num_params"] == 21548
    assert sorted(os.listdir(dst)) == ["config.json", "model.safetensors"]
    assert not leftovers(tmp_path, "opt")


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
        tmps = [p for p in parent.iterdir() if p.name.startswith(f".{base}.oneload-tmp-")]
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
