"""The ``oneload`` group's values are checked when they are composed, wherever: onto a YAML
primary config, a structured one, or on their own. A structured primary config without the
``oneload`` field fails with Hydra's words plus what to do, and the doc section those words
lead to exists."""

import re
from dataclasses import dataclass

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import metaseq_oneload.hydra
from metaseq_oneload._hydra import OneloadSchema, to_config
from metaseq_oneload.hydra import OneloadConfig, compose_oneload
from tests.conftest import REPO

ALLOWED = r"expected one of \[auto, own_shard, reshard, broadcast, parallel, off\]"


def whole(e: BaseException) -> str:
    """The message and its causes, as Hydra prints them (the override, then why)."""
    parts = []
    while e is not None:
        parts.append(str(e))
        e = e.__cause__
    return "\n".join(parts)


def refused(match: str, call, *args, **kwargs) -> str:
    with pytest.raises(ConfigCompositionException) as e:
        call(*args, **kwargs)
    text = whole(e.value)
    assert re.search(match, text), text
    return text


@pytest.fixture
def yaml_app(tmp_path):
    (tmp_path / "config.yaml").write_text("lr: 0.1\n")
    (tmp_path / "pinned.yaml").write_text("defaults:\n  - oneload: auto\n  - _self_\n\noneload:\n  strategy: fast\n")
    (tmp_path / "typed.yaml").write_text("defaults:\n  - oneload: auto\n  - _self_\n\noneload:\n  bucket_mb: lots\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        yield


@pytest.mark.parametrize("override,message", [
    ("oneload.strategy=bogus", rf"Invalid value 'bogus', {ALLOWED}"),
    ("oneload.bucket_mb=abc", r"Value 'abc' of type 'str' could not be converted to Float"),
    ("oneload.fill_cfg=maybe", r"Value 'maybe' is not a valid bool"),
])
def test_a_yaml_app_refuses_bad_values_at_compose_time(yaml_app, override, message):
    text = refused(message, compose, "config", overrides=["+oneload=auto", override])
    assert f"Error merging override {override}" in text and f"full_key: {override.split('=')[0]}" in text


@pytest.mark.parametrize("option", ["auto", "broadcast", "own_shard", "reshard", "off"])
def test_every_option_composes_typed(yaml_app, option):
    cfg = compose("config", overrides=[f"+oneload={option}", "oneload.bucket_mb=64"])
    assert OmegaConf.get_type(cfg.oneload) is OneloadSchema
    assert cfg.oneload.strategy == option and cfg.oneload.bucket_mb == 64.0 and cfg.lr == 0.1
    oc = to_config(cfg.oneload)
    assert oc == OneloadConfig(strategy=option, bucket_mb=64.0) and type(oc.strategy) is str


@pytest.mark.parametrize("value,expected", [("true", True), ("false", False), ("digest", "digest")])
def test_verify_takes_true_false_or_digest(yaml_app, value, expected):
    # "digest" reaches the engine as verify="digest" (integrations pass cfg.verify through).
    oc = to_config(compose("config", overrides=["+oneload=auto", f"oneload.verify={value}"]).oneload)
    assert oc.verify == expected and type(oc.verify) is type(expected)


@pytest.mark.parametrize("value", ["maybe", "1", "Digest", "[1]"])
def test_verify_refuses_anything_else_when_checked(yaml_app, value):
    # No bool-or-str node in OmegaConf: the schema composes it untyped, to_config refuses it.
    cfg = compose("config", overrides=["+oneload=auto", f"oneload.verify={value}"])
    with pytest.raises(ValueError, match=r"oneload\.verify=.*: expected true, false or digest\."):
        to_config(cfg.oneload)


def test_values_in_the_apps_own_yaml_are_checked_too(yaml_app):
    refused(rf"Invalid value 'fast', {ALLOWED}", compose, "pinned")
    refused(r"Value 'lots' of type 'str' could not be converted", compose, "typed")


def test_composing_on_its_own_refuses_an_unknown_strategy():
    # One message (the start-up hook prints str(e)): the override and why it was refused.
    with pytest.raises(ConfigCompositionException, match=rf"oneload\.strategy=fast: Invalid value 'fast', {ALLOWED}"):
        compose_oneload(["+oneload=auto", "oneload.strategy=fast"])


@dataclass
class Cfg:
    lr: float = 0.1


@pytest.fixture
def structured_app(tmp_path):
    cs = ConfigStore.instance()
    cs.store(name="oneload_test_structured", node=Cfg)
    try:
        with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
            yield cs
    finally:
        cs.repo.pop("oneload_test_structured.yaml", None)


def test_a_structured_primary_config_says_what_to_do(structured_app):
    with pytest.raises(ConfigCompositionException) as e:
        compose("oneload_test_structured", overrides=["+oneload=auto"])
    text = str(e.value)
    assert "Key 'oneload' not in 'Cfg'" in text  # Hydra's own words first: what a search finds
    assert "metaseq_oneload.hydra.register_configs(Cfg, 'oneload_test_structured')" in text
    assert "docs/hydra.md" in text


def test_the_fix_the_message_names_works(structured_app):
    metaseq_oneload.hydra.register_configs(Cfg, "oneload_test_structured")
    cfg = compose("oneload_test_structured", overrides=["+oneload=auto", "oneload.strategy=broadcast"])
    assert OmegaConf.is_struct(cfg) and cfg.lr == 0.1 and cfg.oneload.strategy == "broadcast"
    refused(rf"Invalid value 'bogus', {ALLOWED}", compose, "oneload_test_structured",
            overrides=["+oneload=auto", "oneload.strategy=bogus"])
    assert compose("oneload_test_structured").oneload is None  # nothing added without +oneload


def test_other_composition_errors_are_left_as_hydra_words_them(structured_app):
    with pytest.raises(ConfigCompositionException) as e:
        compose("oneload_test_structured", overrides=["lr2=1"])
    assert "metaseq-oneload" not in str(e.value)


def test_the_doc_section_the_message_names_exists():
    from hydra_plugins.oneload_searchpath.oneload_searchpath import HINT

    section = re.search(r'docs/hydra\.md, "([^"]+)"', HINT).group(1)
    headings = [line.lstrip("#").strip() for line in (REPO / "docs" / "hydra.md").read_text().splitlines()
                if line.startswith("#")]
    assert section in headings
