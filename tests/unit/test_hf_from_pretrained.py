"""`from_pretrained` in one process (no process group): a tiny T5 written by save_pretrained
(single safetensors, a sharded index set, pytorch_model.bin) loads exactly, ties and
buffers kept, and mismatched checkpoints raise before anything is read. The multi-rank
cases (FSDP2, broadcast to ranks without the files) are in tests/distributed."""

from __future__ import annotations

import os

import pytest
import torch

import metaseq_oneload
from metaseq_oneload._errors import CheckpointLayoutError, CheckpointNotFoundError, StateDictMismatchError
from metaseq_oneload._hf import empty_model, from_pretrained
from tests.hf_tiny import T5_LABELS, T5_TOKENS, rewrite_safetensors, save_tiny_t5

transformers = pytest.importorskip("transformers")
from transformers import T5ForConditionalGeneration  # noqa: E402


def assert_same(model, saved: dict) -> None:
    sd = model.state_dict()
    assert set(sd) == set(saved), sorted(set(sd) ^ set(saved))
    for k, v in saved.items():
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k


def assert_tied(model) -> None:
    shared = model.shared.weight
    assert model.encoder.embed_tokens.weight is shared and model.decoder.embed_tokens.weight is shared
    assert model.lm_head.weight is shared


@pytest.mark.parametrize("how", ["single", "sharded", "bin"])
def test_loads_exactly_what_save_pretrained_wrote(tmp_path, how):
    saved = save_tiny_t5(tmp_path, how=how)
    model, report = from_pretrained(T5ForConditionalGeneration, tmp_path, return_report=True)
    assert_same(model, saved)
    assert_tied(model)
    assert not model.training
    assert report.bytes_read > 0 and report.strategy in ("own_shard", "reshard")
    theirs = T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        a = model(input_ids=T5_TOKENS, labels=T5_LABELS).logits
        b = theirs(input_ids=T5_TOKENS, labels=T5_LABELS).logits
    assert torch.equal(a, b)


def test_auto_class_and_config_overrides(tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    saved = save_tiny_t5(tmp_path)
    model = from_pretrained(AutoModelForSeq2SeqLM, tmp_path, dropout_rate=0.25)
    assert isinstance(model, T5ForConditionalGeneration) and model.config.dropout_rate == 0.25
    assert_same(model, saved)
    assert model.config._name_or_path == str(tmp_path)
    assert model.generation_config.decoder_start_token_id == 0


def test_dtype(tmp_path):
    saved = save_tiny_t5(tmp_path)
    bf16 = from_pretrained(T5ForConditionalGeneration, tmp_path, dtype=torch.bfloat16)
    assert all(torch.equal(bf16.state_dict()[k], v.to(torch.bfloat16)) for k, v in saved.items())
    # As transformers does: T5's "wo" stays fp32 when the rest is loaded in fp16.
    fp16 = from_pretrained(T5ForConditionalGeneration, tmp_path, dtype="float16")
    assert fp16.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32
    assert fp16.shared.weight.dtype == torch.float16
    assert torch.equal(fp16.encoder.block[0].layer[1].DenseReluDense.wo.weight,
                       saved["encoder.block.0.layer.1.DenseReluDense.wo.weight"])


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_non_persistent_buffers_keep_their_values(tmp_path, kv_heads):
    """Llama's rotary inv_freq is computed by the model and never saved: it must not end up
    on meta or empty. With 2 key/value heads for 4 query heads (grouped-query attention),
    k_proj and v_proj are smaller than q_proj."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads)
    ref = LlamaForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path)
    model = from_pretrained(LlamaForCausalLM, tmp_path)
    inv = dict(model.named_buffers())["model.rotary_emb.inv_freq"]
    assert inv.device.type == "cpu" and torch.equal(inv, dict(ref.named_buffers())["model.rotary_emb.inv_freq"])
    tokens = torch.tensor([[3, 9, 27, 4, 60]])
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, ref(tokens).logits)


def test_empty_model_has_no_weights(tmp_path):
    save_tiny_t5(tmp_path)
    model = empty_model(T5ForConditionalGeneration, tmp_path)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert_tied(model)
    metaseq_oneload.load_into(model, tmp_path)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert_tied(model)


def test_missing_tensor_raises_before_reading(tmp_path):
    save_tiny_t5(tmp_path)
    rewrite_safetensors(tmp_path, lambda sd: {k: v for k, v in sd.items() if "block.1.layer.0.SelfAttention.q" not in k})
    with pytest.raises(StateDictMismatchError, match=r"T5ForConditionalGeneration does not match .*: missing from "
                                                     r"the checkpoint: encoder.block.1.layer.0.SelfAttention.q.weight, "
                                                     r"decoder.block.1.layer.0.SelfAttention.q.weight\. Nothing was loaded"):
        from_pretrained(T5ForConditionalGeneration, tmp_path)


def test_unexpected_tensor_raises_unless_ignored(tmp_path):
    saved = save_tiny_t5(tmp_path)
    rewrite_safetensors(tmp_path, lambda sd: {**sd, "extra.head.weight": torch.ones(3)})
    with pytest.raises(StateDictMismatchError, match=r"not in the model: extra.head.weight\. Nothing was loaded"):
        from_pretrained(T5ForConditionalGeneration, tmp_path)
    assert_same(from_pretrained(T5ForConditionalGeneration, tmp_path, ignore_unexpected=[r"^extra\."]), saved)


def test_model_class_ignore_patterns(tmp_path):
    """T5 lists a tensor old checkpoints carry (_keys_to_ignore_on_load_unexpected)."""
    saved = save_tiny_t5(tmp_path)
    key = "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"
    rewrite_safetensors(tmp_path, lambda sd: {**sd, key: torch.zeros(32, 4)})
    assert_same(from_pretrained(T5ForConditionalGeneration, tmp_path), saved)


def test_wrong_shape_raises(tmp_path):
    save_tiny_t5(tmp_path)
    with pytest.raises(StateDictMismatchError, match=r"wrong shape: shared.weight: checkpoint \(128, 32\) vs module "
                                                     r"\(100, 32\)"):
        from_pretrained(T5ForConditionalGeneration, tmp_path, vocab_size=100)


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=r"/nowhere/t5: no such file or folder on the coordinating rank"):
        from_pretrained(T5ForConditionalGeneration, "/nowhere/t5")
    save_tiny_t5(tmp_path)
    os.remove(tmp_path / "config.json")
    with pytest.raises(CheckpointLayoutError, match=r"no config.json beside the weights.*Pass config="):
        from_pretrained(T5ForConditionalGeneration, tmp_path)
    from tests.hf_tiny import tiny_t5_config

    model = from_pretrained(T5ForConditionalGeneration, tmp_path, config=tiny_t5_config())
    assert_tied(model)


def test_hub_id_that_cannot_be_downloaded(tmp_path):
    """A name that is no local path but looks like a repo id goes to huggingface_hub (on
    rank 0 only); when that fails, the error says what happened and what to do."""
    with pytest.raises(CheckpointNotFoundError, match=r"(?s)oneload-test/not-a-model: not a local path, and downloading "
                                                      r"it from the Hugging Face Hub failed .*huggingface-cli download"):
        from_pretrained(T5ForConditionalGeneration, "oneload-test/not-a-model",
                        hub_kwargs={"local_files_only": True, "cache_dir": str(tmp_path)})


def test_export_hf_is_a_cli_command():
    from metaseq_oneload.cli import _load_commands, build_parser

    _load_commands()
    args = build_parser().parse_args(["export-hf", "a", "b", "--max-shard-size", "2GB", "--json"])
    assert (args.src, args.dst, args.max_shard_size, args.json, args.overwrite) == ("a", "b", "2GB", True, False)
