"""Composing the ``oneload`` group with real Hydra: onto a plain app, onto a struct-mode
structured config shaped like metaseq's, and on its own (what the start-up hook does)."""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import MISSING, OmegaConf

from metaseq_oneload import _hydra
from metaseq_oneload._hydra import OneloadSchema
from metaseq_oneload.hydra import OneloadConfig, extend_schema, register_configs

DEFAULTS = {"strategy": "auto", "path": None, "verify": False, "bucket_mb": 256.0, "fill_cfg": True}


@dataclass
class CommonConfig:
    model_parallel_size: int = 1


@dataclass
class CheckpointConfig:
    save_dir: str = "checkpoints"
    restore_file: str = "checkpoint_last.pt"
    checkpoint_shard_count: int = 1


@dataclass
class DistributedTrainingConfig:
    ddp_backend: str = "pytorch_ddp"
    use_sharded_state: bool = False


@dataclass
class MetaseqShapedConfig:
    """The part of metaseq's MetaseqConfig that matters here: nested structured sections."""

    common: CommonConfig = field(default_factory=CommonConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed_training: DistributedTrainingConfig = field(default_factory=DistributedTrainingConfig)
    model: Any = MISSING


@pytest.fixture
def plain_app(tmp_path):
    (tmp_path / "config.yaml").write_text("lr: 0.1\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        yield


@pytest.fixture
def metaseq_app(tmp_path):
    """metaseq's own layout: config.yaml whose defaults pull the structured base_config."""
    (tmp_path / "config.yaml").write_text("defaults:\n  - _self_\n  - base_config\n")
    cs = ConfigStore.instance()
    saved = cs.repo.get("base_config.yaml")  # metaseq's own, if metaseq was imported
    cs.store(name="base_config", node=MetaseqShapedConfig)
    try:
        with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
            yield cs
    finally:
        if saved is None:
            cs.repo.pop("base_config.yaml", None)
        else:
            cs.repo["base_config.yaml"] = saved


def test_auto_onto_a_plain_app(plain_app):
    cfg = compose("config", overrides=["+oneload=auto"])
    assert OmegaConf.to_container(cfg.oneload) == {**DEFAULTS, "bucket_mb": 256}
    assert cfg.lr == 0.1


@pytest.mark.parametrize("option", ["auto", "broadcast", "own_shard", "reshard", "off"])
def test_every_option(plain_app, option):
    cfg = compose("config", overrides=[f"+oneload={option}"])
    assert cfg.oneload.strategy == option
    assert _hydra.to_config(cfg.oneload).enabled is (option != "off")


def test_field_overrides(plain_app):
    cfg = compose("config", overrides=["+oneload=auto", "oneload.strategy=broadcast", "oneload.bucket_mb=64",
                                       "oneload.path=/ckpt/checkpoint_last.pt"])
    oc = _hydra.to_config(cfg.oneload)
    assert (oc.strategy, oc.bucket_mb, oc.path) == ("broadcast", 64, "/ckpt/checkpoint_last.pt")


def test_typo_is_rejected_by_hydra(plain_app):
    with pytest.raises(ConfigCompositionException, match=r"Could not override 'oneload\.bogus'"):
        compose("config", overrides=["+oneload=auto", "oneload.bogus=1"])


def test_unknown_option_lists_the_options(plain_app):
    with pytest.raises(MissingConfigException, match=r"Could not find 'oneload/nope'") as e:
        compose("config", overrides=["+oneload=nope"])
    for option in ("auto", "broadcast", "off", "own_shard", "reshard"):
        assert option in str(e.value)


def test_metaseq_schema_without_the_extension_refuses_oneload(metaseq_app):
    with pytest.raises(ConfigCompositionException, match="Key 'oneload' not in 'MetaseqShapedConfig'"):
        compose("config", overrides=["+oneload=auto"])


def test_metaseq_schema_with_the_extension(metaseq_app):
    register_configs(MetaseqShapedConfig, "base_config")
    cfg = compose("config", overrides=["+oneload=auto", "oneload.strategy=broadcast"])
    assert OmegaConf.is_struct(cfg)
    assert cfg.oneload.strategy == "broadcast" and cfg.common.model_parallel_size == 1
    assert OmegaConf.get_type(cfg.oneload) is OneloadSchema
    # Without +oneload the node is there and empty: metaseq's config is otherwise unchanged.
    assert compose("config").oneload is None


def test_metaseq_schema_typos_and_types(metaseq_app):
    register_configs(MetaseqShapedConfig, "base_config")
    with pytest.raises(ConfigCompositionException, match=r"Could not override 'oneload\.bogus'"):
        compose("config", overrides=["+oneload=auto", "oneload.bogus=1"])
    with pytest.raises(ConfigCompositionException, match=r"oneload\.bucket_mb=abc"):
        compose("config", overrides=["+oneload=auto", "oneload.bucket_mb=abc"])


def test_extend_schema_is_stable_and_keeps_the_base():
    ext = extend_schema(MetaseqShapedConfig)
    assert ext is extend_schema(MetaseqShapedConfig) and issubclass(ext, MetaseqShapedConfig)
    assert [f.name for f in dataclasses.fields(ext)][-1] == "oneload"
    assert extend_schema(ext) is ext
    cfg = OmegaConf.structured(ext)
    assert cfg.oneload is None and cfg.distributed_training.ddp_backend == "pytorch_ddp"


def test_compose_on_its_own():
    assert _hydra.compose_oneload(["+oneload=broadcast", "oneload.verify=true"]) == OneloadConfig(strategy="broadcast", verify=True)
    assert _hydra.compose_oneload(["oneload.strategy=off"]) == OneloadConfig(strategy="off")  # +oneload=auto implied


def test_compose_on_its_own_rejects_typos():
    with pytest.raises(ConfigCompositionException, match=r"Could not override 'oneload\.bogus'"):
        _hydra.compose_oneload(["+oneload=auto", "oneload.bogus=1"])


@pytest.mark.parametrize("override,message", [
    ("oneload.bucket_mb=0", r"oneload\.bucket_mb=0\.0: expected a positive number of MiB"),
])
def test_schema_checks_run_after_composition(override, message):
    with pytest.raises(ValueError, match=message):
        _hydra.compose_oneload(["+oneload=auto", override])


def test_unquoted_off_in_yaml_is_explained():
    with pytest.raises(ValueError, match=r'write strategy: "off"'):
        OneloadConfig(strategy="False")


def test_to_config():
    assert _hydra.to_config(None) == OneloadConfig()
    assert _hydra.to_config({"strategy": "reshard"}).strategy == "reshard"
    with pytest.raises(ValueError, match="unknown key"):
        _hydra.to_config({"stratgy": "reshard"})
