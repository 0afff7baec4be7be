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
from metaseq_oneload import from_pretrained
from metaseq_oneload.hf import empty_model
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


def test_the_source_is_path_and_progress_gets_done_and_total(tmp_path):
    """The conventions every verb shares (docs/api.md): the folder is ``path``, and a progress
    callable is called with (bytes done so far, bytes in all), ending at all."""
    saved = save_tiny_t5(tmp_path)
    calls = []
    model = from_pretrained(T5ForConditionalGeneration, path=tmp_path,
                            progress=lambda done, total: calls.append((done, total)))
    assert_same(model, saved)
    assert calls and calls[-1][0] == calls[-1][1] > 0
    assert all(done <= total for done, total in calls) and [d for d, _ in calls] == sorted(d for d, _ in calls)
    empty = empty_model(T5ForConditionalGeneration, path=tmp_path)
    assert all(p.device.type == "meta" for p in empty.parameters())


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
    from metaseq_oneload.cli import build_parser

    args = build_parser().parse_args(["export-hf", "a", "b", "--max-shard-size", "2GB", "--json"])
    assert (args.path, args.dst, args.max_shard_size, args.json, args.overwrite) == ("a", "b", "2GB", True, False)


# --------------------------------------------------------------------------- threads


@pytest.fixture
def global_state():
    """What building on meta patches process-wide, put back whatever a failing test left."""
    from torch import nn
    from transformers import PreTrainedModel

    saved = (nn.Module.register_parameter, PreTrainedModel.init_weights, torch.get_default_dtype(),
             dict(vars(torch.nn.init)))
    yield saved
    nn.Module.register_parameter, PreTrainedModel.init_weights = saved[0], saved[1]
    torch.set_default_dtype(saved[2])
    for k, v in saved[3].items():
        setattr(torch.nn.init, k, v)


def _unchanged(saved) -> list:
    from torch import nn
    from transformers import PreTrainedModel

    changed = []
    if nn.Module.register_parameter is not saved[0]:
        changed.append("nn.Module.register_parameter")
    if PreTrainedModel.init_weights is not saved[1]:
        changed.append("PreTrainedModel.init_weights")
    if torch.get_default_dtype() != saved[2]:
        changed.append(f"default dtype {torch.get_default_dtype()}")
    changed += [f"torch.nn.init.{k}" for k, v in saved[3].items() if getattr(torch.nn.init, k) is not v]
    return changed


def _run(*targets) -> list:
    import threading

    errors = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # reported by the test
                errors.append(e)
        return run

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return errors


def test_params_on_meta_is_per_thread(global_state):
    """A enters, B enters, A leaves while B is still building, C builds an ordinary model
    meanwhile. The patch used to be undone by A under B (B's later parameters real), seen by
    C (its parameters on meta), and left installed for good by B."""
    import threading

    from torch import nn

    from metaseq_oneload._hf import _params_on_meta

    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    got = {}

    def a():
        with _params_on_meta():
            got["a"] = nn.Linear(2, 2).weight.device.type
            a_in.set()
            b_in.wait(5)
            got["c"] = pool.submit(lambda: nn.Linear(2, 2).weight.device.type).result()  # not building
        a_out.set()

    def b():
        a_in.wait(5)
        with _params_on_meta():
            b_in.set()
            a_out.wait(5)
            got["b"] = nn.Linear(2, 2).weight.device.type
            with _params_on_meta():  # nested in one thread
                got["b nested"] = nn.Linear(2, 2).weight.device.type
            got["b after nested"] = nn.Linear(2, 2).weight.device.type

    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert not _run(a, b)
    assert got == {"a": "meta", "b": "meta", "c": "cpu", "b nested": "meta", "b after nested": "meta"}
    assert not _unchanged(global_state)
    assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_two_threads_build_at_once(global_state):
    """Two empty_model calls with different dtypes, the first leaving while the second is
    still inside (transformers' own process-wide switches, torch's default dtype and
    torch.nn.init, included): each model is right and nothing stays patched."""
    import threading

    from torch import nn

    from tests.hf_tiny import tiny_t5_config

    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    class Paused(T5ForConditionalGeneration):
        def post_init(self):
            if torch.get_default_dtype() == torch.bfloat16:  # A
                a_in.set()
                b_in.wait(1)  # B cannot start while A builds: the wait times out
            else:  # B
                b_in.set()
                a_out.wait(5)
                self.extra = nn.Linear(2, 2)  # built after A left
            super().post_init()

    models = {}

    def a():
        models["a"] = empty_model(Paused, config=tiny_t5_config(), dtype=torch.bfloat16)
        a_out.set()

    def b():
        a_in.wait(5)
        models["b"] = empty_model(Paused, config=tiny_t5_config(), dtype=torch.float32)

    assert not _run(a, b)
    for name, dtype in (("a", torch.bfloat16), ("b", torch.float32)):
        params = dict(models[name].named_parameters())
        assert {p.device.type for p in params.values()} == {"meta"}, name
        assert {p.dtype for p in params.values()} == {dtype}, name
        assert_tied(models[name])
    assert "extra.weight" in dict(models["b"].named_parameters())
    assert not _unchanged(global_state)
    torch.manual_seed(0)
    fresh = nn.Linear(4, 4)
    assert fresh.weight.device.type == "cpu" and fresh.weight.dtype == torch.float32 and fresh.weight.abs().sum() > 0
