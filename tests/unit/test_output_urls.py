import os, subprocess, sys, pytest
from tests.conftest import FIXTURES, needs_fixtures
import metaseq_oneload as mo

pytestmark = needs_fixtures


@pytest.mark.parametrize("call", ["convert", "consolidate", "export_hf", "dcp"])
def test_an_object_store_destination_is_refused_and_nothing_lands_in_a_local_folder_named_after_it(tmp_path, monkeypatch, call):
    monkeypatch.chdir(tmp_path)
    src = FIXTURES / "singleton"
    dst = "s3://bucket/out/ck"
    with pytest.raises(mo.OptionError, match=r"s3://bucket/out/ck(\.pt)?: outputs are written to a local"):
        if call == "convert":
            mo.convert(src, dst)
        elif call == "consolidate":
            mo.consolidate(src, dst + ".pt")
        elif call == "export_hf":
            mo.export_hf(src, dst)
        else:
            mo.convert(src, dst, format="dcp")
    assert os.listdir(tmp_path) == []


def test_the_cli_names_the_url(tmp_path):
    r = subprocess.run([sys.executable, "-m", "metaseq_oneload", "convert", str(FIXTURES / "singleton"), "s3://b/x"],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 2 and "s3://b/x: outputs are written to a local" in r.stderr, r.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_an_output_the_disk_has_no_room_for_is_refused_before_anything_is_written(tmp_path, monkeypatch, fmt):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 20, 1 << 20, 4096))  # a full disk
    dst = tmp_path / "out"
    with pytest.raises(mo.ConversionError, match=r"the output needs about .* GiB and the disk has 0\.00 GiB free; "
                                                 r"nothing was written"):
        mo.convert(FIXTURES / "singleton", dst / "ck" if fmt == "torch" else dst, format=fmt)
    assert not dst.exists() or not [p for p in dst.rglob("*") if p.is_file() and not p.name.startswith(".")]
