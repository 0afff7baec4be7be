"""The package's shape, as issue #22 measures it (read with ``ast``; nothing is imported).

    python tools/shape.py [metaseq_oneload] [-v]

Prints the package's lines, its import cycles (function-level imports count: a cycle hidden
inside a function is still a cycle), the functions over 80 lines (docstring excluded), the
modules over 800 lines, and the underscore names one module imports from another (``-v``
lists them). tests/unit/test_shape.py holds the package to the issue's targets.
"""

from __future__ import annotations

import ast
import collections
import pathlib
import sys
from dataclasses import dataclass

LONG_FUNCTION = 80
LONG_MODULE = 800


@dataclass(frozen=True)
class Shape:
    lines: int
    cycles: tuple  # of sorted tuples of module names
    long_functions: tuple  # of (lines, module, function)
    long_modules: tuple  # of (lines, module)
    private_imports: tuple  # of (importing module, imported module, name)

    @property
    def private_names(self) -> set:
        return {(target, name) for _, target, name in self.private_imports}


def _modules(root: pathlib.Path) -> dict:
    mods = {}
    for p in sorted(root.rglob("*.py")):
        name = ".".join(p.relative_to(root.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    return mods


def _target(module: str, level: int, current: str, is_package: bool) -> str:
    if level == 0:
        return module or ""
    base = current.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _body_lines(node) -> int:
    body = node.body
    first = body[0]
    start = first.lineno
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        start = body[1].lineno if len(body) > 1 else node.end_lineno + 1
    return node.end_lineno - start + 1


def _cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(n):
        index[n] = low[n] = counter[0]
        counter[0] += 1
        stack.append(n)
        on.add(n)
        for m in graph.get(n, ()):
            if m not in index:
                visit(m)
                low[n] = min(low[n], low[m])
            elif m in on:
                low[n] = min(low[n], index[m])
        if low[n] == index[n]:
            comp = []
            while True:
                m = stack.pop()
                on.discard(m)
                comp.append(m)
                if m == n:
                    break
            if len(comp) > 1:
                out.append(tuple(sorted(comp)))

    for n in sorted(graph):
        if n not in index:
            visit(n)
    return out


def measure(root) -> Shape:
    root = pathlib.Path(root)
    package = root.name
    mods = _modules(root)
    edges = collections.defaultdict(set)
    private, long_functions, long_modules, total = [], [], [], 0
    for name, path in mods.items():
        source = path.read_text()
        n = len(source.splitlines())
        total += n
        if n > LONG_MODULE:
            long_modules.append((n, name))
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom):
                target = _target(node.module, node.level, name, is_package)
                if not target.startswith(package):
                    continue
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    edges[name].add(full if full in mods else target)
                    if alias.name.startswith("_") and not alias.name.startswith("__") and full not in mods:
                        private.append((name, target, alias.name))
            elif isinstance(node, ast.Import):
                edges[name].update(a.name for a in node.names if a.name.startswith(package))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = _body_lines(node)
                if length > LONG_FUNCTION:
                    long_functions.append((length, name, node.name))
    # The top-level package's lazy facade names every verb by design; its edges are no cycle.
    graph = {k: {m for m in v if m != k and m in mods} for k, v in edges.items() if k != package}
    return Shape(total, tuple(_cycles(graph)), tuple(sorted(long_functions, reverse=True)),
                 tuple(sorted(long_modules, reverse=True)), tuple(sorted(set(private))))


def main(argv) -> int:
    args = [a for a in argv if not a.startswith("-")]
    shape = measure(args[0] if args else pathlib.Path(__file__).resolve().parent.parent / "metaseq_oneload")
    print("lines", shape.lines)
    print("cycles", len(shape.cycles))
    for c in shape.cycles:
        print("  ", " <-> ".join(c))
    print(f"functions>{LONG_FUNCTION}", len(shape.long_functions))
    for f in shape.long_functions:
        print("  ", f)
    print(f"modules>{LONG_MODULE}", len(shape.long_modules))
    for m in shape.long_modules:
        print("  ", m)
    print("private names imported across modules", len(shape.private_names))
    if "-v" in argv:
        for p in shape.private_imports:
            print("  ", p)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
