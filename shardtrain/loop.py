"""The training loop: init or restore -> [batch -> step -> metrics -> checkpoint / preemption]."""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path

import jax

from shardtrain import (
    config as config_lib,
    evaluate,
    mesh as mesh_lib,
    pipeline,
    step as step_lib,
)
from shardtrain.checkpoint import listing, manager
from shardtrain.data import loader, token_shards
from shardtrain.hf import weights
from shardtrain.metrics import Metrics

EXIT_PREEMPTED = 75


class Preemption:
    """SIGTERM -> save at the next step boundary. With several processes all agree on the step
    through JAX's preemption sync point; a single process uses its own signal handler."""

    def __init__(self):
        self.requested = False
        self.multiprocess = jax.process_count() > 1
        self.previous = None if self.multiprocess else signal.signal(signal.SIGTERM, self._on_signal)

    def close(self):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)

    def _on_signal(self, *_):
        self.requested = True

    def reached(self, step: int) -> bool:
        if self.multiprocess:
            from jax.experimental import multihost_utils
            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested


def mode_line(cfg: config_lib.RunConfig, mesh) -> str:
    """One console line with what this run does: mesh, remat, dtypes, gradient communication, pipeline."""
    t = cfg.train
    axes = ",".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1) or "1 device"
    dcn = ",".join(f"{a}={getattr(cfg.mesh.dcn, a)}" for a in config_lib.MESH_AXES if getattr(cfg.mesh.dcn, a) > 1)
    if t.comm.sync == "local_sgd":
        comm = (f"local SGD over {','.join(t.comm.sync_axes)}, sync every {t.comm.sync_every} steps in "
                f"{t.comm.grad_reduce_dtype} (outer lr {t.comm.outer_learning_rate}, momentum {t.comm.outer_momentum})")
    else:
        comm = f"gradients reduced every step in {t.comm.grad_reduce_dtype}"
    stages = mesh.shape.get("pipeline", 1)
    if stages > 1:
        repeats = f", {t.pipeline.repeats} repeats" if t.pipeline.schedule == "circular" else ""
        micro = pipeline.microbatches(cfg, mesh)
        pipe = f"pipeline {t.pipeline.schedule}, {stages} stages, {micro} micro-batches{repeats}"
    else:
        pipe = "no pipeline"
    accum = f"; {t.grad_accum_steps} accumulation steps" if t.grad_accum_steps > 1 else ""
    return (f"mode: mesh {axes}{f' (dcn {dcn})' if dcn else ''}; remat {t.remat}; compute {t.compute_dtype}, "
            f"params {t.param_dtype}; {comm}; {pipe}{accum}")


def train(cfg: config_lib.RunConfig) -> int:
    """Runs training to cfg.train.steps; returns the process exit code (0, or 75 when preempted).
    A run whose checkpoints already reach train.steps is complete: it says so and returns 0
    without touching anything. Closes everything it opened on every exit path; raises
    manager.SaveFailed if a checkpoint save fails; what the checkpoint library logs goes to
    run_dir/shardtrain.log."""
    committed = listing.committed_steps(cfg)
    if committed and max(committed) >= cfg.train.steps:
        if jax.process_index() == 0:
            print(f"run {cfg.run_dir} is complete: checkpoint step {max(committed)} reaches train.steps="
                  f"{cfg.train.steps}; nothing to do (raise train.steps to continue it)", flush=True)
        return 0
    with contextlib.ExitStack() as opened:
        opened.enter_context(manager.library_log(cfg))
        return _train(cfg, opened)


def _train(cfg: config_lib.RunConfig, opened: contextlib.ExitStack) -> int:
    sources = loader.sources(cfg)  # a missing data path fails before anything is compiled
    dataset = loader.samples(cfg, sources)
    init_from = weights.find(cfg.checkpoint.init_from) if cfg.checkpoint.init_from else None
    mesh = mesh_lib.make_mesh(cfg.mesh)
    prog = step_lib.build(cfg, mesh)
    evaluator = evaluate.Evaluator(prog) if cfg.train.eval_every else None  # a missing eval split fails here
    n_params = prog.param_count()
    is_main = jax.process_index() == 0
    if is_main:
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.run_dir) / "config.yaml").write_text(config_lib.dump(cfg))
        print(f"shardtrain: {cfg.model.name} {n_params / 1e6:.2f}M params on {jax.device_count()} "
              f"{jax.devices()[0].platform} devices, mesh {dict(mesh.shape)}; compiling...", flush=True)
        print(mode_line(cfg, mesh), flush=True)
        if loader.packed(cfg):
            print(token_shards.describe(sources), flush=True)

    preemption = Preemption()  # early: a SIGTERM while compiling saves after the first step
    opened.callback(preemption.close)
    t0 = time.perf_counter()
    compiled = prog.lower().compile()
    checkpointer = manager.Checkpointer(prog.cfg, prog.abstract_state, prog.mesh.shape)
    ckpt = opened.enter_context(contextlib.closing(checkpointer))
    restored = ckpt.restore_latest(say=lambda text: is_main and print(text, flush=True))
    if restored is None and init_from is not None:  # resume wins over init_from
        state, start = weights.initial_state(prog, init_from), 0
        if is_main:
            print(f"starting from the weights of {init_from.step_dir or init_from.path} "
                  "(step 0, fresh optimizer state)", flush=True)
    elif restored is None:
        state, start = prog.init(cfg.train.seed), 0
    else:
        state, meta = restored
        start = manager.start_step_from(meta, cfg)
        if is_main:
            print(f"resuming from checkpoint step {start} (written on mesh {listing.describe_mesh(meta)}; "
                  f"data position {meta['data_position']} samples)", flush=True)
    if is_main:
        print(f"ready in {time.perf_counter() - t0:.1f} s; training steps {start}..{cfg.train.steps}", flush=True)

    metrics = opened.enter_context(contextlib.closing(Metrics(cfg, prog.flops_per_token(), start)))
    if start > 0:
        metrics.event("resume", step=start)
    rows = prog.local_rows()
    profile = cfg.train.profile_steps
    pending = None  # (step, metrics arrays) of the step in flight: read after the next dispatch
    last_done = time.perf_counter()
    exit_code = 0

    def finish_pending():
        nonlocal pending, last_done
        if pending is not None:
            values = {k: float(v) for k, v in pending[1].items()}  # waits for that step
            now = time.perf_counter()
            metrics.log(pending[0], values, now - last_done)
            last_done, pending = now, None

    tracing = False  # steps profile[0]..profile[1] (1-based) run inside a jax.profiler trace
    for i, local_batch in loader.batches(dataset, cfg.train.global_batch_size, rows, start, cfg.train.steps,
                                         loader.read_threads(cfg)):
        if profile and not tracing and profile[0] <= i + 1 <= profile[1]:
            jax.profiler.start_trace(str(Path(cfg.run_dir) / "profile"))
            tracing = True
        batch = prog.device_batch(local_batch)
        state, step_metrics = compiled(state, batch)
        finish_pending()
        pending = (i + 1, step_metrics)
        if tracing and i + 1 == profile[1]:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            tracing = False
        done = i + 1
        if preemption.reached(done):
            finish_pending()
            ckpt.save(done, state)
            ckpt.wait()
            metrics.event("preempted", step=done)
            metrics.message(f"preempted at step {done}; rerun the same command to resume")
            exit_code = EXIT_PREEMPTED
            break
        if evaluator and (done % cfg.train.eval_every == 0 or done == cfg.train.steps):
            finish_pending()
            metrics.log_eval(done, evaluator(state["params"]))
            last_done = time.perf_counter()  # evaluation is not a step's time
        if done % cfg.checkpoint.every_steps == 0 or done == cfg.train.steps:
            finish_pending()
            ckpt.save(done, state)
            last_done = time.perf_counter()  # the save's blocking part is not a step's time
        ckpt.check()  # a failed async save raises manager.SaveFailed at the next step boundary
    finish_pending()
    if tracing:  # preempted inside the traced steps
        jax.profiler.stop_trace()
    ckpt.wait()
    metrics.summary()  # a finished run's closing line (the ExitStack then closes what was opened)
    return exit_code


def bare_loop_batches(prog: step_lib.Program, steps: int) -> list[jax.Array]:
    """The first `steps` global batches as device arrays (for benchmarks that bypass the loop)."""
    it = loader.batches(loader.samples(prog.cfg), prog.cfg.train.global_batch_size, prog.local_rows(), 0, steps)
    return [prog.device_batch(b) for _, b in it]
