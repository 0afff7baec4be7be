"""What the command line prints where: reports and JSON on stdout, warnings on stderr; the
same --dtype names for every command that writes; export-hf's refusal names the real
embedding scale."""

import json

import pytest

from metaseq_oneload.cli import DTYPES, build_parser, main
from tests.conftest import FIXTURES, needs_fixtures
from tests.hf_tiny import config_of, edited_singleton

pytestmark = needs_fixtures


def test_inspect_notes_go_to_stdout_and_warnings_to_stderr(tmp_path, capsys):
    # The singleton fixture's cfg still says use_sharded_state=True, as its writer leaves it:
    # a note of the report, not a warning.
    assert main(["inspect", str(FIXTURES / "singleton")]) == 0
    out, err = capsys.readouterr()
    assert "kind              singleton" in out and "warning:" not in out and err == ""
    assert "use_sharded_state=True" in out.split("\nnotes\n", 1)[1]
    # An index that no longer describes its files is wrong: a warning, on stderr.
    import torch

    from tests.conftest import raw_load

    import metaseq_oneload as mo

    mo.convert(FIXTURES / "fsdp_dp3", tmp_path / "out" / "ck", shards=2, progress=False)
    shard = tmp_path / "out" / "ck-model_part-0-shard1.pt"
    obj = raw_load(shard)
    obj["extra_state"]["edited"] = True
    torch.save(obj, shard)
    assert main(["inspect", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert "warning:" not in out and err.startswith("warning: ") and "stale" in err


def test_export_hf_warnings_go_to_stderr_and_json_stays_clean(tmp_path, capsys):
    # cfg.model.max_target_positions disagrees with the position table: export-hf warns.
    src = str(edited_singleton(tmp_path / "src", cfg={"max_target_positions": 99}))
    assert main(["export-hf", src, str(tmp_path / "opt"), "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "architecture  OPT: 2 layers" in out and "warning:" not in out
    assert "warning: " in err and "max_target_positions=99" in err
    assert main(["export-hf", src, str(tmp_path / "opt2"), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["warnings"] and err == ""  # the JSON carries them; nothing else is printed


def test_dtype_names_are_the_same_everywhere():
    from metaseq_oneload._convert import DTYPE_BY_NAME as _DTYPES

    assert tuple(sorted(_DTYPES)) == DTYPES
    parser = build_parser()
    for argv in (["convert", "a", "b"], ["consolidate", "a", "b.pt"], ["export-hf", "a", "b"]):
        for name in DTYPES:
            assert parser.parse_args(argv + ["--dtype", name]).dtype == name
        with pytest.raises(SystemExit):
            parser.parse_args(argv + ["--dtype", "int8"])


def test_export_hf_short_dtype_name(tmp_path, capsys):
    assert main(["export-hf", str(FIXTURES / "shard_only"), str(tmp_path / "opt"), "--dtype", "bf16",
                 "--no-progress"]) == 0
    assert config_of(tmp_path / "opt")["torch_dtype"] == "bfloat16"


def test_progress_flags():
    parser = build_parser()
    assert parser.parse_args(["export-hf", "a", "b", "--no-progress"]).no_progress is True
    assert parser.parse_args(["export-hf", "a", "b"]).no_progress is False


@pytest.mark.parametrize("cfg", [{"no_scale_embedding": False}, {"no_scale_embedding": False, "decoder_embed_dim": None}])
def test_refusal_names_the_real_embedding_scale(tmp_path, capsys, cfg):
    # The fixture's embeddings are 34 wide: metaseq multiplies them by sqrt(34), whether or
    # not cfg.model says decoder_embed_dim.
    src = edited_singleton(tmp_path / "src", cfg=cfg)
    assert main(["export-hf", str(src), str(tmp_path / "opt")]) == 2
    err = capsys.readouterr().err
    assert "sqrt(decoder_embed_dim)=5.831" in err and "=1;" not in err
