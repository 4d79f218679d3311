"""shardtrain against MaxText on the same TPU compiler: the same model, mesh and batch compiled by both
(libtpu, compile-only), both optimized HLOs read by `shardtrain.plan.hlo` and costed by one roofline
(`planner.estimate` for v5p). Not in CI: it needs the MaxText peer venv (../shared/tools/maxtext-peer).

    .venv/bin/python bench/vs_maxtext.py                              # every row (about an hour here)
    .venv/bin/python bench/vs_maxtext.py --rows llama3-8b-2048 --out /tmp/vs
    .venv/bin/python bench/vs_maxtext.py --rows llama3-8b-2048 --maxtext-flags remat_policy=minimal \
        --ours /tmp/vs/llama3-8b-2048-shardtrain.json             # another MaxText setting beside a plan already made

Per row it prints memory, FLOPs, HBM bytes, collective traffic by kind, the roofline step time of both
and their ratio, and the compile time of each, measured one after the other. Results: bench/README.md;
every run appends its rows' figures to bench/results/vs_maxtext.jsonl.
"""

import harness  # isort: split

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax is imported

from shardtrain import chips  # noqa: E402
from shardtrain.plan import hlo, planner  # noqa: E402

ROOT = str(harness.ROOT)
GIB = 2 ** 30
TOOLS = os.path.join(ROOT, "..", "shared", "tools")


@dataclass(frozen=True)
class Row:
    config: str
    overrides: tuple[str, ...]
    maxtext: tuple[str, ...]
    """MaxText `train_compile` flags for the same model, topology, batch and mesh."""


ROWS = {
    "llama3-8b-2048": Row("meshes/llama3_8b_v5p_128.yaml", ("data.seq_len=2048",), (
        "model_name=llama3-8b", "compile_topology=v5p-256", "per_device_batch_size=4", "max_target_length=2048")),
    "llama3-8b-8192": Row("meshes/llama3_8b_v5p_128.yaml", ("data.seq_len=8192",), (
        "model_name=llama3-8b", "compile_topology=v5p-256", "per_device_batch_size=4", "max_target_length=8192")),
    "llama3-70b-2048": Row("meshes/llama3_70b_v5p_512.yaml", ("data.seq_len=2048",), (
        "model_name=llama3-70b", "compile_topology=v5p-1024", "per_device_batch_size=4", "max_target_length=2048")),
    "mixtral-8x7b-4096": Row("meshes/mixtral_8x7b_v5p_128.yaml", (), (
        "model_name=mixtral-8x7b", "compile_topology=v5p-256", "per_device_batch_size=2", "max_target_length=4096",
        "ici_expert_parallelism=8", "ici_fsdp_parallelism=16")),
    "deepseek-v2-lite-4096": Row("meshes/deepseek_v2_lite_v5p_64.yaml", (), (
        "model_name=deepseek2-16b", "compile_topology=v5p-64", "per_device_batch_size=8", "max_target_length=4096",
        "ici_expert_parallelism=8", "ici_fsdp_parallelism=4")),
}


def run_maxtext(row: Row, out: str, extra: tuple[str, ...] = ()) -> dict:
    """MaxText's compiled step (the row's flags, then `extra`): its memory, its cost, its HLO text and the
    command's wall time."""
    import jax  # the peer on our own interpreter and jax, so that one libtpu compiles both programs
    same = {"MAXTEXT_PYTHON": sys._base_executable, "MAXTEXT_JAX": jax.__version__}
    python = subprocess.run([os.path.join(TOOLS, "maxtext-peer")], capture_output=True, text=True, check=True,
                            env={**os.environ, **same})
    python = python.stdout.strip().splitlines()[-1]
    site = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    args = [python, os.path.join(TOOLS, "maxtext_compile_dump.py"), out, f"{site}/maxtext/configs/base.yml",
            *row.maxtext, *extra, "compile_topology_num_slices=1", "run_name=vs", f"base_output_directory={out}-out",
            "skip_jax_distributed_system=true",
            f"jax_cache_dir={tempfile.mkdtemp(prefix='maxtext-cache-')}"]  # a cold compile, as plan's always is
    t0 = time.time()
    with open(out + ".log", "w") as log:
        subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, check=True, cwd=os.path.dirname(out),
                       env={**os.environ, "TPU_SKIP_MDS_QUERY": "1"})
    result = json.load(open(out + ".json"))
    result["wall_s"] = time.time() - t0
    result["text"] = open(out + ".hlo.txt").read()
    return result


def read_maxtext(out: str) -> dict:
    """What `run_maxtext` wrote to `out` before."""
    return {**json.load(open(out + ".json")), "wall_s": float("nan"), "text": open(out + ".hlo.txt").read()}


def run_shardtrain(row: Row, out: str) -> dict:
    """`shardtrain plan --json` of the row's config and the command's wall time."""
    t0 = time.time()
    proc = subprocess.run([os.path.join(ROOT, ".venv", "bin", "shardtrain"), "plan", row.config, *row.overrides,
                           "--json"], capture_output=True, text=True, check=True, cwd=ROOT)
    report = json.loads(proc.stdout)
    report["wall_s"] = time.time() - t0
    json.dump(report, open(out + ".json", "w"), indent=1)
    return report


def measure_maxtext(mt: dict, ours: dict) -> dict:
    """MaxText's program read and costed as `plan` reads and costs ours."""
    module = hlo.parse_module(mt["text"])
    loop_flops, loop_bytes = hlo.loop_repeats_cost(module)
    n = ours["devices"]
    colls = hlo.collectives(module, {"fsdp": n})
    flops = mt["flops"] + loop_flops
    chip = chips.CHIPS[ours["chip"]]
    est = planner.estimate(flops, mt["bytes accessed"] + loop_bytes, colls, chip, set(),
                           ours["model_flops_per_step"], n, hlo.matmul_flops_by_dtype(module), hlo.loop_bodies(module))
    return {"memory": mt["arguments"] + mt["temp"] + mt["outputs"] - mt["aliased"], "flops": flops,
            "bytes": mt["bytes accessed"] + loop_bytes, "collectives": hlo.summarize(colls),
            "traffic": sum(c.traffic_bytes * c.count for c in colls), "step": est["step_time_s"],
            "overlapped": est["step_time_overlapped_s"], "compile": mt["compile_s"], "wall": mt["wall_s"]}


def measure_ours(r: dict) -> dict:
    return {"memory": r["memory_per_device_bytes"]["total"], "flops": r["flops_per_device"],
            "bytes": r["bytes_accessed_per_device"], "collectives": r["collectives"],
            "traffic": r["comm_traffic_bytes_per_device"], "step": r["estimate"]["step_time_s"],
            "overlapped": r["estimate"]["step_time_overlapped_s"], "compile": r["compile_s"], "wall": r["wall_s"]}


def kinds(c: dict) -> str:
    return ", ".join(f"{k} {v['count']} x {v['traffic_bytes'] / GIB:.1f} GiB" for k, v in c.items())


def table(name: str, ours: dict, mt: dict) -> str:
    """One row's comparison as a markdown table, ratios ours / MaxText's."""
    lines = [f"### {name}", "", "| per chip, per step | shardtrain | MaxText | ratio |", "|---|---|---|---|"]
    for label, key, unit, scale in [("memory (arguments + temporaries)", "memory", "GiB", GIB),
                                    ("FLOPs (loop trips counted)", "flops", "e12", 1e12),
                                    ("HBM bytes accessed", "bytes", "GiB", GIB),
                                    ("collective traffic", "traffic", "GiB", GIB),
                                    ("roofline step (serial)", "step", "s", 1),
                                    ("roofline step (loop collectives overlapped)", "overlapped", "s", 1),
                                    ("compile (lower + compile)", "compile", "s", 1),
                                    ("whole command, wall", "wall", "s", 1)]:
        a, b = ours[key] / scale, mt[key] / scale
        lines.append(f"| {label} | {a:.4g} {unit} | {b:.4g} {unit} | {ours[key] / b / scale:.3f} |")
    lines.append(f"| collectives | {kinds(ours['collectives'])} | {kinds(mt['collectives'])} | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=list(ROWS))
    parser.add_argument("--out", default="/tmp/vs_maxtext", help="directory for both programs' HLO and reports")
    parser.add_argument("--reuse-maxtext", action="store_true", help="read MaxText's programs already in --out")
    parser.add_argument("--maxtext-flags", nargs="+", default=[], metavar="KEY=VALUE",
                        help="more MaxText flags for every row (remat_policy=minimal); they name its files in --out")
    parser.add_argument("--ours", help="a `shardtrain plan --json` report to compare with, not planned again (one row)")
    args = parser.parse_args()
    if args.ours and len(args.rows) != 1:
        parser.error("--ours takes one row")
    extra = tuple(args.maxtext_flags)
    os.makedirs(args.out, exist_ok=True)
    summary = {}
    for name in args.rows:
        row = ROWS[name]
        print(f"{name}: MaxText train_compile ...", file=sys.stderr, flush=True)
        label = "".join(f"-{flag.replace('=', '-')}" for flag in extra)
        out = os.path.join(os.path.abspath(args.out), f"{name}-maxtext{label}")
        mt = read_maxtext(out) if args.reuse_maxtext else run_maxtext(row, out, extra)
        if args.ours:
            report = {**json.load(open(args.ours)), "wall_s": float("nan")}
        else:
            print(f"{name}: shardtrain plan ...", file=sys.stderr, flush=True)
            report = run_shardtrain(row, os.path.join(args.out, f"{name}-shardtrain"))
        ours, theirs = measure_ours(report), measure_maxtext(mt, report)
        summary[name] = {"shardtrain": ours, "maxtext": theirs, "maxtext_flags": list(extra)}
        print(table(name + label, ours, theirs) + "\n", flush=True)
    json.dump(summary, open(os.path.join(args.out, "summary.json"), "w"), indent=1)
    harness.record("vs_maxtext", summary, rows=args.rows, reuse_maxtext=args.reuse_maxtext, out=args.out,
                   maxtext_flags=list(extra), ours=args.ours)


if __name__ == "__main__":
    main()
