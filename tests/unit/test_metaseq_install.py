"""install() / uninstall() semantics with stand-in packages called fairseq and metaseq (the
real metaseq is in test_metaseq_patch.py): repeated installs keep the configuration, "off"
uninstalls, only the libraries the program uses are imported and patched."""

import json
import os
import subprocess
import sys
import textwrap

from tests.conftest import REPO

FAKE_FAIRSEQ = '''\
def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
    return "fairseq's own"


def load_model_ensemble_and_task(filenames, arg_overrides=None, task=None, strict=True, suffix="", num_shards=1,
                                 state=None):
    return "fairseq's own"


def load_checkpoint(cfg, trainer, **passthrough_args):
    return "fairseq's own"
'''


def run(tmp_path, code: str) -> dict:
    site = tmp_path / "site"
    (site / "fairseq").mkdir(parents=True)
    (site / "fairseq" / "__init__.py").write_text("")
    (site / "fairseq" / "checkpoint_utils.py").write_text(FAKE_FAIRSEQ)
    # the other names fairseq's patch replaces
    (site / "fairseq" / "options.py").write_text("def parse_args_and_arch(parser, input_args=None):\n    pass\n")
    (site / "fairseq" / "trainer.py").write_text("class Trainer:\n    def load_checkpoint(self, filename):\n        pass\n")
    (site / "fairseq" / "distributed").mkdir()
    (site / "fairseq" / "distributed" / "__init__.py").write_text("")
    (site / "fairseq" / "distributed" / "utils.py").write_text(
        "def broadcast_object(obj, src_rank, group, dist_device=None):\n    return obj\n")
    (site / "metaseq").mkdir()  # importable, and not metaseq: patching it fails (also where the
    # real metaseq is installed too, whose submodules its editable finder would hand out)
    (site / "metaseq" / "__init__.py").write_text(
        "import sys\nIMPORTED = True\nsys.modules['metaseq.checkpoint_utils'] = None\n")
    env = {k: v for k, v in os.environ.items() if k != "METASEQ_ONELOAD"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)])
    prelude = "import json, logging, sys\nlogging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
    r = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                       env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["log"] = r.stderr
    return out


def test_repeated_install_keeps_the_config_and_off_uninstalls(tmp_path):
    out = run(tmp_path, """
        import fairseq.checkpoint_utils as cu
        from metaseq_oneload import integrations as m
        from metaseq_oneload.integrations._patching import STATE
        orig = cu.load_checkpoint_to_cpu
        out = {"first": m.install({"strategy": "broadcast", "bucket_mb": 8}, explicit=["--model-parallel-size"])}
        out["again"] = m.install()  # e.g. a script's own install() after the start-up hook's
        out["kept"] = [m.current_config().strategy, m.current_config().bucket_mb, sorted(STATE.explicit)]
        out["new"] = [m.install({"strategy": "reshard"}), m.current_config().strategy, sorted(STATE.explicit)]
        out["off"] = m.install({"strategy": "off"})
        out["after_off"] = [m.installed(), cu.load_checkpoint_to_cpu is orig, m.current_config().strategy]
        out["fresh"] = [m.install(), m.current_config().strategy, m.installed()]
        print(json.dumps(out))
        """)
    assert out["first"] is True and out["again"] is False
    assert out["kept"] == ["broadcast", 8, ["--model-parallel-size"]]
    assert out["new"] == [False, "reshard", ["--model-parallel-size"]]
    assert out["off"] is False and out["after_off"] == [False, True, "off"]
    assert out["fresh"] == [True, "auto", True]


def test_only_the_library_in_use_is_imported_and_patched(tmp_path):
    out = run(tmp_path, """
        import fairseq.checkpoint_utils as cu
        from metaseq_oneload import integrations as m
        from metaseq_oneload.integrations._patching import STATE
        out = {"installed": m.install(), "libraries": list(STATE.libraries),
               "metaseq_imported": "metaseq" in sys.modules,
               "fairseq_patched": cu.load_checkpoint_to_cpu.__module__ == "metaseq_oneload.integrations.fairseq"}
        import metaseq  # imported later: patched as it is imported; this stand-in cannot be, which is logged
        out["import_ok"] = metaseq.IMPORTED
        out["libraries_after"] = list(STATE.libraries)
        m.uninstall()
        out["hook_gone"] = not any(type(f).__name__ == "AfterImport" for f in sys.meta_path)
        print(json.dumps(out))
        """)
    assert out["installed"] is True and out["libraries"] == ["fairseq"] and out["fairseq_patched"]
    assert out["metaseq_imported"] is False  # install() did not import metaseq for a fairseq program
    assert out["import_ok"] is True and out["libraries_after"] == ["fairseq"]
    assert "metaseq was imported after install() and could not be patched" in out["log"]
    assert out["hook_gone"]
