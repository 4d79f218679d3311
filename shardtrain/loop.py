"""The training loop: init or restore -> [batch -> step -> metrics -> checkpoint / preemption]."""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path

import jax

from models import is_adapter
from shardtrain import (
    config as config_lib,
    evaluate,
    mesh as mesh_lib,
    optim,
    step as step_lib,
)
from shardtrain.checkpoint import listing, manager
from shardtrain.data import loader
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


def say(text: str) -> None:
    """A console line, printed by process 0 only."""
    if jax.process_index() == 0:
        print(text, flush=True)


def mode_line(prog: step_lib.Program) -> str:
    """One console line with what this run does: mesh, remat, dtypes, gradient communication, pipeline."""
    cfg, mesh, t = prog.cfg, prog.mesh, prog.cfg.train
    axes = ",".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1) or "1 device"
    dcn = ",".join(f"{a}={getattr(cfg.mesh.dcn, a)}" for a in config_lib.MESH_AXES if getattr(cfg.mesh.dcn, a) > 1)
    if t.comm.sync == "local_sgd":
        comm = (f"local SGD over {','.join(t.comm.sync_axes)}, sync every {t.comm.sync_every} steps in "
                f"{t.comm.grad_reduce_dtype} (outer lr {t.comm.outer_learning_rate}, momentum {t.comm.outer_momentum})")
    else:
        comm = f"gradients reduced every step in {t.comm.grad_reduce_dtype}"
    if prog.schedule is not None:
        repeats = f", {t.pipeline.repeats} repeats" if t.pipeline.schedule == "circular" else ""
        pipe = (f"pipeline {t.pipeline.schedule}, {prog.schedule.stages} stages, "
                f"{prog.schedule.microbatches} micro-batches{repeats}")
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
        say(f"run {cfg.run_dir} is complete: checkpoint step {max(committed)} reaches train.steps="
            f"{cfg.train.steps}; nothing to do (raise train.steps to continue it)")
        return 0
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as opened:
        opened.enter_context(manager.library_log(cfg.run_dir))
        return _train(cfg, opened)


def _train(cfg: config_lib.RunConfig, opened: contextlib.ExitStack) -> int:
    """Build, then compile and start (or resume), then run the steps; `opened` closes what it opens."""
    sources = loader.sources(cfg)  # a missing data path fails before anything is compiled
    dataset = loader.samples(cfg, sources)
    init_from = weights.find(cfg.checkpoint.init_from) if cfg.checkpoint.init_from else None
    cfg, lr_line = optim.resolve_schedule(cfg, listing.newest_meta(cfg))  # a resume keeps the recorded schedule
    prog = step_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh))
    evaluator = evaluate.Evaluator(prog) if cfg.train.eval_every else None  # a missing eval split fails here
    if jax.process_index() == 0:
        _announce(prog, sources, lr_line)
    preemption = Preemption()  # early: a SIGTERM while compiling saves after the first step
    opened.callback(preemption.close)
    t0 = time.perf_counter()
    compiled = prog.lower().compile()
    ckpt = opened.enter_context(contextlib.closing(
        manager.Checkpointer(cfg, prog.abstract_state, prog.mesh.shape)))
    state, start = _start(prog, ckpt, init_from)
    say(f"ready in {time.perf_counter() - t0:.1f} s; training steps {start}..{cfg.train.steps}")
    metrics = opened.enter_context(contextlib.closing(Metrics(cfg, prog.flops_per_token, start)))
    if start > 0:
        metrics.event("resume", step=start)
    return _run_steps(prog, compiled, state, start, dataset, ckpt, metrics, evaluator, preemption)


def model_line(prog: step_lib.Program) -> str:
    """What trains: the model, its parameters, the trainable ones (LoRA: which adapters), the devices."""
    cfg, lora = prog.cfg, prog.cfg.model.lora
    total = prog.param_count()
    if lora.rank > 0:
        trainable = step_lib.param_count(prog.layout, is_adapter)
        what = (f"{count(trainable)} ({100 * trainable / total:.1f}%) trainable: LoRA rank {lora.rank}, alpha "
                f"{lora.alpha:g} on {', '.join(lora.targets)} (the other {count(total - trainable)} frozen)")
    else:
        what = "all trainable"
    return (f"shardtrain: {cfg.model.name}, {count(total)} params, {what}; on {jax.device_count()} "
            f"{jax.devices()[0].platform} devices, mesh {dict(prog.mesh.shape)}; compiling...")


def count(n: int) -> str:
    """A parameter count for people: 1.56M, 12.3K, 7.24B."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.{2 if suffix != 'K' else 1}f}{suffix}"
    return str(n)


def _announce(prog: step_lib.Program, sources, lr_line: str) -> None:
    """Process 0's first lines: the run's config file, what trains on which devices, the mode, the
    learning rate, the data."""
    cfg = prog.cfg
    (Path(cfg.run_dir) / "config.yaml").write_text(config_lib.dump(cfg))
    print(model_line(prog), flush=True)
    print(mode_line(prog), flush=True)
    print(lr_line, flush=True)
    print(loader.describe(cfg, sources), flush=True)


def _start(prog: step_lib.Program, ckpt: manager.Checkpointer, init_from) -> tuple[dict, int]:
    """(state, first step): the newest readable checkpoint, else the weights of checkpoint.init_from
    (a resume wins over init_from), else a fresh model from train.seed."""
    cfg = prog.cfg
    restored = ckpt.restore_latest(say=say)
    if restored is None and init_from is not None:
        state = weights.initial_state(prog, init_from)
        say(f"starting from the weights of {init_from.step_dir or init_from.path} (step 0, fresh optimizer state)")
        return state, 0
    if restored is None:
        return prog.init(cfg.train.seed), 0
    state, meta = restored
    start = manager.start_step_from(meta, cfg)
    say(f"resuming from checkpoint step {start} (written on mesh {listing.describe_mesh(meta)}; "
        f"data position {meta['data_position']} samples)")
    return state, start


class StepLog:
    """Logs each step's metrics once the next step is dispatched (reading them waits for their
    step), with the time since the previous step finished (evaluation and saves excluded)."""

    def __init__(self, metrics: Metrics):
        self.metrics, self.pending, self.last_done = metrics, None, time.perf_counter()

    def hold(self, step: int, values: dict) -> None:
        """Logs the step before, then keeps `values` (device arrays) of `step`, just dispatched."""
        self.flush()
        self.pending = (step, values)

    def flush(self) -> None:
        if self.pending is not None:
            values = {k: float(v) for k, v in self.pending[1].items()}  # waits for that step
            now = time.perf_counter()
            self.metrics.log(self.pending[0], values, now - self.last_done)
            self.last_done, self.pending = now, None

    def restart_clock(self) -> None:
        """What ran since the last step (an evaluation, a save's blocking part) is not a step's time."""
        self.last_done = time.perf_counter()


class ProfileWindow:
    """Steps train.profile_steps[0]..[1] (1-based) run inside a jax.profiler trace."""

    def __init__(self, cfg: config_lib.RunConfig):
        self.steps, self.dir, self.tracing = cfg.train.profile_steps, str(Path(cfg.run_dir) / "profile"), False

    def before(self, step: int) -> None:
        if self.steps and not self.tracing and self.steps[0] <= step <= self.steps[1]:
            jax.profiler.start_trace(self.dir)
            self.tracing = True

    def after(self, step: int, state) -> None:
        if self.tracing and step == self.steps[1]:
            jax.block_until_ready(state)
            self.stop()

    def stop(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False


def _run_steps(prog, compiled, state, start, dataset, ckpt, metrics, evaluator, preemption) -> int:
    """The steps start..train.steps: evaluation, checkpoints, a save and exit 75 on preemption."""
    cfg = prog.cfg
    log, profile = StepLog(metrics), ProfileWindow(cfg)
    exit_code = 0
    for i, local_batch in loader.batches(dataset, cfg.train.global_batch_size, prog.local_rows(), start,
                                         cfg.train.steps, loader.read_threads(cfg)):
        done = i + 1
        profile.before(done)
        state, step_metrics = compiled(state, prog.device_batch(local_batch))
        log.hold(done, step_metrics)
        profile.after(done, state)
        if preemption.reached(done):
            log.flush()
            ckpt.save(done, state)
            ckpt.wait()
            metrics.event("preempted", step=done)
            metrics.message(f"preempted at step {done}; rerun the same command to resume")
            exit_code = EXIT_PREEMPTED
            break
        if evaluator and (done % cfg.train.eval_every == 0 or done == cfg.train.steps):
            log.flush()
            metrics.log_eval(done, evaluator(state["params"]))
            log.restart_clock()
        if done % cfg.checkpoint.every_steps == 0 or done == cfg.train.steps:
            log.flush()
            ckpt.save(done, state)
            log.restart_clock()
        ckpt.check()  # a failed async save raises manager.SaveFailed at the next step boundary
    log.flush()
    profile.stop()  # preempted inside the traced steps
    ckpt.wait()
    metrics.summary()  # a finished run's closing line (the ExitStack then closes what was opened)
    return exit_code


def bare_loop_batches(prog: step_lib.Program, steps: int) -> list[jax.Array]:
    """The first `steps` global batches as device arrays (for benchmarks that bypass the loop)."""
    it = loader.batches(loader.samples(prog.cfg), prog.cfg.train.global_batch_size, prog.local_rows(), 0, steps)
    return [prog.device_batch(b) for _, b in it]
