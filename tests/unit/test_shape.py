"""The package keeps the shape issue #22 asked for (tools/shape.py measures it with ``ast``):
no import cycles, at most 2 functions over 80 lines and 2 modules over 800, at most 20
underscore names imported across modules. The tool itself is checked on a small package
that breaks every rule, so these tests can fail for the reason their names give."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("oneload_shape", ROOT / "tools" / "shape.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


SHAPE = _tool()
PACKAGE = SHAPE.measure(ROOT / "metaseq_oneload")


def test_the_package_has_no_import_cycle():
    assert PACKAGE.cycles == (), PACKAGE.cycles


def test_at_most_two_functions_are_over_80_lines():
    assert len(PACKAGE.long_functions) <= 2, PACKAGE.long_functions


def test_at_most_two_modules_are_over_800_lines():
    assert len(PACKAGE.long_modules) <= 2, PACKAGE.long_modules


def test_at_most_20_underscore_names_cross_a_module_boundary():
    assert len(PACKAGE.private_names) <= 20, sorted(PACKAGE.private_names)


def test_the_tool_sees_each_thing_it_counts(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from ._a import verb  # the facade: not a cycle\n")
    (pkg / "_a.py").write_text(textwrap.dedent('''\
        from ._b import _helper

        def verb():
            """A docstring does not count."""
        ''') + "".join(f"    x{i} = {i}\n" for i in range(81)))
    (pkg / "_b.py").write_text("def _helper():\n    from ._a import verb  # hidden in a function\n"
                               + "# filler\n" * 800)
    shape = SHAPE.measure(pkg)
    assert shape.cycles == (("pkg._a", "pkg._b"),)
    assert [(f[1], f[2]) for f in shape.long_functions] == [("pkg._a", "verb")]
    assert [m[1] for m in shape.long_modules] == ["pkg._b"]
    assert shape.private_names == {("pkg._b", "_helper")}
