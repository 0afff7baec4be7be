"""Settings in one place (#22, item 5): every ``METASEQ_ONELOAD_*`` variable is read by
``_settings.from_env`` and nowhere else, a malformed value is an OptionError naming the
variable, the ranks' differences are worded by ``disagreement``, and the documented tables
(the module docstring, docs/environment.md) list exactly the variables the code reads."""

from __future__ import annotations

import ast
import collections
import re
from pathlib import Path

import pytest

import metaseq_oneload
from metaseq_oneload import OptionError, _settings
from metaseq_oneload._settings import AGREED, Settings, disagreement, from_env, variable

PACKAGE = Path(metaseq_oneload.__file__).parent
REPO = PACKAGE.parent
VARIABLES = {variable(f) for f in _settings._FIELDS}

# Environment variables other modules may read, and why: nothing here is a setting of a load.
ALLOWED_READS = {
    # ``METASEQ_ONELOAD`` (no suffix) carries the Hydra overrides that activate the plugin
    "_hydra.py": {"METASEQ_ONELOAD"},
    "_startup.py": {"METASEQ_ONELOAD"},
    "integrations/_core.py": {"METASEQ_ONELOAD"},
    # metaseq's launch: torchrun's variables tell whether torchrun decides the world size
    "integrations/metaseq.py": {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"},
    # torchrun's node rank, which names a node where METASEQ_ONELOAD_NODE does not
    # and how many processes a launcher started on this host (each may load alone)
    "_nodes.py": {"GROUP_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE",
                  "MPI_LOCALNRANKS", "LOCAL_SIZE", "HOROVOD_LOCAL_SIZE", "PALS_LOCAL_SIZE", "SLURM_STEP_TASKS_PER_NODE",
                  "SLURM_TASKS_PER_NODE", "WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE", "PMI_LOCAL_SIZE",
                  "JSM_NAMESPACE_LOCAL_SIZE"},
    # the XDG base directory, where the index key lives by default
    "formats/_index.py": {"XDG_CACHE_HOME"},
}
# Modules that hand ``os.environ`` itself on (activation reads METASEQ_ONELOAD from it and
# writes it back for the workers).
ALLOWED_WHOLE = {"_startup.py"}
_NAME = re.compile(r"^\$?METASEQ_ONELOAD_[A-Z0-9_]*$")


# --------------------------------------------------------------------------- from_env


def test_an_empty_environment_gives_the_defaults():
    assert from_env({}) == Settings()
    assert from_env({variable(f): "  " for f in _settings._FIELDS}) == Settings()  # blank: unset
    assert Settings().agreed() == {"shm": True, "shm_dir": "/dev/shm"}
    assert set(Settings().agreed()) == set(AGREED)


def test_values_are_read_and_typed():
    env = {
        "METASEQ_ONELOAD_ARRIVAL_TIMEOUT": "12.5", "METASEQ_ONELOAD_NODE": "n7", "METASEQ_ONELOAD_SHM": "off",
        "METASEQ_ONELOAD_SHM_DIR": "/tmp/x", "METASEQ_ONELOAD_O_DIRECT": "yes", "METASEQ_ONELOAD_READ_THREADS": "3",
        "METASEQ_ONELOAD_READ_SPLIT_MB": "4", "METASEQ_ONELOAD_REMOTE_CONCURRENCY": "2",
        "METASEQ_ONELOAD_REMOTE_RETRIES": "0", "METASEQ_ONELOAD_REMOTE_BACKOFF": "0",
        "METASEQ_ONELOAD_REMOTE_PART_MB": "0.25", "METASEQ_ONELOAD_STORAGE_OPTIONS": '{"anon": true}',
        "METASEQ_ONELOAD_INDEX_KEY": "~/k",
    }
    assert set(env) == VARIABLES
    assert from_env(env) == Settings(arrival_timeout=12.5, node="n7", shm=False, shm_dir="/tmp/x", o_direct=True,
                                     read_threads=3, read_split_mb=4.0, remote_concurrency=2, remote_retries=0,
                                     remote_backoff=0.0, remote_part_mb=0.25, storage_options='{"anon": true}',
                                     index_key="~/k")
    assert from_env(env).agreed() == {"shm": False, "shm_dir": "/tmp/x"}


def test_o_direct_is_auto_unless_set_and_auto_asks_for_the_choice_per_piece():
    assert from_env({}).o_direct is None
    assert from_env({"METASEQ_ONELOAD_O_DIRECT": "0"}).o_direct is False
    assert from_env({"METASEQ_ONELOAD_O_DIRECT": "auto"}).o_direct is None
    assert from_env({"METASEQ_ONELOAD_O_DIRECT": "AUTO"}).o_direct is None
    with pytest.raises(OptionError, match="or auto"):
        from_env({"METASEQ_ONELOAD_O_DIRECT": "automatic"})


BAD = {
    "arrival_timeout": ("soon", "0", "-1", "inf", "nan"),
    "shm": ("2", "maybe"),
    "o_direct": ("direct",),
    "read_threads": ("many", "0", "2.5"),
    "read_split_mb": ("0", "big"),
    "remote_concurrency": ("0",),
    "remote_retries": ("-1", "1.5"),
    "remote_backoff": ("-0.1", "x"),
    "remote_part_mb": ("0.01", "0"),
    "storage_options": ("[1]", "{", '"anon"'),
}


@pytest.mark.parametrize("field,raw", [(f, raw) for f, raws in BAD.items() for raw in raws])
def test_a_malformed_value_is_an_option_error_naming_the_variable(field, raw):
    with pytest.raises(OptionError, match=rf"^\${variable(field)}={re.escape(repr(raw))}: expected ") as e:
        from_env({variable(field): raw})
    assert "unset it for the default" in str(e.value)


def test_numbers_are_worded_as_numbers():
    # (RangeReader's and the arrival timeout's messages have always said so; users match on it)
    with pytest.raises(OptionError, match=r"\$METASEQ_ONELOAD_READ_THREADS='many': expected a number"):
        from_env({"METASEQ_ONELOAD_READ_THREADS": "many"})
    with pytest.raises(OptionError, match=r"\$METASEQ_ONELOAD_ARRIVAL_TIMEOUT='soon': expected a number of seconds"):
        from_env({"METASEQ_ONELOAD_ARRIVAL_TIMEOUT": "soon"})


def test_every_field_has_a_variable_and_a_kind():
    from dataclasses import fields

    assert [f.name for f in fields(Settings)] == list(_settings._FIELDS)
    for suffix, kind in _settings._FIELDS.values():
        assert kind in _settings._KINDS or kind in ("text", "path", "json_object", "flag", "flag_on", "flag_auto"), kind
    assert set(AGREED) <= set(_settings._FIELDS)


def test_a_disagreement_names_the_variable_and_the_ranks():
    same = [Settings().agreed()] * 3
    assert disagreement(same, [0, 1, 2]) is None
    assert disagreement([], []) is None
    odd = [Settings().agreed(), Settings(shm=False).agreed(), Settings().agreed()]
    msg = disagreement(odd, [4, 5, 6])
    assert msg.startswith("$METASEQ_ONELOAD_SHM differs between the ranks of one load (True on rank(s) 4, 6; "
                          "False on rank(s) 5)"), msg
    assert "Set it the same in every rank's environment" in msg
    msg = disagreement([Settings().agreed(), Settings(shm_dir="/tmp").agreed()], [0, 1])
    assert "$METASEQ_ONELOAD_SHM_DIR differs" in msg and "'/dev/shm' on rank(s) 0; '/tmp' on rank(s) 1" in msg
    many = [Settings().agreed()] + [Settings(shm=False).agreed()] * 10
    assert "on rank(s) 1, 2, 3, 4, 5, 6, 7, 8 ..." in disagreement(many, list(range(11)))


# --------------------------------------------------------------------------- who reads what


def test_the_readers_take_their_values_from_the_settings(monkeypatch):
    from metaseq_oneload import _dist, _storage
    from metaseq_oneload.formats import _index

    for v in VARIABLES:
        monkeypatch.delenv(v, raising=False)
    assert _storage.settings() == _storage.RemoteSettings()
    assert _dist.arrival_timeout() == _dist.DEFAULT_ARRIVAL_TIMEOUT == Settings().arrival_timeout == 300
    monkeypatch.setenv("METASEQ_ONELOAD_REMOTE_CONCURRENCY", "3")
    monkeypatch.setenv("METASEQ_ONELOAD_REMOTE_RETRIES", "0")
    monkeypatch.setenv("METASEQ_ONELOAD_REMOTE_BACKOFF", "1.5")
    monkeypatch.setenv("METASEQ_ONELOAD_REMOTE_PART_MB", "0.5")
    monkeypatch.setenv("METASEQ_ONELOAD_STORAGE_OPTIONS", '{"anon": true}')
    assert _storage.settings() == _storage.RemoteSettings(3, 0, 1.5, 512 << 10, '{"anon": true}')
    # arrival_timeout: the argument, else the settings given, else the environment, else 300
    monkeypatch.setenv("METASEQ_ONELOAD_ARRIVAL_TIMEOUT", "12.5")
    assert _dist.arrival_timeout() == 12.5 and _dist.arrival_timeout(3) == 3.0
    assert _dist.arrival_timeout(None, Settings(arrival_timeout=7)) == 7.0
    assert _dist.arrival_timeout(2, Settings(arrival_timeout=7)) == 2.0
    with pytest.raises(OptionError, match=r"arrival_timeout=0: expected a positive number of seconds"):
        _dist.arrival_timeout(0)
    monkeypatch.setenv("METASEQ_ONELOAD_INDEX_KEY", "/somewhere/key")
    assert _index.key_path() == "/somewhere/key"


def test_each_reader_checks_only_the_variables_it_uses(monkeypatch, tmp_path):
    """A malformed object-store variable does not fail a load of local files nor the index
    key lookup; a malformed load variable does not fail a request to a store; each still
    fails its own user, naming the variable."""
    import torch

    import metaseq_oneload as mo
    from metaseq_oneload import _storage
    from metaseq_oneload.formats import _index

    for v in VARIABLES:
        monkeypatch.delenv(v, raising=False)
    path = tmp_path / "model.pt"
    torch.save({"model": {"w": torch.arange(6.0)}}, path)
    monkeypatch.setenv("METASEQ_ONELOAD_REMOTE_RETRIES", "abc")
    monkeypatch.setenv("METASEQ_ONELOAD_STORAGE_OPTIONS", "anon=true")
    assert torch.equal(mo.load_state_dict(path)["w"], torch.arange(6.0))
    assert _index.key_path()
    with pytest.raises(OptionError, match=r"\$METASEQ_ONELOAD_REMOTE_RETRIES='abc'"):
        _storage.settings()
    for v in VARIABLES:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("METASEQ_ONELOAD_READ_THREADS", "many")
    assert _storage.settings() == _storage.RemoteSettings()
    with pytest.raises(OptionError, match=r"\$METASEQ_ONELOAD_READ_THREADS='many'"):
        mo.load_state_dict(path)


def _bindings(tree: ast.AST, imports: bool = True) -> collections.Counter:
    """How many times each name is bound anywhere in a module (assignments, augmented ones,
    loop and comprehension targets, arguments, ``global`` statements, and imports unless
    ``imports`` is False)."""
    count = collections.Counter()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            count[n.id] += 1
        elif isinstance(n, ast.arg):
            count[n.arg] += 1
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            count.update(n.names)
        elif imports and isinstance(n, (ast.Import, ast.ImportFrom)):
            count.update((a.asname or a.name).split(".")[0] for a in n.names)
    return count


def _constants(tree: ast.AST) -> dict:
    """A module's names bound once, at its top level, to a string, a tuple of strings (as a
    frozenset) or a sum of such tuples; a name bound anywhere else as well is not resolved."""
    once = {name for name, k in _bindings(tree).items() if k == 1}
    out = {}
    for n in tree.body:
        if not (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
                and n.targets[0].id in once):
            continue
        value = _constant_value(n.value, out)
        if value is not None:
            out[n.targets[0].id] = value
    return out


def _constant_value(node: ast.AST, known: dict):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Tuple) and all(isinstance(e, ast.Constant) and isinstance(e.value, str)
                                           for e in node.elts):
        return frozenset(e.value for e in node.elts)
    if isinstance(node, ast.Name) and isinstance(known.get(node.id), frozenset):
        return known[node.id]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _constant_value(node.left, known), _constant_value(node.right, known)
        if isinstance(left, frozenset) and isinstance(right, frozenset):
            return left | right
    return None


def _keys(node: ast.AST, parents: dict, consts: dict) -> set:
    """The variable names an expression used as an environment key can take ('<computed>'
    where the source does not say)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Name):
        if isinstance(consts.get(node.id), str):
            return {consts[node.id]}
        p = parents.get(node)
        while p is not None:  # a loop over a literal tuple of names: `for k in ("RANK", ...)`
            gens = p.generators if isinstance(p, (ast.GeneratorExp, ast.ListComp, ast.SetComp)) else []
            for g in gens:
                if isinstance(g.target, ast.Name) and g.target.id == node.id and isinstance(g.iter, (ast.Tuple, ast.List)):
                    if all(isinstance(e, ast.Constant) for e in g.iter.elts):
                        return {e.value for e in g.iter.elts}
                if isinstance(g.target, ast.Name) and g.target.id == node.id and isinstance(g.iter, ast.Name) \
                        and isinstance(consts.get(g.iter.id), frozenset):  # over a module's tuple of names
                    return set(consts[g.iter.id])
            p = parents.get(p)
    return {"<computed>"}


def _environment_uses(path: Path, consts: dict) -> list:
    """(line, key or '<whole>') for every read or write of os.environ / os.getenv in a module."""
    tree = ast.parse(path.read_text())
    own = _constants(tree)
    # another module's constant (ENV from _hydra) counts here only where this module binds no
    # such name itself, but by importing it
    consts = {**{k: v for k, v in consts.items() if k not in _bindings(tree, imports=False)}, **own}
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    environ_names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "os"
                     for a in n.names if a.name == "environ"}
    out = []
    for node in ast.walk(tree):
        is_environ = ((isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
                       and node.value.id == "os") or (isinstance(node, ast.Name) and node.id in environ_names))
        is_getenv = isinstance(node, ast.Attribute) and node.attr == "getenv" and isinstance(node.value, ast.Name) \
            and node.value.id == "os"
        if not (is_environ or is_getenv):
            continue
        p = parents.get(node)
        key = None
        if is_getenv and isinstance(p, ast.Call) and p.args:
            key = p.args[0]
        elif isinstance(p, ast.Subscript) and p.value is node:
            key = p.slice
        elif isinstance(p, ast.Attribute) and p.attr in ("get", "pop", "setdefault", "__getitem__"):
            call = parents.get(p)
            key = call.args[0] if isinstance(call, ast.Call) and call.args else None
        elif isinstance(p, ast.Compare) and node in p.comparators:
            key = p.left
        if key is None:
            out.append((node.lineno, "<whole>"))
        else:
            out.extend((node.lineno, k) for k in _keys(key, parents, consts))
    return out


def _package_sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), path


def test_no_module_but_settings_reads_the_environment_for_a_setting():
    consts = {}
    for _, path in _package_sources():  # (names imported between modules: ENV from _hydra)
        consts.update(_constants(ast.parse(path.read_text())))
    problems = []
    for rel, path in _package_sources():
        if rel == "_settings.py":
            continue
        for line, key in _environment_uses(path, consts):
            if key == "<whole>":
                if rel not in ALLOWED_WHOLE:
                    problems.append(f"{rel}:{line}: uses os.environ as a whole")
            elif key not in ALLOWED_READS.get(rel, ()):
                problems.append(f"{rel}:{line}: reads ${key} from the environment")
        for node in ast.walk(ast.parse(path.read_text())):
            # a variable's name kept as a value is a read in waiting (messages may name one)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _NAME.match(node.value):
                problems.append(f"{rel}:{node.lineno}: names {node.value!r} (use _settings.variable())")
    assert not problems, ("only _settings.py reads METASEQ_ONELOAD_* variables (through from_env); still "
                          "reading the environment:\n" + "\n".join(problems))


def test_the_scan_sees_what_it_looks_for(tmp_path):
    """The scan above finds each way a module reads the environment (so that its silence means something)."""
    src = tmp_path / "m.py"
    src.write_text('import os\nfrom os import environ as E\nN = "METASEQ_ONELOAD_X"\n'
                   'a = os.environ.get(N)\nb = os.environ["METASEQ_ONELOAD_Y"]\nc = os.getenv("Z")\n'
                   'd = "W" in os.environ\ne = E.get("V")\nf = all(k in os.environ for k in ("R", "S"))\n'
                   'g = dict(os.environ)\nh = os.environ.get("METASEQ_ONELOAD_" + N)\n')
    got = {k for _, k in _environment_uses(src, {})}
    assert got == {"METASEQ_ONELOAD_X", "METASEQ_ONELOAD_Y", "Z", "W", "V", "R", "S", "<whole>", "<computed>"}


@pytest.mark.parametrize("source", [
    'import os\nS = ("A",)\nS += ("FOO",)\nx = [os.environ.get(v) for v in S]\n',
    'import os\nS = ("A",)\nif True:\n    S = ("FOO",)\nx = [os.environ.get(v) for v in S]\n',
    'import os\nS = ("A",)\ndef f():\n    global S\n    S = ("FOO",)\nx = [os.environ.get(v) for v in S]\n',
    'import os\nS = ("A",)\ndef f(S):\n    return [os.environ.get(v) for v in S]\n',
    'import os\nN = "A"\ndef f(N):\n    return os.environ.get(N)\n',
    'import os\ndef f():\n    S = ("FOO",)\n    return [os.environ.get(v) for v in S]\n',
])
def test_the_scan_resolves_only_a_name_bound_once(tmp_path, source):
    # a name bound more than once (or only here while another module binds it) may hold
    # anything: the scan must not take the one value it sees for all of them
    src = tmp_path / "m.py"
    src.write_text(source)
    got = {k for _, k in _environment_uses(src, {"S": frozenset({"A"})})}
    assert got == {"<computed>"}, got


def test_the_scan_resolves_a_sum_of_tuples_of_names(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('import os\nA = ("X",)\nB = ("Y",)\nC = A + B\nx = [os.environ.get(v) for v in C]\n')
    assert {k for _, k in _environment_uses(src, {})} == {"X", "Y"}


# --------------------------------------------------------------------------- the tables


def _docstring_rows() -> dict:
    doc = _settings.__doc__
    return {m.group(1): m.group(2) for m in re.finditer(r"^``(METASEQ_ONELOAD_[A-Z_]+)``\s+(\S+)", doc, re.M)}


def _page_rows() -> dict:
    text = (REPO / "docs" / "environment.md").read_text()
    return {m.group(1): (m.group(2).strip(), m.group(3).strip())
            for m in re.finditer(r"^\| `(METASEQ_ONELOAD_[A-Z_]+)` \|([^|]*)\|([^|]*)\|", text, re.M)}


def _same_default(doc: str, value, field: str) -> bool:
    if _settings._FIELDS[field][1] == "flag_auto" and value is None:  # None is "auto" there
        return doc == "auto"
    if isinstance(value, bool):
        return doc == ("1" if value else "0")
    if isinstance(value, (int, float)):
        return float(doc) == value
    return doc == value or doc in ("(derived)", "(file)")


def test_the_docstring_table_lists_every_variable_with_its_default():
    rows = _docstring_rows()
    assert set(rows) == VARIABLES
    defaults = Settings()
    for field in _settings._FIELDS:
        assert _same_default(rows[variable(field)], getattr(defaults, field), field), (field, rows[variable(field)])


def test_the_docs_page_lists_every_variable_its_default_and_which_are_agreed():
    rows = _page_rows()
    assert set(rows) == VARIABLES
    defaults = Settings()
    for field in _settings._FIELDS:
        default, agreed = rows[variable(field)]
        assert _same_default(default, getattr(defaults, field), field), (field, default)
        assert (agreed == "**agreed**") == (field in AGREED), (field, agreed)


def test_the_docs_name_no_variable_the_code_does_not_read():
    # (the fairseq test harness's own variables are read by tests/integration, not the package)
    harness = {"METASEQ_ONELOAD_FAIRSEQ_HOME", "METASEQ_ONELOAD_FAIRSEQ_PYTHON"}
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    pages += [p for _, p in _package_sources()]
    unknown = {}
    for page in pages:
        text = page.read_text()
        for name in re.findall(r"METASEQ_ONELOAD_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_]*\*)", text):
            if name not in VARIABLES | harness:
                unknown.setdefault(name, []).append(str(page.relative_to(REPO)))
        for family in re.findall(r"(METASEQ_ONELOAD_[A-Z0-9_]*)\*", text):  # METASEQ_ONELOAD_REMOTE_*
            if not any(v.startswith(family) for v in VARIABLES):
                unknown.setdefault(family + "*", []).append(str(page.relative_to(REPO)))
    assert not unknown, unknown
