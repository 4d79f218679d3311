"""`shardtrain plan`: memory, communication, FLOPs and a roofline step time of a mesh, read from the
real train step (`step.build`) lowered from abstract inputs and compiled; nothing is allocated.

Memory per device comes from `compiled.memory_analysis()`: its argument bytes (exact) are split
into parameters (the abstract state's per-device shard shapes, exact because every sharded
dimension divides), batch, and optimizer (the rest of the arguments: optimizer state, step counter
and any other state); temp is XLA's temporary buffer size; total = arguments + temp + outputs that
do not reuse a donated input. State that train.offload keeps in pinned host memory is reported apart
(`host_memory_per_device_bytes`, from the abstract state's shard shapes), never in the device total
(compilers split the arguments differently: the CPU's counts host ones among the arguments, XLA:GPU
all of them among the host ones once one is, so the device's are all arguments but the offloaded
state); it crosses the host link twice per step (in and out), which the roofline adds. Collectives are read from
the optimized HLO (`plan/hlo/collectives.py` documents the byte conventions), which is parsed once
per report. FLOPs and bytes accessed per device come from `compiled.cost_analysis()`, which counts a
while loop's body once, plus the loops' remaining iterations (`hlo.loop_repeats_cost`: a pipeline
schedule, gradient accumulation, a rolled scan); where the compiler gives no cost analysis (XLA:GPU
compiling for GPUs that are not here), and on GPUs (whose cost analysis counts more bytes than a
measured step could move: bench/README.md, GPU), all of
them come from the HLO (`hlo.program_cost`).

Post-training adds `reference` (the frozen starting weights, taken out of `optimizer`) and, for GRPO,
`kv_cache` (the generator's cache, held with the state instead of the step's temporaries and batch:
total is the larger of the two).

The compiler is the target's own: the TPU compiler for a TPU topology, XLA:GPU for GPUs (compile-only
devices of `topology.gpu_devices` when no GPU is here), else the devices present.

Matmul FLOPs by operand type (`flops_by_dtype`, `hlo.matmul_flops_by_dtype`) are read from the same
HLO: with train.quantization the block matmuls' operands are s8 or f8 there, and only those types
the planner counts at their own peak (`chips.peak_flops`), never from the config flag. The MoE
experts' grouped matmuls among them (`moe_flops_by_dtype`, and `moe_low_precision_share`, the share of
those FLOPs in int8 / fp8) are the TPU's ragged-dot and the GPU's grouped-GEMM kernels, or the dots of
their named scope where a compiler lowered `ragged_dot` to dense dots.

Roofline estimate per step: compute = FLOPs per device / peak FLOP/s (each matmul at its operand
type's peak; the model's FLOPs split the same way for the floor), memory = bytes accessed /
HBM bandwidth, communication = ring traffic of every collective / the bandwidth of its axes (DCN
when an axis crosses slices or GPU nodes, else ICI / NVLink); step time = max(compute, memory) +
communication (no overlap assumed: an upper bound on TPUs, which overlap some collectives); the
bottleneck is the largest of the three. MFU = model FLOPs (6N + attention per token) / (step time x
peak x devices), the peak being that of the types the matmuls run in (bf16's without quantization).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import threading
import time

import jax

from shardtrain import chips as chips_lib, step as step_lib
from shardtrain.config import MESH_AXES, ConfigError, HardwareConfig, RunConfig, validate_hardware
from shardtrain.parallel import comm, mesh as mesh_lib, sharding, timetable
from shardtrain.plan import hlo, topology

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
    """The figures of one device: a chip's share (TPU7x: half a chip), or a host-wide entry's (`cpu`: one
    machine simulates all devices) shared among the devices."""
    if not chip.host_shared:
        return chip.per_device()
    return dataclasses.replace(chip, peak_flops=chip.peak_flops / n_devices, hbm_bytes=chip.hbm_bytes / n_devices,
                               hbm_bandwidth=chip.hbm_bandwidth / n_devices,
                               ici_bandwidth=chip.ici_bandwidth / n_devices,
                               dcn_bandwidth=chip.dcn_bandwidth / n_devices,
                               host_bandwidth=chip.host_bandwidth / n_devices)


def gpus_present(n: int) -> bool:
    """Whether `n` real GPUs are here (a GPU plan then compiles on them)."""
    return topology.gpu_present() and len(jax.devices()) >= n and jax.devices()[0].platform == "gpu"


def plan_devices(n: int) -> list:
    """`n` devices: the real ones if there are enough, else simulated CPU devices."""
    for devices in (jax.devices(), jax.devices("cpu")):
        if len(devices) >= n:
            return list(devices[:n])
    raise ConfigError(f"--devices {n}: only {len(jax.devices('cpu'))} simulated devices exist in this process; "
                      f"run through `shardtrain plan`, which creates --devices of them")


# ----------------------------------------------------------------------------- one mesh


def pipeline_schedule(prog: step_lib.Program) -> dict | None:
    """The trainer's schedule, as its build made it (`prog.schedule`; the planner only reads it)."""
    s = prog.schedule
    if s is None:
        return None
    return {"schedule": s.name, "stages": s.stages, "microbatches": s.microbatches,
            "repeats": s.repeats, "bubble_fraction": s.bubble_fraction, "live_microbatches": s.live_microbatches}


def branch_weights(prog: step_lib.Program) -> list[dict[int, tuple[float, ...]] | None]:
    """For an explicit pipeline schedule (schedules.py), per stage: the share of the schedule loop's
    slots that each operation's branch of its `lax.switch` runs on that stage (its timetable; the
    HLO conditional with that many branches), so that a stage's idle slots cost nothing and the
    FLOPs are the busiest stage's; [None] otherwise (every branch counts each time)."""
    s = prog.schedule
    if s is None or not s.explicit:
        return [None]
    kind, n = s.timetable().kind, timetable.W + 1
    return [{n: tuple(float((kind[:, p] == k).mean()) for k in range(n))} for p in range(s.stages)]


def compute_seconds(flops_dev: float, model_flops_dev: float, flops_by_dtype: dict[str, float],
                    chip: chips_lib.Chip) -> tuple[float, float]:
    """(the compiled FLOPs' time, the model's FLOPs' time) at peak, each matmul at the peak of its
    operand type (`chips.peak_flops`: int8 / fp8 matmuls at theirs, the rest at bf16's). The model's
    FLOPs are split like the program's: the share of the compiled FLOPs that low-precision matmuls
    do runs at their peak (a kernel the HLO cannot see, e.g. splash attention, is in neither)."""
    low = {k: v for k, v in flops_by_dtype.items() if chips_lib.peak_flops(chip, k) != chip.peak_flops}
    low_s = sum(v / chips_lib.peak_flops(chip, k) for k, v in low.items())
    program_s = max(flops_dev - sum(low.values()), 0.0) / chip.peak_flops + low_s
    total = max(flops_dev, sum(flops_by_dtype.values()), 1.0)
    floor_s = model_flops_dev * ((1 - sum(low.values()) / total) / chip.peak_flops + low_s / total)
    return program_s, floor_s


def estimate(flops_dev: float, bytes_dev: float, colls: list[hlo.Collective], chip: chips_lib.Chip,
             dcn_axes: set[str], model_flops_step: float, n_devices: int,
             flops_by_dtype: dict[str, float] | None = None, loops: dict[str, hlo.LoopBody] | None = None,
             host_link_bytes: float = 0.0, idle_fraction: float = 0.0) -> dict:
    """The roofline. Compute time is the larger of the compiled FLOPs and the model's FLOPs at peak
    (`compute_seconds`): the compiler's count can fall short of the model's (a remat policy that saves
    every matmul and an embedding lookup with no input gradient, as in meshes/gpu_1x8.yaml; custom
    kernels such as splash attention report no FLOPs at all), and no step beats the model's own FLOPs
    at peak. So MFU <= 1: it is the model's FLOPs at the peaks of the types its matmuls run in (bf16's
    without quantization) over the step time.

    `step_time_s` adds all communication (the serial bound); `step_time_overlapped_s` lets the
    collectives of each loop iteration (`loops`: the layer scan's gathers of the next weights and
    reduce-scatters of the last gradients, which the compiler runs asynchronously) hide behind that
    iteration's own compute or memory time, and the rest adds. `host_link_bytes` (train.offload's
    state, in and out each step) cross the host link at the chip's `host_bandwidth`, added in series
    (`host_link_s`; no overlap counted). `idle_fraction`: an explicit pipeline schedule's bubble, the
    share of its slots a stage waits in; its FLOPs and bytes are the busiest stage's work alone (idle
    slots compute nothing), so compute and memory time stretch by 1 / (1 - idle_fraction)."""
    program_s, model_s = compute_seconds(flops_dev, model_flops_step / n_devices, flops_by_dtype or {}, chip)
    compute_s = max(program_s, model_s) / (1 - idle_fraction)
    memory_s = bytes_dev / chip.hbm_bandwidth / (1 - idle_fraction)

    def seconds(c: hlo.Collective) -> float:  # all its runs, on the link its axes cross
        return c.traffic_bytes * c.count / (chip.dcn_bandwidth if dcn_axes.intersection(c.axes) else chip.ici_bandwidth)

    comm_s = sum(seconds(c) for c in colls)
    host_s = host_link_bytes / chip.host_bandwidth
    step_s = max(compute_s, memory_s) + comm_s + host_s
    seconds_per_flop = program_s / flops_dev if flops_dev else 1 / chip.peak_flops
    hidden_s = 0.0
    for body in (loops or {}).values():
        comm = sum(seconds(c) for c in colls if c.computation in body.computations) / body.runs
        hidden_s += body.runs * min(comm, max(body.flops * seconds_per_flop, body.bytes / chip.hbm_bandwidth))
    parts = {"compute": compute_s, "memory": memory_s, "communication": comm_s, "host_link": host_s}
    hidden_s = min(hidden_s, comm_s)
    return {"step_time_s": step_s, "step_time_overlapped_s": step_s - hidden_s, "comm_hidden_s": hidden_s,
            "mfu": model_s / step_s,
            "bottleneck": max(parts, key=parts.get), "compute_s": compute_s, "memory_s": memory_s,
            "comm_s": comm_s, "host_link_s": host_s, "chip": chip.name}


def ways(mesh, axes) -> int:
    """Devices along one PartitionSpec entry (None, an axis name or a tuple of them)."""
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return math.prod(int(mesh.shape[a]) for a in axes)


def attention_scores_bytes(cfg: RunConfig, mesh) -> int:
    """Per device, one layer's materialised f32 attention scores (rows x heads x T x T x 4): the largest
    temporary of XLA's attention, checked by hand where the target's compiler is not at hand."""
    rows = cfg.train.global_batch_size // cfg.train.grad_accum_steps // ways(
        mesh, sharding.spec_for(("batch",), cfg.rules, mesh)[0])
    heads = cfg.model.n_heads // ways(mesh, sharding.spec_for(("heads",), cfg.rules, mesh)[0])
    return rows * heads * cfg.data.seq_len ** 2 * 4


def compiler_note(platform: str, chip: chips_lib.Chip, compile_only: bool) -> str:
    """Which compiler's numbers these are, and what they mean for the chip planned for."""
    if platform == "tpu":
        return "TPU compiler (libtpu): memory, collectives and cost are the TPU's own"
    if platform == "gpu":
        where = f"compile-only {chip.name} devices (no GPU needed)" if compile_only else "the GPUs present"
        return f"XLA:GPU compiler for {where}: memory and collectives are the GPU program's own"
    if chip.host_shared:
        return "CPU compiler on the devices present"
    return (f"CPU compiler standing in for {chip.name}: memory is an upper bound (the CPU compiler keeps more "
            f"temporaries than a GPU's fusions and attention kernels); FLOPs and collectives are the program's")


def bytes_per_step(prog) -> dict[tuple[str, ...], float]:
    """Ring-model bytes each device sends per step over the replica axes for this mode: read from
    the *lowered* program, where the hand-written collectives keep their dtype (the CPU compiler
    shows bf16 ones as f32), with local SGD's outer sync amortised over sync_every steps. Metric
    scalars are not counted. {} for the default mode: read the compiled program instead."""
    if not comm.enabled(prog.cfg):
        return {}
    per_run = hlo.traffic_by_axes(hlo.lowered_collectives(prog.lower().as_text(), dict(prog.mesh.shape)))
    every = prog.cfg.train.comm.sync_every if prog.cfg.train.comm.sync == "local_sgd" else 1
    return {axes: b / every for axes, b in per_run.items()}


def comm_mode(prog: step_lib.Program) -> dict | None:
    """Bytes per step over each axis for compressed reduction / local SGD (bytes_per_step)."""
    if not comm.enabled(prog.cfg):
        return None
    t = prog.cfg.train.comm
    return {"grad_reduce_dtype": t.grad_reduce_dtype, "sync": t.sync,
            "traffic_bytes_per_step": {",".join(a): b for a, b in bytes_per_step(prog).items()}}


def attention_kernel(cfg: RunConfig, mesh, text: str, platform: str) -> str:
    """The attention the compiled program runs: a kernel named in it (cuDNN's fused attention, splash),
    else the XLA implementation the model chose (`ring` when the sequence is split over devices;
    `chunked` where auto's kernel does not take the model: float32, a soft cap, wide MLA heads)."""
    if "__cudnn$fmha" in text:
        return "cudnn"
    if "splash" in text and "tpu_custom_call" in text:
        return "splash"
    if ways(mesh, sharding.spec_for(("seq",), cfg.rules, mesh)[0]) > 1:
        return "ring"
    from models import attention
    chosen = attention.resolve(cfg.model.attention, platform)
    return "chunked" if chosen in ("cudnn", "splash") else chosen  # a kernel absent from the program: auto fell back


def host_bytes(prog: step_lib.Program) -> dict[str, int]:
    """Per device, the state train.offload keeps in the host's pinned memory: {params, optimizer, total}."""
    on_host = step_lib.offloaded(prog.cfg)
    out = {name: sharding.shard_bytes(prog.abstract_state[key]) if key in on_host else 0
           for name, key in (("params", "params"), ("optimizer", "opt"))}
    return {**out, "total": sum(out.values())}


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
    host = host_bytes(prog)
    # compilers split host and device arguments differently (CPU: all are arguments; XLA:GPU: all are host
    # arguments once one is): the device's are all of them but the state train.offload keeps on the host
    args_b = mem.argument_size_in_bytes + mem.host_argument_size_in_bytes - host["total"]
    total_b += mem.host_argument_size_in_bytes - host["total"]
    params_dev_b = params_b - host["params"]
    # post-training: the frozen reference is state beside the optimizer's; GRPO's generation holds
    # the state and the KV cache (instead of the step's temporaries and batch)
    reference_b = sharding.shard_bytes(prog.abstract_state.get("reference", {}))
    cache_b = sharding.shard_bytes(prog.generation_cache())
    total_b = max(total_b, args_b - batch_b + cache_b)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    platform = mesh.devices.flat[0].platform
    text = compiled.as_text()
    module = hlo.parse_module(text)
    busiest = functools.partial(max, key=lambda flops_bytes: flops_bytes[0])  # the busiest pipeline stage
    weights = branch_weights(prog)
    loop_flops, loop_bytes = busiest(hlo.loop_repeats_cost(module, w) for w in weights)
    # the whole count from the HLO: XLA:GPU has no cost analysis compile-only and too many bytes on GPUs;
    # an explicit schedule's switch XLA counts as its costliest branch, where each branch runs its share
    if cost is None or platform == "gpu" or weights != [None]:
        cost, (loop_flops, loop_bytes) = {}, busiest(hlo.program_cost(module, w) for w in weights)
    optimal_s = cost.get("optimal_seconds")  # the TPU cost model's step time (its loop bodies counted once)
    flops_dev = float(cost.get("flops", 0.0)) + loop_flops
    flops_by_dtype = hlo.matmul_flops_by_dtype(module)
    moe_flops_by_dtype = hlo.matmul_flops_by_dtype(module, moe=True)
    bytes_dev = float(cost.get("bytes accessed", 0.0)) + loop_bytes
    colls = max((hlo.collectives(module, dict(mesh.shape), w) for w in branch_weights(prog)),  # the busiest stage
                key=lambda cs: sum(c.traffic_bytes * c.count for c in cs))
    dcn_axes = {a for a in MESH_AXES if getattr(cfg.mesh.dcn, a) > 1} | mesh_lib.cross_granule_axes(mesh)
    if platform == "tpu" and dcn_axes:  # multi-slice: libtpu's cross-slice reductions
        slices = math.prod(getattr(cfg.mesh.dcn, a) for a in MESH_AXES)
        colls += hlo.dcn_reductions(module, tuple(a for a in MESH_AXES if a in dcn_axes), slices)
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    flops_token = prog.flops_per_token
    return {
        "config": cfg.name, "model": cfg.model.name, "devices": n, "chip": chip.name,
        "compiler": platform, "compiler_note": compiler_note(platform, chip, compile_only(mesh)),
        "topology": topology_name(mesh), "attention_kernel": attention_kernel(cfg, mesh, text, platform),
        "dcn_axes": sorted(dcn_axes),
        "mesh": {a: int(s) for a, s in mesh.shape.items()},
        "params": {"count": n_params,
                   "bytes": sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))},
        "memory_per_device_bytes": {
            "params": params_dev_b, "optimizer": args_b - params_dev_b - batch_b - reference_b,
            "batch": batch_b, **({"reference": reference_b} if reference_b else {}), "temp": mem.temp_size_in_bytes,
            **({"kv_cache": cache_b} if cache_b else {}), "total": total_b},
        "host_memory_per_device_bytes": host,
        "host_link_bytes_per_step": 2 * host["total"],
        "compiled_memory_bytes": {  # memory_analysis() as the compiler gave it
            "arguments": mem.argument_size_in_bytes, "temp": mem.temp_size_in_bytes,
            "outputs": mem.output_size_in_bytes, "aliased": mem.alias_size_in_bytes,
            "generated_code": mem.generated_code_size_in_bytes,
            "host_arguments": mem.host_argument_size_in_bytes, "host_temp": mem.host_temp_size_in_bytes},
        "attention_scores_bytes_per_layer": attention_scores_bytes(cfg, mesh),
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
        "flops_by_dtype": flops_by_dtype,
        "moe_flops_by_dtype": moe_flops_by_dtype,
        "moe_low_precision_share": low_precision_share(moe_flops_by_dtype),
        "bytes_accessed_per_device": bytes_dev,
        "loop_repeats_per_device": {"flops": loop_flops, "bytes": loop_bytes},
        "model_flops_per_token": flops_token,
        "model_flops_per_step": flops_token * tokens,
        "estimate": {**estimate(flops_dev, bytes_dev, colls, chip_dev, dcn_axes, flops_token * tokens, n,
                                flops_by_dtype, hlo.loop_bodies(module), 2 * host["total"],
                                prog.schedule.bubble_fraction if prog.schedule and prog.schedule.explicit else 0.0),
                     "tpu_cost_model_step_s": float(optimal_s) if optimal_s and optimal_s > 0 else None,
                     "cost_analysis_optimal_seconds": None if optimal_s is None else float(optimal_s)},
        "pipeline": pipeline_schedule(prog),
        "compile_s": compile_s,
    }


def low_precision_share(flops_by_dtype: dict[str, float]) -> float | None:
    """The share of these matmul FLOPs whose operands are both int8 or both fp8 (None: no FLOPs)."""
    total = sum(flops_by_dtype.values())
    low = sum(v for k, v in flops_by_dtype.items() if chips_lib.operand_kind(k) != "bf16")
    return low / total if total else None


def compile_only(mesh) -> bool:
    """Whether the mesh's devices are descriptions to compile for (jax.experimental.topologies)."""
    d = mesh.devices.flat[0]
    return d.platform != jax.default_backend() or d not in jax.devices()


def topology_name(mesh) -> str | None:
    """"TPU v5e, 256 chips" / "... in 2 slices" for TPUs, "NVIDIA H100 80GB HBM3, 16 GPUs in 2 nodes" for
    GPUs, else None."""
    d = mesh.devices.flat[0]
    if d.platform not in ("tpu", "gpu"):
        return None
    granules = len({mesh_lib.granule(x) for x in mesh.devices.flat})
    unit, group = ("chips", "slices") if d.platform == "tpu" else ("GPUs", "nodes")
    chip = chips_lib.for_device_kind(d.device_kind)
    per_chip = chip.devices_per_chip if chip else 1
    count = f"{mesh.devices.size // per_chip} {unit}" + (f" ({mesh.devices.size} devices)" if per_chip > 1 else "")
    return f"{d.device_kind}, {count}" + (f" in {granules} {group}" if granules > 1 else "")


class _CompileCacheOff:
    """Holds JAX's persistent compilation cache off while compiles for a TPU topology run: its
    compile-only client cannot read entries back ("PjRtCompiler must be constructed with a Client"),
    and a run may have switched the cache on. The switch is process-wide and JAX decides once per
    process whether the cache is in use (hence `reset_cache`), so concurrent compiles (`search`'s
    thread pool, plans from several threads) share one switch: the first to enter turns the cache
    off, the last to leave turns it back to what it was."""

    def __init__(self):
        self._lock = threading.Lock()
        self._holders = 0
        self._enabled_before = False

    def __enter__(self):
        from jax.experimental.compilation_cache import compilation_cache
        with self._lock:
            if self._holders == 0:
                self._enabled_before = jax.config.jax_enable_compilation_cache
                jax.config.update("jax_enable_compilation_cache", False)
                compilation_cache.reset_cache()
            self._holders += 1

    def __exit__(self, *exc):
        from jax.experimental.compilation_cache import compilation_cache
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                jax.config.update("jax_enable_compilation_cache", self._enabled_before)
                compilation_cache.reset_cache()


_CACHE_OFF = _CompileCacheOff()  # one per process, like the flag it guards


def compile_cache_off(platform: str) -> contextlib.AbstractContextManager:
    """A context in which compiles for `platform` bypass the persistent compilation cache (CPU
    compiles keep it); enter it around a batch of compiles to switch the cache once."""
    return contextlib.nullcontext() if platform == "cpu" else _CACHE_OFF


def compile_fast(lowered, platform: str):
    """Compiles for reading, not running: on CPU without LLVM optimisation (faster; buffer assignment,
    cost analysis and collectives are decided before it: bench/README.md, Planner accuracy); for
    other platforms inside `compile_cache_off`."""
    if platform == "cpu":
        return lowered.compile(compiler_options={"xla_backend_optimization_level": 0})
    with compile_cache_off(platform):
        return lowered.compile()


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
    label = "x".join(str(mesh[a]) for a in ("data", "pipeline", "fsdp", "tensor"))
    label += "".join(f" {a}={mesh[a]}" for a in ("expert", "context") if mesh.get(a, 1) > 1)
    return label + (f" M={pipeline['microbatches']}" if pipeline else "")


def by_type(flops_by_dtype: dict[str, float]) -> str:
    """"bf16 1.2e+15, s8 3.4e+14": FLOPs by operand type, the most first."""
    return ", ".join(f"{k} {v:.4g}" for k, v in sorted(flops_by_dtype.items(), key=lambda kv: -kv[1]))


def moe_flops_lines(r: dict) -> list[str]:
    """The MoE experts' grouped matmul FLOPs by type and their int8 / fp8 share (none without MoE); on
    GPUs whose other matmuls are int8 / fp8, why the experts stay 16-bit."""
    share = r["moe_low_precision_share"]
    if share is None:
        return []
    note = ("; the GPU's grouped-GEMM kernels take 16-bit operands only, the experts run in bf16"
            if r["compiler"] == "gpu" and share < 1 and low_precision_share(r["flops_by_dtype"]) else "")
    return [f"  of which the MoE experts' grouped matmuls: {by_type(r['moe_flops_by_dtype'])} "
            f"({share:.1%} in int8 / fp8{note})"]


def format_report(r: dict) -> str:
    m, e = r["memory_per_device_bytes"], r["estimate"]
    halves = " devices" if chips_lib.CHIPS[r["chip"]].devices_per_chip > 1 else ""
    lines = [
        f"{r['config']}: {r['model']} {r['params']['count'] / 1e6:.2f}M params ({gib(r['params']['bytes'])}) "
        f"on {r['devices']} devices, mesh " + ", ".join(f"{a}={s}" for a, s in r["mesh"].items()),
        f"compiled by the {r['compiler_note']}" + (f"; {r['topology']}" if r["topology"] else "")
        + f"; compile {r['compile_s']:.1f} s",
        "", "memory per device",
        *(f"  {k:<10} {gib(v):>14}" for k, v in m.items()),
        f"  {'limit':<10} {gib(r['memory_limit_bytes']):>14}  ({r['chip']})",
        f"  fits: {'yes' if r['fits'] else 'NO'}, margin {gib(r['margin_bytes'])} ({r['margin_fraction']:.0%})",
        *([f"  host (train.offload): optimizer {gib(r['host_memory_per_device_bytes']['optimizer'])}, params "
           f"{gib(r['host_memory_per_device_bytes']['params'])}; host link {gib(r['host_link_bytes_per_step'])} "
           f"per step, {e['host_link_s'] * 1e3:.3f} ms"] if r["host_memory_per_device_bytes"]["total"] else []),
        "", "collectives per device per step (bytes = array size; traffic = ring estimate)",
        f"  {'kind':<20}{'count':>7}{'bytes':>16}{'traffic':>16}  axes",
        *(f"  {k:<20}{c['count']:>7}{gib(c['bytes']):>16}{gib(c['traffic_bytes']):>16}  {', '.join(c['axes'])}"
          for k, c in r["collectives"].items()),
        "", f"FLOPs per step {r['flops_per_step']:.4g} ({r['flops_per_device']:.4g} per device); "
            f"model FLOPs per token {r['model_flops_per_token']:.4g}",
        "matmul FLOPs per device by operand type: " + (by_type(r["flops_by_dtype"]) or "none"),
        *moe_flops_lines(r),
        f"estimate on {r['devices']} x {r['chip']}{halves}: step {e['step_time_s'] * 1e3:.3f} ms, MFU {e['mfu']:.1%}, "
        f"bound by {e['bottleneck']} (compute {e['compute_s'] * 1e3:.3f} ms, memory {e['memory_s'] * 1e3:.3f} ms, "
        f"communication {e['comm_s'] * 1e3:.3f} ms)",
        f"  with each loop iteration's collectives overlapping its compute: step "
        f"{e['step_time_overlapped_s'] * 1e3:.3f} ms ({e['comm_hidden_s'] * 1e3:.3f} ms of communication hidden)",
    ]
    if e.get("tpu_cost_model_step_s"):
        lines.append(f"TPU cost model (cost_analysis optimal_seconds, loop bodies once): "
                     f"{e['tpu_cost_model_step_s'] * 1e3:.3f} ms")
    if r["compiler"] == "cpu" and not r["chip"] == "cpu":
        scores = gib(r["attention_scores_bytes_per_layer"])
        lines.append(f"check by hand: one layer's f32 attention scores are {scores} per device (XLA attention "
                     "materialises them; a flash / cuDNN kernel does not)")
    if r.get("comm_mode"):
        c = r["comm_mode"]
        lines.append(f"train.comm.grad_reduce_dtype={c['grad_reduce_dtype']}, train.comm.sync={c['sync']}: per device "
                     "per step " + ", ".join(f"{gib(b)} over {a}" for a, b in c["traffic_bytes_per_step"].items())
                     + " (ring estimate of comm.py's own collectives, lowered program: bf16 stays bf16, local SGD's "
                     "sync / sync_every; the table above shows the CPU-compiled program)")
    if r["pipeline"]:
        p = r["pipeline"]
        lines.append(f"pipeline: {p['schedule']}, {p['stages']} stages, {p['microbatches']} micro-batches, "
                     f"repeats {p['repeats']}: bubble {p['bubble_fraction']:.1%}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- entry point


def hardware(cfg: RunConfig, chip: str | None = None, topology_flag: str | None = None,
             slices: int | None = None) -> HardwareConfig:
    """What to plan for: --chip / --topology / --slices, else the config's `hardware` section."""
    hw = cfg.hardware
    same_chip = chip in (None, hw.chip)
    if (topology_flag or slices) and chip is None and hw.chip is None:
        raise ConfigError("--topology needs the chip it is a topology of: --chip v5e or --chip h100 (or hardware.chip "
                          "in the config)")
    out = HardwareConfig(chip=chip or hw.chip,
                         topology=topology_flag or (hw.topology if same_chip else None),
                         slices=slices or (hw.slices if same_chip and not topology_flag else 1))
    if chip is not None and chip not in chips_lib.CHIPS:
        raise ConfigError(f"--chip: unknown chip '{chip}'; known: {', '.join(chips_lib.CHIPS)}")
    validate_hardware(dataclasses.replace(cfg, hardware=out))
    return out


def target(cfg: RunConfig, n_devices: int, requested: int | None = None, chip: str | None = None,
           topology_flag: str | None = None, slices: int | None = None,
           memory_limit: float | None = None) -> tuple[list, chips_lib.Chip]:
    """(devices, chip) to plan on: a TPU topology's compile-only devices, else `n_devices` real or
    simulated ones; `requested` is --devices as given (checked against a topology's chip count)."""
    hw = hardware(cfg, chip, topology_flag, slices)
    gpu = hw.chip is not None and chips_lib.CHIPS[hw.chip].gpu is not None
    if hw.topology is None and gpu and not gpus_present(n_devices):
        nodes = math.prod(getattr(cfg.mesh.dcn, a) for a in MESH_AXES)
        if n_devices % nodes:
            raise ConfigError(f"--devices {n_devices}: not a whole number of GPUs on each of mesh.dcn's {nodes} nodes")
        hw = dataclasses.replace(hw, topology=f"{nodes}x{n_devices // nodes}")
    if hw.topology is None:
        devices = plan_devices(n_devices)
    else:
        devices = list(topology.devices(chips_lib.CHIPS[hw.chip], hw.topology, hw.slices))
        if requested is not None and requested != len(devices):
            raise ConfigError(f"--devices {requested}: the {hw.chip} topology {hw.topology} x {hw.slices} slice(s) "
                              f"has {len(devices)} devices; drop --devices or change the topology")
    return devices, pick_chip(hw.chip, devices, memory_limit)


def main(cfg: RunConfig, devices: list, chip: chips_lib.Chip, as_json: bool = False) -> int:
    """`shardtrain plan`: prints the plan of cfg's mesh on `devices` (--search: search.main)."""
    r = plan_one(cfg, devices, chip)
    print(json.dumps(r, indent=1, default=float) if as_json else format_report(r))
    return 0
