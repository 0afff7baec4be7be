"""Measure #22's targets: import cycles, long functions, long modules, private names imported across modules."""
import ast, sys, pathlib, collections
root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "metaseq_oneload")
pkg = root.name
mods = {}
for p in root.rglob("*.py"):
    rel = p.relative_to(root.parent).with_suffix("")
    name = ".".join(rel.parts)
    if name.endswith(".__init__"): name = name[:-9]
    mods[name] = p
def resolve(mod, level, cur, is_pkg):
    if level == 0: return mod
    base = cur.split(".")
    if not is_pkg: base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([mod] if mod else []))
edges = collections.defaultdict(set); priv = []; longf = []; longm = []
for name, p in mods.items():
    src = p.read_text(); tree = ast.parse(src)
    n = len(src.splitlines())
    if n > 800: longm.append((n, name))
    is_pkg = p.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            tgt = resolve(node.module, node.level, name, is_pkg)
            if not tgt.startswith(pkg): continue
            for a in node.names:
                full = tgt + "." + a.name
                if full in mods: edges[name].add(full)
                else: edges[name].add(tgt)
                if a.name.startswith("_") and full not in mods and not a.name.startswith("__"):
                    priv.append((name, tgt, a.name))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(pkg): edges[name].add(a.name)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            start = body[0].lineno
            if isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
                start = body[1].lineno if len(body) > 1 else node.end_lineno
            ln = node.end_lineno - start + 1
            if ln > 80: longf.append((ln, name, node.name))
# cycles among modules (ignore package __init__ edges to submodules)
def sccs(g):
    idx = {}; low = {}; st = []; on = set(); out = []; c = [0]
    sys.setrecursionlimit(10000)
    def v(n):
        idx[n] = low[n] = c[0]; c[0] += 1; st.append(n); on.add(n)
        for m in g.get(n, ()):
            if m not in mods: continue
            if m not in idx: v(m); low[n] = min(low[n], low[m])
            elif m in on: low[n] = min(low[n], idx[m])
        if low[n] == idx[n]:
            comp = []
            while True:
                m = st.pop(); on.discard(m); comp.append(m)
                if m == n: break
            if len(comp) > 1: out.append(sorted(comp))
    for n in mods:
        if n not in idx: v(n)
    return out
g = {k: {m for m in vs if m != k} for k, vs in edges.items()}
# drop edges from a package __init__ (lazy facades) 
g[pkg] = set()  # the package's lazy facade imports every verb by design
cyc = sccs(g)
print("lines", sum(len(p.read_text().splitlines()) for p in mods.values()))
print("cycles", len(cyc)); [print("  ", c) for c in cyc]
print("functions>80", len(longf)); [print("  ", x) for x in sorted(longf, reverse=True)]
print("modules>800", len(longm)); [print("  ", x) for x in sorted(longm, reverse=True)]
names = sorted({(t, a) for _, t, a in priv})
print("private names imported across modules", len(names))
if "-v" in sys.argv: [print("  ", x) for x in sorted(priv)]
