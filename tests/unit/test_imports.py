"""No import cycles between meshlm's modules. Every import counts, also those inside functions (they hide
cycles: a module that imports another only when called still depends on it)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def _modules() -> dict[str, Path]:
    mods = {}
    for f in (SRC / "meshlm").rglob("*.py"):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _imports(name: str, path: Path, mods: dict) -> set[str]:
    """The meshlm modules `name` imports anywhere in its file (a package import counts as its __init__)."""
    out = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):  # a module importing its own package is fine
                out.add(t)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle as a path [a, b, ..., a], or [] when the graph has none (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str]:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w) :] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        path.pop()
        return []

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return []


def test_the_walker_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_in_meshlm():
    mods = _modules()
    assert "meshlm.cli" in mods and "meshlm.parallel.apply" in mods
    graph = {m: _imports(m, f, mods) for m, f in mods.items()}
    assert "meshlm.layout" in graph["meshlm.train.trainer"]  # imports are seen (also inside functions)
    assert not (cycle := _cycle(graph)), " -> ".join(cycle)


def test_training_does_not_import_the_planner():
    """Nothing a training rank runs names the planner: the rank entry (cli, cli/train.py), the
    options and train/. tests/test_training_path.py checks what real ranks hold in sys.modules."""
    mods = _modules()
    entry = ["meshlm.cli", "meshlm.cli.train", "meshlm.options"]
    train = entry + [m for m in mods if m.startswith("meshlm.train.")]
    assert not [(m, t) for m in train for t in _imports(m, mods[m], mods) if t.startswith("meshlm.plan")]
    assert not [t for t in _imports("meshlm.cli", mods["meshlm.cli"], mods) if t.startswith("meshlm.cli.")]


def _meshlm_names(tree: ast.Module) -> set[str]:
    """Names a module binds to meshlm's modules or their members (import meshlm.x as y, from meshlm.x import y)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "meshlm"}
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "meshlm"):
            names |= {a.asname or a.name for a in node.names}
    return names


def replaced_attributes(source: str) -> list[str]:
    """Assignments (and setattr calls) that replace an attribute of a meshlm module or of what it defines."""
    tree = ast.parse(source)
    mine, found = _meshlm_names(tree), []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        targets += [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in (x for target in targets for x in ast.walk(target)):
            if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store):
                base = t.value
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(base, ast.Name) and base.id in mine:
                    found.append(ast.unparse(t))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in mine:
                found.append(ast.unparse(node))
    return found


def test_the_checker_sees_replaced_attributes():
    patched = (
        "from meshlm.parallel import apply\nimport meshlm.models.materialize as m\nfrom meshlm import layout\n"
        "apply.materialize = None\nm.local_index, x = None, 1\nsetattr(layout, 'resolve', None)\n"
        "layout.Layout.engine = None\nlocal = apply\n"
    )
    want = ["apply.materialize", "m.local_index", "layout.Layout.engine", "setattr(layout, 'resolve', None)"]
    assert sorted(replaced_attributes(patched)) == sorted(want)


def test_no_module_replaces_a_meshlm_attribute_at_run_time():
    """The planner plugs into training through parallelize's arguments (fill, ddp), not by patching it."""
    found = {
        str(f.relative_to(SRC)): hits
        for f in sorted((SRC / "meshlm").rglob("*.py"))
        if (hits := replaced_attributes(f.read_text()))
    }
    assert not found, found


def test_inference_does_not_import_training():
    mods = _modules()
    infer = [m for m in mods if m.startswith("meshlm.infer")]
    assert infer and not [(m, t) for m in infer for t in _imports(m, mods[m], mods) if t.startswith("meshlm.train")]


def private_imports(source: str) -> list[str]:
    """Underscore names a module takes from another meshlm module (`from meshlm.x import _y`, `x._y` on an
    imported meshlm name): what one module uses of another is public, so it can be found and kept."""
    tree = ast.parse(source)
    mine, found = _meshlm_names(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "meshlm"):
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if isinstance(node.value, ast.Name) and node.value.id in mine:
                found.append(ast.unparse(node))
    return found


def test_the_checker_sees_private_imports():
    source = (
        "from meshlm.models.stages import _balanced, split\nfrom meshlm.plan import advisor\n"
        "advisor._startup_shard(1)\nadvisor.__name__\nx = object()\nx._private\n"
    )
    assert private_imports(source) == ["meshlm.models.stages._balanced", "advisor._startup_shard"]


def test_no_module_uses_another_modules_private_names():
    found = {
        str(f.relative_to(SRC)): hits
        for f in sorted((SRC / "meshlm").rglob("*.py"))
        if (hits := private_imports(f.read_text()))
    }
    assert not found, found


def test_one_meaning_per_name():
    """The names that once had two or three meanings are defined once: `layout` is layout.Layout (the
    planner's estimates hold a `candidate`), `resolve` and its checks live in layout.py, `Batch` is training's."""
    defined: dict[str, list[str]] = {}
    for f in sorted((SRC / "meshlm").rglob("*.py")):
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.setdefault(node.name, []).append(str(f.relative_to(SRC)))
    once = {"Layout": 1, "resolve": 1, "_check_model": 1, "_check_options": 1, "Batch": 1, "layout": 0}
    assert {name: len(defined.get(name, [])) for name in once} == once, {n: defined.get(n) for n in once}
    from meshlm.plan.advisor import Estimate

    assert "layout" not in Estimate.__dataclass_fields__ and "candidate" in Estimate.__dataclass_fields__


def test_benchmarks_import_one_way():
    """benchmarks/ scripts import each other by file name (gpu_check runs gpu_check_rows, both use gpu_check_jobs):
    no cycle."""
    scripts = {f.stem: f for f in (SRC.parent / "benchmarks").glob("*.py")}
    graph = {}
    for name, f in scripts.items():
        tree = ast.parse(f.read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        graph[name] = (imported & scripts.keys()) - {name}
    assert "gpu_check_jobs" in graph["gpu_check_rows"] and "gpu_check_rows" in graph["gpu_check"]  # the walker works
    assert not (cycle := _cycle(graph)), " -> ".join(cycle)
