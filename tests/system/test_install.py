"""The two installs (README, Quick start): `pip install .` is lean, and what only some runs need comes
from a named extra. The core dependencies, with everything they pull in (read from the installed
packages' metadata), hold no accelerator runtime, converter or test tool; every module of shardtrain/
and models/ imports only packages of that set, so the extras' packages are reached lazily, and a
missing one is a one-line error naming its extra. (.ci/run installs `pip install .` into a fresh
venv and trains the demo with it.)"""

import ast
import importlib.metadata
import sys
import tomllib
from pathlib import Path

import jax
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from shardtrain.config import ConfigError
from shardtrain.data import tokenize

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
HEAVY = {"libtpu", "transformers", "torch", "tensorflow", "sentencepiece", "tiktoken", "gcsfs", "pytest", "ruff"}
"""What the issue found in a 2 GB training venv: none of it is needed to train."""


def closure(requirements: list[str]) -> set[str]:
    """The distributions `requirements` install (their dependencies too, with the extras they ask for)."""
    seen, todo = set(), [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        for line in importlib.metadata.requires(req.name) or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in ("", *req.extras)):
                todo.append(sub)
    return {name for name, _ in seen}


def test_core_dependencies_are_lean_and_the_extras_are_named():
    core = closure(PROJECT["dependencies"])
    assert {"jax", "flax", "optax", "orbax-checkpoint", "tokenizers"} <= core
    assert not core & HEAVY and not [d for d in core if d.startswith(("nvidia-", "jax-cuda"))]
    extras = PROJECT["optional-dependencies"]
    assert {"tpu", "gpu", "gcs", "convert", "test", "dev"} <= set(extras)


def test_the_accelerator_extras_never_move_the_cores_jax():
    """`pip install .` then `pip install '.[tpu]'` (or `[gpu]`) keeps the jax the core chose: the extras name jax
    with no version of their own, so jax's own `tpu` / `cuda12` extra brings the libtpu / CUDA plugin made for
    the installed jax (the test extra installed both here: they match it exactly)."""
    extras = PROJECT["optional-dependencies"]
    for extra, jax_extra in (("tpu", "tpu"), ("gpu", "cuda12")):
        (req,) = map(Requirement, extras[extra])
        assert (req.name, req.extras, str(req.specifier)) == ("jax", {jax_extra}, "")
    core_jax = next(Requirement(r) for r in PROJECT["dependencies"] if Requirement(r).name == "jax")
    assert core_jax.specifier.contains(jax.__version__)
    pins = {Requirement(r).name: Requirement(r) for r in importlib.metadata.requires("jax") or []
            if Requirement(r).marker is not None and Requirement(r).marker.evaluate({"extra": "tpu"})}
    assert pins["libtpu"].specifier.contains(importlib.metadata.version("libtpu"))


def test_every_module_imports_only_what_pip_install_dot_installs():
    core = closure(PROJECT["dependencies"])
    providers = importlib.metadata.packages_distributions()
    outside = []
    for path in sorted([*ROOT.glob("shardtrain/**/*.py"), *ROOT.glob("models/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):  # imports inside functions too
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("shardtrain", "models"):
                    continue
                if not {canonicalize_name(d) for d in providers.get(top, [top])} & core:
                    outside.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert outside == []


def test_a_missing_extra_is_named(monkeypatch):
    """The converters (the gcs and tpu extras: tests/checkpoint/test_manager.py, tests/plan/test_topology.py)."""
    for name in ("transformers", "transformers.convert_slow_tokenizer"):  # as if not installed (another
        monkeypatch.setitem(sys.modules, name, None)  # test may have imported the submodule already)
    with pytest.raises(ConfigError, match=r"pip install 'shardtrain\[convert\]'"):
        tokenize._converters()
