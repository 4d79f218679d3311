"""The memo of the large configs' fit check (tests/plan/test_plan_tpu.py): a TPU or XLA:GPU compile
takes minutes on CI's 2 cores, and the same program, compilers, flags and planner give the same
figures, so they are recorded in tests/golden/compiled_fits.json under a hash of all of those."""

import ast
import hashlib
import importlib.metadata
import json
import os
import re
from pathlib import Path

from shardtrain import chips, step
from shardtrain.plan import planner

COMPILED_FITS = Path(__file__).parents[1] / "golden" / "compiled_fits.json"
COMPILED_TARGETS = COMPILED_FITS.with_name("compiled_targets.json")
"""The whole configs whose targets a test checks (their figures at full depth)."""


def code(path: Path) -> str:
    """A module's code without its comments and docstrings (editing those keeps the memo)."""
    def text(stmt):
        return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(getattr(node, "body", None), list):
            node.body = [s for s in node.body if not text(s)] or [ast.Pass()]
    return ast.dump(tree)


def compiled_figures(path: str, prog: step.Program, chip: chips.Chip, memo: Path = COMPILED_FITS) -> dict:
    """The compiled program's memory per chip, MFU, fit and compiled FLOPs over the model's, memoized
    in tests/golden/compiled_fits.json under the sha256 of its lowered text, the compilers' versions,
    the XLA / libtpu flags and the planner's own code (shardtrain/plan, which reads the figures off
    the compiled program, and shardtrain/chips.py, the chip table it divides by; their code, not
    their comments; plan/search.py, plan/tune.py and plan/analytic.py, which pick configs, are left
    out): the same key gives the same figures, so only a config whose program or planner changed pays
    the compile (minutes on CI's 2 cores); UPDATE_GOLDEN=1 (with -n0) records what it compiled."""
    lowered = prog.lower()
    key = memo_key(lowered.as_text())
    records = json.loads(memo.read_text()) if memo.exists() else {}
    if records.get(path, {}).get("key") == key:
        return records[path]
    r = planner.report(prog, planner.compile_fast(lowered, prog.mesh.devices.flat[0].platform), chip, 0.0)
    figures = {"key": key, "compiler": r["compiler"], "total": r["memory_per_device_bytes"]["total"],
               "mfu": r["estimate"]["mfu"], "fits": r["fits"],
               "flops_ratio": r["flops_per_device"] * r["devices"] / r["model_flops_per_step"]}
    if os.environ.get("UPDATE_GOLDEN") == "1":
        memo.write_text(json.dumps({**records, path: figures}, indent=1, sort_keys=True) + "\n")
    return figures


def memo_key(lowered_text: str) -> str:
    """The hash of what decides a compiled program's figures: the lowered program, the compilers' versions,
    their flags and the planner's code."""
    versions = [f"{m}={importlib.metadata.version(m)}" for m in ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin")]
    flags = [os.environ.get(v, "") for v in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")]
    # left out: the Python object id that names custom_partitioning's callback (cuDNN attention), and
    # Pallas kernels' bodies and debug locations (Mosaic bytecode with the kernel's source paths, which
    # differ between checkouts; what a kernel reads and writes in HBM, its operands and results, stays)
    text = re.sub(r'(@CustomSPMDPartitioning\(.*?backend_config = )"\d+"', r'\1"callback"', lowered_text)
    text = re.sub(r'\\22body\\22: \\22[A-Za-z0-9+/=]*\\22', "pallas-body", text)
    text = re.sub(r'\\22debug_locations\\22: \\22[A-Za-z0-9+/=]*\\22', "pallas-locations", text)  # source paths
    # Mosaic GPU kernels (the MoE's grouped GEMM) embed their module, with its source paths, and its hash
    text = re.sub(r'(kernel_hash|module) = "(?:[^"\\]|\\.)*"', r'\1 = "mosaic-gpu"', text)
    plan_dir = Path(planner.__file__).parent  # the code that reads figures off a compiled program (not the search's)
    readers = [plan_dir / "planner.py", plan_dir / "topology.py", *sorted((plan_dir / "hlo").glob("*.py")),
               Path(chips.__file__)]
    reader = [code(p) for p in readers]
    return hashlib.sha256("\n".join([*versions, *flags, *reader, text]).encode()).hexdigest()[:16]
