"""The runtime import graph of shardtrain/ and models/ has no cycle, and models/ imports nothing from
shardtrain/. Imports inside functions count; `if TYPE_CHECKING:` blocks do not."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("shardtrain", "models")


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of PACKAGES (a package as its __init__)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def runtime_nodes(tree: ast.AST):
    """Every node except the bodies of `if TYPE_CHECKING:` (their `else:` runs, so it counts)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            test = getattr(child, "test", None)
            guard = (getattr(test, "id", None), getattr(test, "attr", None))
            if isinstance(child, ast.If) and "TYPE_CHECKING" in guard:
                stack.extend(child.orelse)
            else:
                stack.append(child)


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` imports at run time."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & known
            out |= submodules
            if len(submodules) < len(node.names):  # a name defined in `base` itself
                out.add(base)
    return {m for m in out if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imported(name, path, set(mods)) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles found by a depth-first walk (each as a path that returns to its start)."""
    found, done, stack = [], set(), []

    def visit(m):
        if m in stack:
            found.append(stack[stack.index(m):] + [m])
            return
        if m in done:
            return
        done.add(m)
        stack.append(m)
        for target in sorted(graph[m]):
            visit(target)
        stack.pop()

    for m in sorted(graph):
        visit(m)
    return found


def test_the_walk_sees_function_level_imports_and_skips_type_checking(tmp_path):
    (tmp_path / "a.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    import b\n"
                                   "def f():\n    from c import x\n")
    assert imported("a", tmp_path / "a.py", {"a", "b", "c"}) == {"c"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_cycles():
    graph = import_graph()
    assert {"shardtrain.step", "shardtrain.cli", "models.gpt"} <= set(graph)
    assert "shardtrain.pipeline" in graph["shardtrain.step"]  # the walk does see the edges
    assert cycles(graph) == []


def test_models_import_nothing_from_shardtrain():
    graph = import_graph()
    edges = [f"{m} imports {t}" for m, targets in graph.items() if m.split(".")[0] == "models"
             for t in targets if t.split(".")[0] == "shardtrain"]
    assert edges == []


LAYERS = {  # package: (what it may import of shardtrain besides itself, by prefix; None: anything but `banned`)
    "shardtrain.config": ("shardtrain.plan.chips",),
    "shardtrain.data": ("shardtrain.config",),
}
BANNED = {  # package: the modules it must not import (by prefix)
    "shardtrain.hf": ("shardtrain.loop", "shardtrain.cli", "shardtrain.plan"),
    "shardtrain.plan": ("shardtrain.loop", "shardtrain.cli"),
    "shardtrain.checkpoint": ("shardtrain.loop", "shardtrain.cli", "shardtrain.step", "shardtrain.plan"),
}
"""config/ is the bottom layer (it reads the chip table, figures only, to check hardware.chip); data/
sits on config alone; hf/ and plan/ import nothing from the training loop; checkpoint/ nothing from
the step builder."""


def test_packages_import_downward_only():
    graph = import_graph()
    assert {"shardtrain.checkpoint.manager", "shardtrain.data.loader"} <= set(graph)
    assert "shardtrain.config" in graph["shardtrain.data.loader"]  # the walk sees package imports

    def inside(m, package):
        return m == package or m.startswith(package + ".")
    bad = [f"{m} imports {t}" for m, targets in graph.items() for t in targets if t.startswith("shardtrain")
           for package in LAYERS | BANNED if inside(m, package) and not inside(t, package)
           and (t.startswith(BANNED[package]) if package in BANNED else not t.startswith(LAYERS[package]))]
    assert bad == []
