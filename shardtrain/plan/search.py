"""`shardtrain plan --search`: every data x pipeline x fsdp x tensor mesh of N devices (and for
pipelines, micro-batch counts and schedules), ranked by the planner's estimated step time. The `expert` axis
joins them for an MoE model (sizes dividing model.moe.n_experts), `context` for sequences long enough
to split (each device keeps 2 chunks of at least CONTEXT_MIN_CHUNK tokens). Across slices (a TPU
multi-slice topology, or a config whose mesh.dcn joins hosts) every split of the slices over data,
pipeline and fsdp is searched, each with every mesh of one slice's devices.

A mesh is valid when `step.build` accepts it: the sharding rules' divisibility errors
(`sharding.spec_for`) and the pipeline's own checks are the filter. Valid meshes whose parameters
and optimizer state alone (exact, from the abstract state's shard shapes) exceed the chip's memory
are pruned without compiling. The rest are ordered by the analytical model (analytic.py): those it
predicts to fit with room (`analytic.FITS_WITH_ROOM`) first, then those it predicts to fit, each group
by its predicted step; the first `meshes` are compiled in a thread
pool (XLA compiles outside the GIL) with a progress bar; the others are listed with their predicted
step, not compiled.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import yaml
from tqdm import tqdm

from shardtrain import chips as chips_lib, step as step_lib
from shardtrain.config import MESH_AXES, ConfigError, DcnConfig, MeshConfig, RunConfig, dump, validate
from shardtrain.parallel import mesh as mesh_lib, sharding
from shardtrain.plan import analytic, planner

MESHES_COMPILED = 6
"""How many meshes `search` compiles by default: the fastest by the analytical model."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


BASE_AXES = ("data", "pipeline", "fsdp", "tensor")
CONTEXT_MIN_CHUNK = 512
"""Context parallelism is searched only where each of a device's two chunks keeps this many
tokens: below that the ring's per-block overhead outweighs what splitting the sequence saves."""


def factorisations(n: int, axes: tuple[str, ...] = BASE_AXES) -> list[dict[str, int]]:
    """Every assignment of sizes to `axes` (the other mesh axes 1) with product n, each once."""
    def split(n, axes):
        if len(axes) == 1:
            return [{axes[0]: n}]
        return [{axes[0]: d, **rest} for d in divisors(n) for rest in split(n // d, axes[1:])]
    return [{a: m.get(a, 1) for a in MESH_AXES} for m in split(n, tuple(a for a in MESH_AXES if a in axes))]


def search_axes(cfg: RunConfig) -> tuple[str, ...]:
    """The mesh axes worth searching for this model: the base four, `expert` for MoE, `context`
    for long sequences."""
    axes = BASE_AXES + (("expert",) if cfg.model.moe.n_experts > 1 else ())
    return axes + (("context",) if cfg.data.seq_len >= 4 * CONTEXT_MIN_CHUNK else ())


def allowed(cfg: RunConfig, sizes: dict[str, int]) -> bool:
    """Expert sizes divide the experts; context sizes leave chunks of CONTEXT_MIN_CHUNK tokens."""
    if sizes["expert"] > 1 and cfg.model.moe.n_experts % sizes["expert"]:
        return False
    return sizes["context"] == 1 or cfg.data.seq_len % (2 * sizes["context"] * CONTEXT_MIN_CHUNK) == 0


DCN_AXES = ("data", "pipeline", "fsdp")
"""Axes searched across slices / hosts (the slow network); tensor and context stay on ICI, and expert
does on TPU slices: GPU nodes also split an MoE's experts (expert parallelism over InfiniBand, as
DeepEP does)."""


def dcn_placements(cfg: RunConfig, devices: list) -> list[dict[str, int] | None]:
    """How the slices (TPU) or nodes (GPU) of the devices, or the config's mesh.dcn granules, may split
    over DCN_AXES (and expert, for an MoE on GPUs); [None] for one slice."""
    granules = len({mesh_lib.granule(d) for d in devices})
    granules = granules if granules > 1 else math.prod(getattr(cfg.mesh.dcn, a) for a in MESH_AXES)
    experts = cfg.model.moe.n_experts > 1 and devices[0].platform == "gpu"
    return factorisations(granules, DCN_AXES + (("expert",) if experts else ())) if granules > 1 else [None]


def microbatch_counts(cfg: RunConfig, sizes: dict[str, int]) -> list[int | None]:
    """Micro-batch counts to try for a pipeline of P = sizes["pipeline"] stages: 2P, 4P and the
    configured one, where the micro-batch still splits over data x fsdp; P (a bubble of about half
    the step) only when none of those does."""
    p = sizes["pipeline"]
    if p == 1:
        return [None]
    batch = cfg.train.global_batch_size // cfg.train.grad_accum_steps
    shards = sizes["data"] * sizes["fsdp"]
    asked = cfg.train.pipeline.microbatches
    wanted = sorted({p, 2 * p, 4 * p} | ({asked} if asked else set()))
    valid = [m for m in wanted if batch % m == 0 and (batch // m) % shards == 0]
    return [m for m in valid if m != p or len(valid) == 1 or m == asked]


SEARCHED_SCHEDULES = ("1f1b", "zero_bubble")
"""Pipeline schedules tried beside the configured one: 1F1B holds about P micro-batches' activations
where GPipe holds all M, zero-bubble also moves the weight gradients into the bubble. The
interleaved schedule is tried where train.pipeline.repeats > 1 (the config's choice of repeats)."""


def pipeline_choices(cfg: RunConfig, sizes: dict[str, int], schedules: tuple[str, ...] = SEARCHED_SCHEDULES
                     ) -> list[tuple[int | None, str | None]]:
    """(micro-batches, schedule) pairs to try for the mesh `sizes`: each of `microbatch_counts` with
    the configured schedule and `schedules`; [(None, None)] without a pipeline."""
    counts = microbatch_counts(cfg, sizes)
    if counts == [None]:
        return [(None, None)]
    interleaved = ("interleaved_1f1b",) if schedules and cfg.train.pipeline.repeats > 1 else ()
    names = dict.fromkeys((cfg.train.pipeline.schedule, *schedules, *interleaved))
    return [(m, name) for m in counts for name in names]


def candidate(cfg: RunConfig, sizes: dict[str, int], microbatches: int | None,
              dcn: dict[str, int] | None = None, schedule: str | None = None) -> RunConfig:
    """cfg with the mesh `sizes` (per slice when `dcn` splits axes across slices), and for a pipeline
    `microbatches` and `schedule` (None: the configured ones)."""
    pipe = dataclasses.replace(cfg.train.pipeline, microbatches=microbatches or cfg.train.pipeline.microbatches,
                               schedule=schedule or cfg.train.pipeline.schedule)
    train = dataclasses.replace(cfg.train, pipeline=pipe)
    new = dataclasses.replace(cfg, mesh=MeshConfig(**sizes, dcn=DcnConfig(**(dcn or {}))), train=train)
    validate(new)
    return new


def config_of(cfg: RunConfig, row: dict) -> RunConfig:
    """The config of a search row (`Row.as_dict()`, or a tuned candidate's dict)."""
    return candidate(cfg, row["mesh"], row["microbatches"], row["dcn"], row.get("schedule"))


@dataclasses.dataclass
class Row:
    mesh: dict
    microbatches: int | None
    status: str
    """ranked | no fit (state) | not built: <reason>"""
    report: dict | None = None
    state_bytes: int | None = None
    dcn: dict | None = None
    """Sizes across slices (multi-slice targets); `mesh` is then per slice."""
    schedule: str | None = None
    """train.pipeline.schedule of a pipeline's row; None without a pipeline."""
    predicted_step_s: float | None = None
    """The analytical model's step (analytic.py), for the rows whose state fits."""
    predicted_bytes: float | None = None
    """The analytical model's device memory."""

    def as_dict(self) -> dict:
        return {"mesh": self.mesh, "dcn": self.dcn, "microbatches": self.microbatches, "schedule": self.schedule,
                "status": self.status, "predicted_step_s": self.predicted_step_s,
                "predicted_bytes": self.predicted_bytes,
                "state_bytes_per_device": self.state_bytes, "report": self.report}


def search(cfg: RunConfig, devices: list, chip: chips_lib.Chip, workers: int | None = None,
           require_fit: bool = True, schedules: tuple[str, ...] = SEARCHED_SCHEDULES,
           meshes: int = MESHES_COMPILED) -> dict:
    """Plans the valid meshes of len(devices) devices; returns {'rows': ranked rows, 'rejected': ...}.
    `require_fit`: raise a ConfigError saying what would fit when no mesh does (tune.py, which may
    still make one fit, asks for the ranking anyway). `schedules`: the pipeline schedules tried beside
    the configured one (`pipeline_choices`). `meshes`: how many to compile, the fastest by the
    analytical model (0: all)."""
    n = len(devices)
    chip_dev = planner.per_device(chip, n)
    limit = chip_dev.hbm_bytes
    rows, rejected, todo = [], [], []
    valid = [(ici, dcn) for dcn in dcn_placements(cfg, devices)
             for ici in factorisations(n // math.prod((dcn or {}).values()), search_axes(cfg)) if allowed(cfg, ici)]
    for sizes, dcn in valid:
        reasons = []
        total = {a: sizes[a] * (dcn or {}).get(a, 1) for a in MESH_AXES}
        for m, schedule in pipeline_choices(cfg, total, schedules):
            try:
                c = candidate(cfg, sizes, m, dcn, schedule)
                prog = step_lib.build(c, mesh_lib.make_mesh(c.mesh, devices))
            except ConfigError as e:
                reasons.append(str(e))
                continue
            except Exception as e:  # e.g. a pipeline module missing or failing: report, go on
                rows.append(Row(sizes, m, f"not built: {type(e).__name__}: {str(e)[:200]}", dcn=dcn, schedule=schedule))
                continue
            state = sharding.shard_bytes(prog.abstract_state)
            row = Row(sizes, m, "ranked", state_bytes=state, dcn=dcn, schedule=schedule)
            rows.append(row)
            if state > limit:
                row.status = "no fit (state)"
            else:
                guess = analytic.predict(prog, chip_dev)
                row.predicted_step_s, row.predicted_bytes = guess["step_s"], guess["device_bytes"]
                todo.append((row, prog))
        if reasons and not any(r.mesh == sizes and r.dcn == dcn for r in rows):
            rejected.append({"mesh": sizes, "dcn": dcn, "reason": "; ".join(dict.fromkeys(reasons))})
        elif not microbatch_counts(cfg, total):
            rejected.append({"mesh": sizes, "dcn": dcn,
                             "reason": "no micro-batch count splits the batch over data x fsdp"})
    if not rows:
        raise ConfigError(f"no mesh of {n} devices suits this model: " +
                          "; ".join(f"{r['mesh']}: {r['reason']}" for r in rejected[:4]))
    # stable: ties keep the enumeration's order
    todo.sort(key=lambda row_prog: (predicted_room(row_prog[0], limit), row_prog[0].predicted_step_s))
    for row, _ in todo[meshes or len(todo):]:
        row.status = (f"pruned: predicted {row.predicted_step_s * 1e3:.2f} ms, {planner.gib(row.predicted_bytes)}; "
                      f"not among the {meshes} compiled")
    compile_all(todo[:meshes or len(todo)], devices[0].platform, chip, workers)
    ranked = sorted(rows, key=rank_key)
    if require_fit and not any(r.report and r.report["fits"] for r in ranked):
        raise ConfigError(no_fit_message(cfg, ranked, n, limit, chip))
    return {"devices": n, "chip": chip.name, "memory_limit_bytes": limit,
            "rows": [r.as_dict() for r in ranked], "rejected": rejected}


def predicted_room(row: Row, limit: float) -> int:
    """0: the analytical model's bytes fit with room (`analytic.FITS_WITH_ROOM`), 1: they fit, 2: they do not."""
    return 0 if row.predicted_bytes <= analytic.FITS_WITH_ROOM * limit else 1 if row.predicted_bytes <= limit else 2


def compile_all(todo: list[tuple[Row, step_lib.Program]], platform: str, chip: chips_lib.Chip,
                workers: int | None = None, quiet: bool = False) -> None:
    """Compiles the rows' programs in a thread pool (XLA compiles outside the GIL) and fills in
    their reports; a mesh that fails to lower or compile is marked, not raised. Lowering (Python
    tracing) runs here, one mesh at a time, while the pool compiles. `quiet`: no progress bar."""
    workers = workers or max(1, min(len(todo), os.cpu_count() or 1))
    bar = tqdm(total=len(todo), desc="compiling meshes", unit="mesh", file=sys.stderr, disable=quiet or not todo)
    with planner.compile_cache_off(platform), concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {}
        for row, prog in todo:
            try:
                futures[pool.submit(planner.compile_fast, prog.lower(), platform)] = (row, prog)
            except Exception as e:  # one mesh that does not lower must not stop the search
                row.status = f"not built: {type(e).__name__}: {str(e)[:200]}"
                bar.update()
        for future in concurrent.futures.as_completed(futures):
            row, prog = futures[future]
            try:
                row.report = planner.report(prog, future.result(), chip)
            except Exception as e:
                row.status = f"not built: {type(e).__name__}: {str(e)[:200]}"
            bar.update()
    bar.close()


def rank_key(row: Row):
    r = row.report
    if r is None:
        return (2, row.predicted_step_s or math.inf, row.state_bytes or math.inf)
    return (0 if r["fits"] else 1, r["estimate"]["step_time_s"])


def no_fit_message(cfg: RunConfig, rows: list[Row], n: int, limit: float, chip: chips_lib.Chip) -> str:
    best = min((r for r in rows if r.state_bytes is not None), key=lambda r: r.state_bytes, default=None)
    if best is None:
        return f"no mesh of {n} devices could be built for this model"
    head = f"no mesh of {n} devices fits {cfg.model.name} in {planner.gib(limit)} per device ({chip.name})"
    if best.state_bytes > limit:
        devices_needed = 2 ** math.ceil(math.log2(n * best.state_bytes / limit))
        return (f"{head}: parameters + optimizer state alone need {planner.gib(best.state_bytes)} per device on the "
                f"most sharded mesh ({planner.mesh_label(best.mesh)}); they would fit on about {devices_needed} "
                f"devices (--devices {devices_needed}) or a chip with more memory")
    compiled = [r for r in rows if r.report]
    r = min(compiled, key=lambda r: r.report["memory_per_device_bytes"]["total"])
    m = r.report["memory_per_device_bytes"]
    activations = m["total"] - m["params"] - m["optimizer"]
    room = limit - m["params"] - m["optimizer"]
    batch = int(cfg.train.global_batch_size * room / activations) if activations > 0 else 0
    rows_per_step = math.prod(r.mesh[a] * (r.dcn or {}).get(a, 1) for a in ("data", "fsdp"))  # smallest batch it splits
    fix = (f"or train.global_batch_size <= about {batch}" if batch >= rows_per_step else
           "or a shorter data.seq_len; even one sequence per device does not fit, so a smaller batch alone will not do")
    return (f"{head}: the smallest total is {planner.gib(m['total'])} on mesh {planner.mesh_label(r.mesh)}, of which "
            f"{planner.gib(activations)} is batch and activations; try train.remat=full, train.grad_accum_steps, {fix}")


def format_table(result: dict) -> str:
    head = f"{'#':>3}  {'data x pipe x fsdp x tensor':<28}{'fits':<6}{'mem/device':>14}{'comm/device':>14}" \
           f"{'est. step':>12}{'MFU':>8}  bound by"
    lines = [f"{len(result['rows'])} meshes of {result['devices']} devices on {result['chip']} "
             f"(memory limit {planner.gib(result['memory_limit_bytes'])} per device); "
             f"{len(result['rejected'])} factorisations rejected by the model's dimensions", head]
    for i, row in enumerate(result["rows"], 1):
        label = label_of(row) + (f" {row['schedule']} M={row['microbatches']}" if row["microbatches"] else "")
        r = row["report"]
        if r is None:
            state = planner.gib(row["state_bytes_per_device"]) if row["state_bytes_per_device"] else "-"
            fits = "no" if row["status"].startswith("no fit") else "-"
            lines.append(f"{i:>3}  {label:<28}{fits:<6}{state:>14}{'-':>14}{'-':>12}{'-':>8}  {row['status']}")
            continue
        e = r["estimate"]
        lines.append(f"{i:>3}  {label:<28}{'yes' if r['fits'] else 'no':<6}"
                     f"{planner.gib(r['memory_per_device_bytes']['total']):>14}"
                     f"{planner.gib(r['comm_traffic_bytes_per_device']):>14}{e['step_time_s'] * 1e3:>10.2f}ms"
                     f"{e['mfu']:>8.1%}  {e['bottleneck']}")
    if result["rejected"]:
        lines.append("rejected (the model's dimensions or the batch do not split over these axes):")
        lines += [f"     {label_of(r):<28}{r['reason']}" for r in result["rejected"]]
    return "\n".join(lines)


def label_of(row: dict) -> str:
    """The mesh of a row; across slices, e.g. "1x1x128x1 dcn data=2" (per slice, then the DCN split)."""
    dcn = {a: s for a, s in (row.get("dcn") or {}).items() if s > 1}
    return planner.mesh_label(row["mesh"]) + ("".join(f" dcn {a}={s}" for a, s in dcn.items()))


def write_best(cfg: RunConfig, result: dict, path: str) -> None:
    """Writes the top row as a complete config (the input config with the mesh replaced)."""
    best = next((r for r in result["rows"] if r["report"] and r["report"]["fits"]), None)
    if best is None:
        raise ConfigError("--write: no mesh fits, nothing to write")
    write_config(config_of(cfg, best), path,
                 f"{result['devices']} devices, {result['chip']}: estimated "
                 f"{best['report']['estimate']['step_time_s'] * 1e3:.2f} ms/step")


def write_config(cfg: RunConfig, path: str, note: str) -> None:
    """Writes `cfg` as a complete config named after the file, with `note` in its first line."""
    tree = yaml.safe_load(dump(dataclasses.replace(cfg, name=Path(path).stem, run_dir=None)))
    del tree["run_dir"]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(f"# Written by `shardtrain plan --search` ({note})\n" + yaml.safe_dump(tree, sort_keys=False))


def main(cfg: RunConfig, devices: list, chip: chips_lib.Chip, as_json: bool = False, write: str | None = None,
         meshes: int = MESHES_COMPILED) -> int:
    """`shardtrain plan --search`: prints the ranked meshes of `devices`; `write`: the best as a config."""
    result = search(cfg, devices, chip, meshes=meshes)
    print(json.dumps(result, indent=1, default=float) if as_json else format_table(result))
    if write:
        write_best(cfg, result, write)
        print(f"wrote {write}", file=sys.stderr)
    return 0
