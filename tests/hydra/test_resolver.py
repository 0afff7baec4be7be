"""``${oneload:KEY,PATH}`` on the real metaseq checkpoints: every key, the forms of PATH,
the cache and its invalidation, errors."""

import os
import shutil
from dataclasses import dataclass, field

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError

from metaseq_oneload import _hydra
from tests.conftest import EXPECTED, FIXTURES, SETS, copy_set, needs_fixtures

pytestmark = needs_fixtures

WORLD = {"singleton": 1, "fsdp_dp3": 3, "mp2_ddp": 2, "mp2_dp2": 4, "shard_only": 2}


@pytest.fixture(autouse=True)
def resolver():
    _hydra.register_resolver()
    _hydra.clear_cache()
    yield
    _hydra.clear_cache()


def test_registration_is_idempotent():
    assert OmegaConf.has_resolver("oneload")
    assert _hydra.register_resolver() is False


@pytest.mark.parametrize("name", SETS)
def test_every_key(name):
    kind, mp, shards, flat = EXPECTED[name]
    cfg = OmegaConf.create({"path": str(FIXTURES / name), **{k: f"${{oneload:{k},${{path}}}}" for k in (
        "model_parallel_size", "checkpoint_shard_count", "use_sharded_state", "ddp_backend", "world_size", "kind",
        "shards_per_part", "flat", "num_updates")}})
    assert OmegaConf.to_container(cfg, resolve=True) == {
        "path": str(FIXTURES / name), "model_parallel_size": mp, "checkpoint_shard_count": 1,
        "use_sharded_state": kind == "fsdp_sharded", "ddp_backend": "fully_sharded" if kind == "fsdp_sharded" else None,
        "world_size": WORLD[name], "kind": kind, "shards_per_part": shards, "flat": flat, "num_updates": 2}


def test_metaseq_style_interpolation_into_a_typed_config():
    @dataclass
    class Common:
        model_parallel_size: int = 1

    @dataclass
    class Checkpoint:
        restore_file: str = str(FIXTURES / "mp2_dp2" / "checkpoint_last.pt")

    @dataclass
    class Root:
        common: Common = field(default_factory=lambda: Common(
            model_parallel_size="${oneload:model_parallel_size,${checkpoint.restore_file}}"))
        checkpoint: Checkpoint = field(default_factory=Checkpoint)

    cfg = OmegaConf.structured(Root)
    assert cfg.common.model_parallel_size == 2


@pytest.mark.parametrize("form", ["folder", "last", "shard", "glob"])
def test_any_path_form(form):
    d = FIXTURES / "mp2_dp2"
    path = {"folder": d, "last": d / "checkpoint_last.pt", "shard": d / "checkpoint_2-model_part-1-shard0.pt",
            "glob": d / "checkpoint_2-*.pt"}[form]
    assert _hydra.resolve("world_size", str(path)) == 4


def test_one_argument_form_reads_oneload_path():
    cfg = OmegaConf.create({"oneload": {"path": str(FIXTURES / "fsdp_dp3")}, "kind": "${oneload:kind}"})
    assert cfg.kind == "fsdp_sharded"


def test_default_for_a_first_launch(tmp_path):
    cfg = OmegaConf.create({"mp": f"${{oneload:model_parallel_size,{tmp_path}/checkpoint_last.pt,1}}"})
    assert cfg.mp == 1


def test_missing_checkpoint_without_default(tmp_path):
    cfg = OmegaConf.create({"mp": f"${{oneload:model_parallel_size,{tmp_path}/checkpoint_last.pt}}"})
    with pytest.raises(InterpolationResolutionError, match=r"checkpoint_last\.pt: no such file"):
        cfg.mp


def test_unknown_key_and_missing_path():
    with pytest.raises(InterpolationResolutionError, match=r"unknown key 'shards'; expected one of model_parallel_size"):
        OmegaConf.create({"x": f"${{oneload:shards,{FIXTURES / 'singleton'}}}"}).x
    with pytest.raises(InterpolationResolutionError, match=r"no checkpoint path: write \$\{oneload:kind,PATH\}"):
        OmegaConf.create({"x": "${oneload:kind}"}).x


def test_damaged_checkpoint_is_an_error_even_with_a_default(tmp_path):
    d = copy_set("fsdp_dp3", tmp_path)
    os.remove(d / "checkpoint_2-model_part-0-shard1.pt")
    cfg = OmegaConf.create({"x": f"${{oneload:world_size,{d},1}}"})
    with pytest.raises(InterpolationResolutionError, match=r"missing checkpoint_2-model_part-0-shard1\.pt"):
        cfg.x


def test_cached_per_path_and_refreshed_when_the_folder_changes(tmp_path):
    d = copy_set("shard_only", tmp_path)
    assert _hydra.resolve("world_size", str(d)) == 2
    assert len(_hydra._CACHE) == 1
    assert _hydra.resolve("kind", str(d)) == "fsdp_sharded"
    assert len(_hydra._CACHE) == 1  # the second key came from the cache
    shutil.copy(d / "checkpoint_2-shard1.pt", d / "checkpoint_2-shard2.pt")
    os.utime(d, ns=(0, os.stat(d).st_mtime_ns + 10 ** 9))  # coarse mtime clocks: make the change visible
    with pytest.raises(Exception, match="checkpoint_2-shard"):
        _hydra.resolve("world_size", str(d))  # a third shard of another save: refused, not the cached 2


def test_a_key_the_files_leave_open_takes_the_default():
    # Unflattened weights load under any backend: ddp_backend is None, and the default given
    # (documented in docs/hydra.md) fills a typed str field instead of failing validation.
    @dataclass
    class Distributed:
        ddp_backend: str = f"${{oneload:ddp_backend,{FIXTURES / 'mp2_ddp'},pytorch_ddp}}"

    cfg = OmegaConf.structured(Distributed)
    assert cfg.ddp_backend == "pytorch_ddp"
    assert _hydra.resolve("ddp_backend", str(FIXTURES / "mp2_ddp")) is None  # no default: None, as the files say
    assert _hydra.resolve("ddp_backend", str(FIXTURES / "fsdp_dp3"), "pytorch_ddp") == "fully_sharded"
