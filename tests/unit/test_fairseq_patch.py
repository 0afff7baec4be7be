"""The parts of fairseq's patch that need no fairseq: the single-process counterpart of a
model-parallel checkpoint's config, and the module importing nothing of fairseq. The patch
itself runs against real fairseq in tests/integration/test_fairseq_*.py."""

import argparse
import subprocess
import sys

from metaseq_oneload.integrations import fairseq as fairseq_patch


def _mp2_cfg():
    # As fairseq 0.12.2 saved tests/fixtures/fairseq/mp2: argparse Namespaces of all the
    # arguments as the model and criterion nodes, plain dicts elsewhere.
    model = argparse.Namespace(_name="transformer_lm_megatron", arch="transformer_lm_megatron",
                               criterion="vocab_parallel_cross_entropy", model_parallel_size=2, decoder_layers=2)
    criterion = argparse.Namespace(_name="vocab_parallel_cross_entropy", criterion="vocab_parallel_cross_entropy")
    return {"cfg": {"common": {"model_parallel_size": 2}, "model": model, "criterion": criterion,
                    "task": {"_name": "language_modeling"}}}


def test_a_model_parallel_config_becomes_its_single_process_counterpart():
    state = _mp2_cfg()
    changes = fairseq_patch._single_process(state, layout=None)
    cfg = state["cfg"]
    assert (cfg["model"]._name, cfg["model"].arch) == ("transformer_lm", "transformer_lm")
    # fairseq's registry reads a Namespace by the field name, a config by _name: both change.
    assert (cfg["criterion"]._name, cfg["criterion"].criterion, cfg["model"].criterion) == ("cross_entropy",) * 3
    assert cfg["common"]["model_parallel_size"] == 1 and cfg["model"].model_parallel_size == 1
    assert ("model.arch", "transformer_lm_megatron", "transformer_lm") in changes
    assert ("criterion._name", "vocab_parallel_cross_entropy", "cross_entropy") in changes
    assert cfg["model"].decoder_layers == 2  # everything else as saved


def test_a_config_without_model_parallel_pieces_is_left_alone():
    state = {"cfg": {"model": {"_name": "transformer_lm"}, "criterion": {"_name": "cross_entropy"},
                     "common": {"model_parallel_size": 1}}}
    before = repr(state)
    assert fairseq_patch._single_process(state, layout=None) == []
    assert repr(state) == before


class _Dictionary:
    def __init__(self, n):
        self.n = n

    def pad_to_multiple_(self, multiple):
        self.n = -(-self.n // multiple) * multiple


def test_dictionaries_padded_once_each_as_megatron_did():
    shared = _Dictionary(56)
    task = argparse.Namespace(source_dictionary=shared, target_dictionary=shared)
    fairseq_patch._pad_dictionaries(task, 16)
    assert shared.n == 64


def test_the_module_imports_no_fairseq():
    """In a fresh process of real fairseq's Python where there is one (tests/integration/
    fairseq_run.py), so that an import of fairseq, direct or guarded, would succeed and show;
    else of this one, where a direct import would fail."""
    from tests.integration import fairseq_run

    python = fairseq_run.PYTHON or sys.executable
    probe = ("import sys, metaseq_oneload.integrations.fairseq; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fairseq', 'fairseq_cli')))")
    p = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=fairseq_run._env(None))
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "[]", p.stdout
    if fairseq_run.PYTHON:  # the check above could have seen fairseq there
        subprocess.run([python, "-c", "import fairseq"], check=True, env=fairseq_run._env(None))
    assert not any(name == "fairseq" for name in vars(fairseq_patch))


def test_composing_the_oneload_group_leaves_hydras_version_base_as_it_was():
    """fairseq 0.12.2's convert_namespace_to_omegaconf calls hydra.experimental.initialize,
    which raises once Hydra's process-wide version_base is >= 1.2."""
    import pytest

    version = pytest.importorskip("hydra.version")
    from metaseq_oneload.hydra import compose_oneload

    instance = version.VersionBase.instance()
    before = instance.version_base
    compose_oneload(["+oneload=auto"])
    assert instance.version_base is before
    if before is getattr(version, "_UNSPECIFIED_", None):
        assert not version.base_at_least("1.2")
        instance.version_base = before  # base_at_least fixed it to 1.1; the program had not


def test_real_fairseq_converts_its_namespace_after_the_oneload_group_was_composed():
    """What the test above guards, on real fairseq 0.12.2 (in its own Python; skips where there
    is none): its convert_namespace_to_omegaconf still works after compose_oneload. It fails
    with hydra.experimental.initialize's ImportError once version_base is 1.2."""
    import pytest

    from tests.integration import fairseq_run

    if fairseq_run.skip_reason():
        pytest.skip(fairseq_run.skip_reason())
    probe = "\n".join([
        "from metaseq_oneload.hydra import compose_oneload",
        "compose_oneload(['+oneload=auto'])",
        "from fairseq import options",
        "from fairseq.dataclass.utils import convert_namespace_to_omegaconf",
        "args = options.parse_args_and_arch(options.get_validation_parser(), ['DATA', '--task', 'language_modeling'])",
        "print('task:', convert_namespace_to_omegaconf(args).task._name)"])
    p = subprocess.run([fairseq_run.python(), "-c", probe], capture_output=True, text=True,
                       env=fairseq_run._env(None))
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines()[-1] == "task: language_modeling", p.stdout[-1000:]
