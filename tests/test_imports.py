"""The runtime import graph of shardtrain/ and models/ has no cycle, and each package imports only what
its rule allows (`RULES`, `BANNED`). Imports inside functions count; `if TYPE_CHECKING:` blocks do not."""

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
    assert "shardtrain.parallel.pipeline" in graph["shardtrain.step"]  # the walk does see the edges
    assert cycles(graph) == []


RULES = {  # package: what it may import of shardtrain/ and models/ besides itself, by prefix
    "shardtrain.config": ("shardtrain.chips",),
    "shardtrain.data": ("shardtrain.config",),
    "shardtrain.hf": ("shardtrain.config", "shardtrain.data"),
    "shardtrain.parallel": ("shardtrain.config", "shardtrain.chips", "models"),
    "shardtrain.runtime": ("shardtrain.config", "shardtrain.chips"),
    "shardtrain.chips": (),
    "models": (),
}
BANNED = {  # package: what it must not import (by prefix); the rest of shardtrain is allowed
    "shardtrain.plan": ("shardtrain.loop", "shardtrain.cli"),
    "shardtrain.checkpoint": ("shardtrain.loop", "shardtrain.cli", "shardtrain.step", "shardtrain.plan"),
}
"""One rule per package, no exception. chips is a leaf (the chip table: figures only); config/ is the
bottom layer above it; data/ sits on config/ alone; hf/ holds the Hugging Face formats, on config/ and
data/; parallel/ (how a mesh is used) knows the config, the chips and the models; runtime/
(processes, hangs, wall time, injected faults) the config and the chips; models/ nothing of
shardtrain. plan/ never reaches the training loop, checkpoint/ never the step builder. `from
shardtrain import X` of the package root (which re-exports config) is no layer crossing."""


def inside(m: str, package: str) -> bool:
    return m == package or m.startswith(package + ".")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, targets in sorted(graph.items()):
        for package in RULES.keys() | BANNED.keys():
            if not inside(m, package):
                continue
            for t in sorted(targets):
                if inside(t, package) or (t == "shardtrain" and package != "models"):
                    continue
                if package in RULES and not any(inside(t, ok) for ok in RULES[package]):
                    bad.append(f"{m} imports {t}")
                elif package in BANNED and any(inside(t, b) for b in BANNED[package]):
                    bad.append(f"{m} imports {t}")
    return bad


def test_packages_import_downward_only():
    graph = import_graph()
    assert {"shardtrain.checkpoint.manager", "shardtrain.data.loader", "shardtrain.parallel.sharding",
            "shardtrain.runtime.distributed", "shardtrain.chips"} <= set(graph)
    assert "shardtrain.config" in graph["shardtrain.data.loader"]  # the walk sees package imports
    assert layer_violations(graph) == []


def test_each_rule_catches_an_import_past_its_floor():
    """A forbidden edge out of each package is reported (the rules are not vacuous)."""
    probes = {"shardtrain.config.validate": "models", "shardtrain.hf.io": "shardtrain.checkpoint",
              "shardtrain.parallel.mesh": "shardtrain.data", "shardtrain.runtime.health": "models",
              "shardtrain.plan.planner": "shardtrain.loop", "models.gpt": "shardtrain.config",
              "shardtrain.checkpoint.manager": "shardtrain.step", "shardtrain.chips": "shardtrain.config",
              "shardtrain.data.loader": "shardtrain.parallel.sharding"}
    for module, target in probes.items():
        assert layer_violations({module: {target}}) == [f"{module} imports {target}"]
    assert layer_violations({"shardtrain.parallel.sharding": {"models.contract", "shardtrain.config"},
                             "shardtrain.hf.tokenizer": {"shardtrain.data.storage"}}) == []
