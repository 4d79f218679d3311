"""`shardtrain plan`: memory, communication, FLOPs and a roofline step time of a mesh, read from the
real train step (`step.build`) lowered from abstract inputs and compiled; nothing is allocated.

Memory per device comes from `compiled.memory_analysis()`: its argument bytes (exact) are split
into parameters (the abstract state's per-device shard shapes, exact because every sharded
dimension divides), batch, and optimizer (the rest of the arguments: optimizer state, step counter
and any other state); temp is XLA's temporary buffer size; total = arguments + temp + outputs that
do not reuse a donated input. Collectives are parsed from the optimized HLO (`shardtrain/hlo.py`,
which documents the byte conventions). FLOPs and bytes accessed per device come from
`compiled.cost_analysis()`, which counts a while loop's body once, plus the loops' remaining
iterations (`hlo.loop_repeats_cost`: a pipeline schedule, gradient accumulation, a rolled scan).

Roofline estimate per step: compute = FLOPs per device / peak FLOP/s, memory = bytes accessed /
HBM bandwidth, communication = ring traffic of every collective / the bandwidth of its axes (DCN
when an axis crosses slices, else ICI); step time = max(compute, memory) + communication (no
overlap assumed: an upper bound on TPUs, which overlap some collectives); the bottleneck is the
largest of the three. MFU = model FLOPs (6N + attention per token) / (step time x peak x devices).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

import jax

from shardtrain import chips as chips_lib, comm, hlo, mesh as mesh_lib, sharding, step as step_lib
from shardtrain.config import MESH_AXES, ConfigError, RunConfig

# ----------------------------------------------------------------------------- chips and devices


def pick_chip(name: str | None, devices, memory_limit: float | None = None) -> chips_lib.Chip:
    """The chip named by --chip, else the one the devices are, else `cpu`; --memory-limit overrides
    its memory per device."""
    if name is not None and name not in chips_lib.CHIPS:
        raise ConfigError(f"--chip: unknown chip '{name}'; known: {', '.join(chips_lib.CHIPS)}")
    chip = chips_lib.CHIPS[name] if name else (chips_lib.for_device_kind(devices[0].device_kind)
                                                or chips_lib.CHIPS["cpu"])
    if memory_limit is not None:
        per_host = len(devices) if chip.host_shared else 1
        chip = dataclasses.replace(chip, hbm_bytes=float(memory_limit) * per_host)
    return chip


def per_device(chip: chips_lib.Chip, n_devices: int) -> chips_lib.Chip:
    """A host-wide entry (`cpu`: one machine simulates all devices) shared among the devices."""
    if not chip.host_shared:
        return chip
    return dataclasses.replace(chip, peak_flops=chip.peak_flops / n_devices, hbm_bytes=chip.hbm_bytes / n_devices,
                               hbm_bandwidth=chip.hbm_bandwidth / n_devices,
                               ici_bandwidth=chip.ici_bandwidth / n_devices,
                               dcn_bandwidth=chip.dcn_bandwidth / n_devices)


def plan_devices(n: int) -> list:
    """`n` devices: the real ones if there are enough, else simulated CPU devices."""
    for devices in (jax.devices(), jax.devices("cpu")):
        if len(devices) >= n:
            return list(devices[:n])
    raise ConfigError(f"--devices {n}: only {len(jax.devices('cpu'))} simulated devices exist in this process; "
                      f"run through `shardtrain plan`, which creates --devices of them")


# ----------------------------------------------------------------------------- one mesh


def bubble_fraction(cfg: RunConfig, stages: int) -> float | None:
    """Idle fraction of a pipeline schedule: (P-1)/(M+P-1) for GPipe, (P-1)/(vM+P-1) circular."""
    if stages <= 1:
        return None
    t = cfg.train
    m = t.microbatches or 2 * stages
    v = t.pipeline_repeats if t.pipeline_schedule == "circular" else 1
    return (stages - 1) / (v * m + stages - 1)


def estimate(flops_dev: float, bytes_dev: float, colls: list[hlo.Collective], chip: chips_lib.Chip,
             dcn_axes: set[str], model_flops_step: float, n_devices: int) -> dict:
    compute_s = flops_dev / chip.peak_flops
    memory_s = bytes_dev / chip.hbm_bandwidth
    comm_s = sum(c.traffic_bytes * c.count / (chip.dcn_bandwidth if dcn_axes.intersection(c.axes)
                                               else chip.ici_bandwidth) for c in colls)
    step_s = max(compute_s, memory_s) + comm_s
    parts = {"compute": compute_s, "memory": memory_s, "communication": comm_s}
    return {"step_time_s": step_s, "mfu": model_flops_step / (step_s * chip.peak_flops * n_devices),
            "bottleneck": max(parts, key=parts.get), "compute_s": compute_s, "memory_s": memory_s,
            "comm_s": comm_s, "chip": chip.name}


def comm_mode(prog: step_lib.Program) -> dict | None:
    """Bytes per step over each axis for compressed reduction / local SGD (comm.bytes_per_step)."""
    if not comm.enabled(prog.cfg):
        return None
    t = prog.cfg.train
    return {"grad_reduce_dtype": t.grad_reduce_dtype, "sync": t.sync,
            "traffic_bytes_per_step": {",".join(a): b for a, b in comm.bytes_per_step(prog).items()}}


def report(prog: step_lib.Program, compiled, chip: chips_lib.Chip, compile_s: float = 0.0) -> dict:
    """Everything `plan` says about one compiled train step (a JSON-ready dict)."""
    cfg, mesh = prog.cfg, prog.mesh
    n = mesh.devices.size
    chip_dev = per_device(chip, n)
    params = prog.abstract_state["params"]
    n_params = prog.param_count()
    mem = compiled.memory_analysis()
    params_b, batch_b = sharding.shard_bytes(params), sharding.shard_bytes(prog.abstract_batch())
    total_b = mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    text = compiled.as_text()
    loop_flops, loop_bytes = hlo.loop_repeats_cost(text)
    flops_dev = float(cost.get("flops", 0.0)) + loop_flops
    bytes_dev = float(cost.get("bytes accessed", 0.0)) + loop_bytes
    colls = hlo.collectives(text, dict(mesh.shape))
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    flops_token = prog.flops_per_token()
    dcn_axes = {a for a in MESH_AXES if getattr(cfg.mesh.dcn, a) > 1}
    stages = mesh.shape["pipeline"]
    return {
        "config": cfg.name, "model": cfg.model.name, "devices": n, "chip": chip.name,
        "mesh": {a: int(s) for a, s in mesh.shape.items()},
        "params": {"count": n_params,
                   "bytes": sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))},
        "memory_per_device_bytes": {
            "params": params_b, "optimizer": mem.argument_size_in_bytes - params_b - batch_b, "batch": batch_b,
            "temp": mem.temp_size_in_bytes, "total": total_b},
        "memory_limit_bytes": chip_dev.hbm_bytes,
        "fits": total_b <= chip_dev.hbm_bytes,
        "margin_bytes": chip_dev.hbm_bytes - total_b,
        "margin_fraction": 1 - total_b / chip_dev.hbm_bytes,
        "collectives": hlo.summarize(colls),
        "comm_mode": comm_mode(prog),
        "comm_bytes_per_device": int(sum(c.bytes * c.count for c in colls)),
        "comm_traffic_bytes_per_device": int(sum(c.traffic_bytes * c.count for c in colls)),
        "flops_per_device": flops_dev,
        "flops_per_step": flops_dev * n,
        "bytes_accessed_per_device": bytes_dev,
        "loop_repeats_per_device": {"flops": loop_flops, "bytes": loop_bytes},
        "model_flops_per_token": flops_token,
        "model_flops_per_step": flops_token * tokens,
        "estimate": estimate(flops_dev, bytes_dev, colls, chip_dev, dcn_axes, flops_token * tokens, n),
        "pipeline": None if stages <= 1 else {
            "schedule": cfg.train.pipeline_schedule, "stages": int(stages),
            "microbatches": cfg.train.microbatches or 2 * int(stages), "repeats": cfg.train.pipeline_repeats,
            "bubble_fraction": bubble_fraction(cfg, int(stages))},
        "compile_s": compile_s,
    }


def compile_fast(lowered, platform: str):
    """Compiles for reading, not running: on CPU without LLVM optimisation (about half the compile time,
    bench/README.md, Planner accuracy; buffer assignment, cost analysis and collectives are decided
    before it and came out identical)."""
    return lowered.compile(compiler_options={"xla_backend_optimization_level": 0} if platform == "cpu" else None)


def compile_program(prog: step_lib.Program):
    t0 = time.perf_counter()
    compiled = compile_fast(prog.lower(), prog.mesh.devices.flat[0].platform)
    return compiled, time.perf_counter() - t0


def plan_one(cfg: RunConfig, devices, chip: chips_lib.Chip) -> dict:
    try:
        mesh = mesh_lib.make_mesh(cfg.mesh, devices)
    except ConfigError as e:
        raise ConfigError(f"{e}. To list the meshes that {len(devices)} devices allow: "
                          f"shardtrain plan CONFIG --search --devices {len(devices)}") from None
    prog = step_lib.build(cfg, mesh)
    compiled, seconds = compile_program(prog)
    return report(prog, compiled, chip, seconds)


# ----------------------------------------------------------------------------- formatting


def gib(b: float) -> str:
    """Bytes for people: 512 B, 4.03 KiB, 1.07 MiB, 15.948 GiB."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(b) >= scale:
            return f"{b / scale:.3f} {unit}" if unit == "GiB" else f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def mesh_label(mesh: dict, pipeline: dict | None = None) -> str:
    label = "x".join(str(mesh[a]) for a in MESH_AXES)
    return label + (f" M={pipeline['microbatches']}" if pipeline else "")


def format_report(r: dict) -> str:
    m, e = r["memory_per_device_bytes"], r["estimate"]
    lines = [
        f"{r['config']}: {r['model']} {r['params']['count'] / 1e6:.2f}M params ({gib(r['params']['bytes'])}) "
        f"on {r['devices']} devices, mesh " + ", ".join(f"{a}={s}" for a, s in r["mesh"].items()),
        "", "memory per device",
        *(f"  {k:<10} {gib(v):>14}" for k, v in m.items()),
        f"  {'limit':<10} {gib(r['memory_limit_bytes']):>14}  ({r['chip']})",
        f"  fits: {'yes' if r['fits'] else 'NO'}, margin {gib(r['margin_bytes'])} ({r['margin_fraction']:.0%})",
        "", "collectives per device per step (bytes = array size; traffic = ring estimate)",
        f"  {'kind':<20}{'count':>7}{'bytes':>16}{'traffic':>16}  axes",
        *(f"  {k:<20}{c['count']:>7}{gib(c['bytes']):>16}{gib(c['traffic_bytes']):>16}  {', '.join(c['axes'])}"
          for k, c in r["collectives"].items()),
        "", f"FLOPs per step {r['flops_per_step']:.4g} ({r['flops_per_device']:.4g} per device); "
            f"model FLOPs per token {r['model_flops_per_token']:.4g}",
        f"estimate on {r['devices']} x {r['chip']}: step {e['step_time_s'] * 1e3:.3f} ms, MFU {e['mfu']:.1%}, "
        f"bound by {e['bottleneck']} (compute {e['compute_s'] * 1e3:.3f} ms, memory {e['memory_s'] * 1e3:.3f} ms, "
        f"communication {e['comm_s'] * 1e3:.3f} ms)",
    ]
    if r.get("comm_mode"):
        c = r["comm_mode"]
        lines.append(f"train.grad_reduce_dtype={c['grad_reduce_dtype']}, train.sync={c['sync']}: per device per step "
                     + ", ".join(f"{gib(b)} over {a}" for a, b in c["traffic_bytes_per_step"].items())
                     + " (ring estimate of comm.py's own collectives, lowered program: bf16 stays bf16, local SGD's "
                     "sync / sync_every; the table above shows the CPU-compiled program)")
    if r["pipeline"]:
        p = r["pipeline"]
        lines.append(f"pipeline: {p['schedule']}, {p['stages']} stages, {p['microbatches']} micro-batches, "
                     f"repeats {p['repeats']}: bubble {p['bubble_fraction']:.1%}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- entry point


def main(cfg: RunConfig, n_devices: int, chip: str | None = None, memory_limit: float | None = None,
         as_json: bool = False) -> int:
    """`shardtrain plan`: prints the plan of cfg's mesh on `n_devices` devices (--search: search.main)."""
    devices = plan_devices(n_devices)
    r = plan_one(cfg, devices, pick_chip(chip, devices, memory_limit))
    print(json.dumps(r, indent=1, default=float) if as_json else format_report(r))
    return 0
