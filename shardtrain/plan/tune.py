"""`shardtrain plan --search` tunes: after ranking the meshes (search.py), it searches the knobs that
trade memory for speed on the best of them: the remat policy, the optimizer state in host memory
(train.offload.optimizer) and gradient accumulation, and prints the fastest config that fits.

Every candidate would take a compile (minutes for a large model), so an analytical model orders and
prunes them first, calibrated on the mesh's compiled program (its FLOPs, memory and times at the
config's own knobs):
  - FLOPs: a policy recomputes, per layer and token, the forward FLOPs of what it does not save
    (`analytic.RECOMPUTED`: attention, its output projection, the MLP, the q/k/v projections);
  - memory: a policy keeps per layer and token the outputs it saves (`analytic.SAVED`), divided over the
    micro-batches of grad accumulation, which adds a parameter-sized sum of the gradients; offload takes
    the optimizer state off the device;
  - time: max(compute, the mesh's memory time) + its communication + the host link (offload).
A candidate whose predicted memory exceeds the limit is not compiled, nor one whose predicted step
is no faster than the fastest compiled candidate that fits (branch and bound). The rest compile in
order of predicted step, `workers` at a time, until the compile budget is spent. The order is
fixed (predicted step, then the knobs' order), so a search is reproducible.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from tqdm import tqdm

from shardtrain import chips as chips_lib, step as step_lib
from shardtrain.config import ConfigError, RunConfig, validate
from shardtrain.parallel import mesh as mesh_lib
from shardtrain.plan import analytic, planner, search

REMAT_LADDER = ("none", "minimal", "save_dot_except_mlp", "save_qkv_proj", "full")
"""The remat policies tried, from the one that saves most (fewest FLOPs, most memory) to full."""
ACCUM_STEPS = (1, 2, 4)
MESHES_TUNED = 2
"""The best meshes of the ranking whose knobs are searched."""
DEFAULT_BUDGET = 12


@dataclasses.dataclass(frozen=True, order=True)
class Knobs:
    remat: str
    offload: bool
    accum: int

    def label(self) -> str:
        return f"remat {self.remat}, offload {'optimizer' if self.offload else 'none'}, accum {self.accum}"


def knobs_of(cfg: RunConfig) -> Knobs:
    return Knobs(cfg.train.remat, cfg.train.offload.optimizer, cfg.train.grad_accum_steps)


def with_knobs(cfg: RunConfig, knobs: Knobs) -> RunConfig:
    """cfg with the remat policy, optimizer offload and accumulation of `knobs` (validated)."""
    t = cfg.train
    train = dataclasses.replace(t, remat=knobs.remat, grad_accum_steps=knobs.accum,
                                offload=dataclasses.replace(t.offload, optimizer=knobs.offload))
    new = dataclasses.replace(cfg, train=train)
    validate(new)
    return new


@dataclasses.dataclass
class Candidate:
    row: dict
    """The ranked mesh row it tunes (search.Row.as_dict())."""
    knobs: Knobs
    predicted_step_s: float
    predicted_bytes: float
    status: str = "queued"
    """queued | compiled | pruned: <why> | not built: <why> | over budget"""
    report: dict | None = None

    def as_dict(self) -> dict:
        r = self.report
        return {"mesh": self.row["mesh"], "dcn": self.row["dcn"], "microbatches": self.row["microbatches"],
                "schedule": self.row.get("schedule"),
                **dataclasses.asdict(self.knobs), "predicted_step_s": self.predicted_step_s,
                "predicted_bytes": self.predicted_bytes, "status": self.status,
                "fits": None if r is None else r["fits"],
                "step_time_s": None if r is None else r["estimate"]["step_time_s"],
                "memory_bytes": None if r is None else r["memory_per_device_bytes"]["total"],
                "margin_bytes": None if r is None else r["margin_bytes"]}


def predict(cfg: RunConfig, base: dict, knobs: Knobs, chip: chips_lib.Chip) -> tuple[float, float]:
    """(step seconds, device bytes) of `knobs` on the mesh whose compiled report at cfg's knobs is `base`
    (the module docstring says how)."""
    mesh, n = base["mesh"], base["devices"]
    chip_dev = planner.per_device(chip, n)
    flops, saved = analytic.per_token_layer(cfg, mesh["tensor"])
    tokens = cfg.train.global_batch_size * cfg.data.seq_len  # per step
    batch_ways = mesh["data"] * mesh["fsdp"] * mesh["context"] * mesh.get("expert", 1)
    layers_here = cfg.model.n_layers / mesh["pipeline"]
    dtype_bytes = 2 if cfg.train.compute_dtype == "bfloat16" else 4
    own = knobs_of(cfg)

    def recompute(k: Knobs) -> float:
        return layers_here * tokens / batch_ways * sum(flops[p] for p in analytic.RECOMPUTED[k.remat])

    def activations(k: Knobs) -> float:
        saved_elements = sum(saved[p] for p in analytic.SAVED[k.remat])
        return layers_here * tokens / batch_ways / k.accum * saved_elements * dtype_bytes

    m = base["memory_per_device_bytes"]
    opt_b = base["host_memory_per_device_bytes"]["optimizer"] if own.offload else m["optimizer"]
    moved = (opt_b if own.offload else 0) - (opt_b if knobs.offload else 0)  # onto the device (+) or off it (-)
    params_b = m["params"] + base["host_memory_per_device_bytes"].get("params", 0)
    accumulator = params_b * ((knobs.accum > 1) - (own.accum > 1))  # the gradients' sum over micro-batches
    device_b = m["total"] - activations(own) + activations(knobs) + moved + accumulator
    flops_dev = max(base["flops_per_device"] + recompute(knobs) - recompute(own), base["model_flops_per_step"] / n)
    e = base["estimate"]
    host_s = 2 * opt_b / chip_dev.host_bandwidth if knobs.offload else 0.0
    step_s = max(flops_dev / chip_dev.peak_flops, e["memory_s"]) + e["comm_s"] + host_s
    return step_s, device_b


def candidates(cfg: RunConfig, rows: list[dict], chip: chips_lib.Chip) -> list[Candidate]:
    """Every knob setting of the best MESHES_TUNED compiled meshes, in predicted order."""
    out = []
    for row in [r for r in rows if r["report"]][:MESHES_TUNED]:
        mesh_cfg = search.config_of(cfg, row)
        rows_per_micro = row["mesh"]["data"] * row["mesh"]["fsdp"] * (row["dcn"] or {}).get("data", 1) * (
            row["dcn"] or {}).get("fsdp", 1)
        for remat in REMAT_LADDER:
            for offload in (False, True):
                for accum in ACCUM_STEPS:
                    batch = cfg.train.global_batch_size
                    if batch % accum or (batch // accum) % rows_per_micro:
                        continue
                    knobs = Knobs(remat, offload, accum)
                    step_s, device_b = predict(mesh_cfg, row["report"], knobs, chip)
                    if knobs == knobs_of(cfg):  # the ranking compiled it already
                        out.append(Candidate(row, knobs, step_s, device_b, "compiled", row["report"]))
                    else:
                        out.append(Candidate(row, knobs, step_s, device_b))
    return sorted(out, key=lambda c: (c.predicted_step_s, REMAT_LADDER.index(c.knobs.remat), c.knobs))


def tune(cfg: RunConfig, ranked: dict, devices: list, chip: chips_lib.Chip, budget: int = DEFAULT_BUDGET,
         workers: int | None = None) -> dict:
    """Branch and bound over `candidates` of the ranked meshes: compiles the most promising first,
    never one predicted not to fit or no faster than the best fitting one compiled, at most `budget`.
    Returns {'candidates': [...], 'best': index into them or None, 'compiles': n, 'budget': budget}."""
    limit = ranked["memory_limit_bytes"]
    todo = candidates(cfg, ranked["rows"], chip)
    fitting = [c for c in todo if c.report and c.report["fits"]]
    best = min(fitting, key=lambda c: c.report["estimate"]["step_time_s"], default=None)
    compiles = 0
    bar = tqdm(total=min(budget, len(todo)), desc="tuning (compile budget)", unit="compile", file=sys.stderr)
    while True:
        for c in todo:
            if c.status != "queued":
                continue
            if c.predicted_bytes > limit:
                c.status = f"pruned: predicted {planner.gib(c.predicted_bytes)} > {planner.gib(limit)}"
            elif best is not None and c.predicted_step_s >= best.report["estimate"]["step_time_s"]:
                c.status = "pruned: predicted step no faster than the best compiled"
        batch = [c for c in todo if c.status == "queued"][:min(workers or 2, budget - compiles)]
        if not batch:
            break
        jobs = []
        for c in batch:
            try:
                c_cfg = with_knobs(search.config_of(cfg, c.row), c.knobs)
                prog = step_lib.build(c_cfg, mesh_lib.make_mesh(c_cfg.mesh, devices))
            except ConfigError as e:
                c.status = f"not built: {e}"
                continue
            row = search.Row(c.row["mesh"], c.row["microbatches"], "ranked", dcn=c.row["dcn"],
                             schedule=c.row.get("schedule"))
            jobs.append((row, prog, c))
        search.compile_all([(row, prog) for row, prog, _ in jobs], devices[0].platform, chip, workers, quiet=True)
        for row, _, c in jobs:
            compiles += 1
            c.status, c.report = ("compiled", row.report) if row.report else (row.status, None)
            if c.report and c.report["fits"] and (
                    best is None or c.report["estimate"]["step_time_s"] < best.report["estimate"]["step_time_s"]):
                best = c
            bar.update()
            bar.set_postfix_str("best " + ("none yet" if best is None else
                                          f"{best.report['estimate']['step_time_s'] * 1e3:.2f} ms"))
    bar.close()
    for c in todo:
        if c.status == "queued":
            c.status = "over budget"
    return {"candidates": [c.as_dict() for c in todo], "best": None if best is None else todo.index(best),
            "compiles": compiles, "budget": budget}


def best_config(cfg: RunConfig, ranked: dict, tuned: dict) -> tuple[RunConfig, dict]:
    """The fastest fitting config of the search: the best tuned candidate, else the top ranked mesh."""
    if tuned["best"] is not None:
        c = tuned["candidates"][tuned["best"]]
        knobs = Knobs(c["remat"], c["offload"], c["accum"])
        return with_knobs(search.config_of(cfg, c), knobs), c
    row = next((r for r in ranked["rows"] if r["report"] and r["report"]["fits"]), None)
    if row is None:
        raise ConfigError(f"no mesh and no remat / offload / accumulation setting of {cfg.model.name} fits "
                          f"{planner.gib(ranked['memory_limit_bytes'])} per device ({ranked['chip']})")
    r = row["report"]
    return search.config_of(cfg, row), {
        "mesh": row["mesh"], "dcn": row["dcn"], **dataclasses.asdict(knobs_of(cfg)),
        "step_time_s": r["estimate"]["step_time_s"], "memory_bytes": r["memory_per_device_bytes"]["total"],
        "margin_bytes": r["margin_bytes"]}


def format_tuning(tuned: dict, best: dict) -> str:
    lines = [f"tuning: {tuned['compiles']} of {len(tuned['candidates'])} candidates compiled "
             f"(budget {tuned['budget']})",
             f"{'#':>3}  {'mesh':<18}{'remat':<21}{'offload':<9}{'accum':>6}{'predicted':>12}{'step':>12}"
             f"{'mem/device':>14}  status"]
    for i, c in enumerate(tuned["candidates"], 1):
        step = f"{c['step_time_s'] * 1e3:.2f}ms" if c["step_time_s"] is not None else "-"
        mem = (planner.gib(c["memory_bytes"]) if c["memory_bytes"] is not None
               else f"~{planner.gib(c['predicted_bytes'])}")
        status = c["status"] + ("" if c["fits"] is None else ", fits" if c["fits"] else ", does not fit")
        lines.append(f"{i:>3}  {search.label_of(c):<18}{c['remat']:<21}{'opt' if c['offload'] else '-':<9}"
                     f"{c['accum']:>6}{c['predicted_step_s'] * 1e3:>10.2f}ms{step:>12}{mem:>14}  {status}")
    margin = best["margin_bytes"]
    lines.append(f"fastest that fits: mesh {search.label_of(best)}, "
                 f"{Knobs(best['remat'], best['offload'], best['accum']).label()}: step "
                 f"{best['step_time_s'] * 1e3:.2f} ms, {planner.gib(best['memory_bytes'])} per device, margin "
                 f"{planner.gib(margin)}")
    return "\n".join(lines)


def main(cfg: RunConfig, devices: list, chip: chips_lib.Chip, as_json: bool = False, write: str | None = None,
         budget: int = DEFAULT_BUDGET, meshes: int = search.MESHES_COMPILED) -> int:
    """`shardtrain plan --search`: ranks the meshes, tunes the best ones' knobs, prints both and the
    fastest config that fits; `write`: that config as a YAML to run."""
    ranked = search.search(cfg, devices, chip, require_fit=False, meshes=meshes)
    tuned = tune(cfg, ranked, devices, chip, budget)
    best_cfg, best = best_config(cfg, ranked, tuned)
    if as_json:
        print(json.dumps({**ranked, "tuning": tuned, "chosen": best}, indent=1, default=float))
    else:
        print(search.format_table(ranked) + "\n\n" + format_tuning(tuned, best))
    if write:
        knobs = Knobs(best["remat"], best["offload"], best["accum"])
        search.write_config(best_cfg, write, f"{ranked['devices']} devices, {ranked['chip']}: estimated "
                                             f"{best['step_time_s'] * 1e3:.2f} ms/step, {knobs.label()}")
        print(f"wrote {write}", file=sys.stderr)
    return 0
