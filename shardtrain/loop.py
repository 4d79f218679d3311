"""The training loop: init or restore -> [batch -> step -> metrics -> checkpoint / preemption]."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from collections import deque
from pathlib import Path

import jax

from models import is_adapter
from shardtrain import config as config_lib, dpo, evaluate, grpo, optim, step as step_lib, weights
from shardtrain.checkpoint import diagnose, listing, local as local_tier, manager
from shardtrain.data import loader, prompts
from shardtrain.metrics import Metrics
from shardtrain.parallel import mesh as mesh_lib, sharding
from shardtrain.runtime import distributed, faults, goodput, health
from shardtrain.runtime.preemption import EXIT_PREEMPTED, Preemption

EXIT_NONFINITE = 65
"""Exit code of a run stopped by a non-finite loss or gradient (train.on_nonfinite=stop, or too many
skips under train.on_nonfinite=skip; EX_DATAERR)."""
SKIP_LIMIT, SKIP_WINDOW = 10, 100
"""train.on_nonfinite=skip stops the run (as `stop` does) at the SKIP_LIMIT-th skipped step among
the last SKIP_WINDOW steps: a run that diverges is not one with a rare bad batch."""


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
    if t.objective == "grpo":
        g = cfg.grpo
        accum += (f"; objective grpo ({g.group_size} samples per prompt, at most {g.max_new_tokens} new tokens at "
                  f"temperature {g.temperature:g}, clip {g.clip:g}, KL {g.kl_coef:g}, {g.epochs_per_batch} updates "
                  "per batch)")
    if t.objective == "dpo":
        d = cfg.dpo
        reference = ("the frozen starting weights" + (" (LoRA adapters off)" if cfg.model.lora.rank else "")
                     if dpo.uses_reference(cfg) else "none")
        accum += f"; objective dpo ({d.loss}, beta {d.beta:g}, reference {reference})"
    quant = f" with {t.quantization} matmuls" if t.quantization != "none" else ""
    return (f"mode: mesh {axes}{f' (dcn {dcn})' if dcn else ''}; remat {t.remat}; compute {t.compute_dtype}{quant}, "
            f"params {t.param_dtype}; {comm}; {pipe}{accum}")


def optimizer_line(prog: step_lib.Program) -> str:
    """One console line: the optimizer, its clipping and its state's size on each device."""
    o = prog.cfg.optimizer
    state_mib = sharding.shard_bytes(prog.abstract_state["opt"]) / 2**20
    return f"optimizer: {o.name} after clipping at global norm {o.grad_clip:g}; {state_mib:.2f} MiB of state per device"


def train(cfg: config_lib.RunConfig, started: float | None = None) -> int:
    """Runs training to cfg.train.steps; returns the process exit code (0, or 75 when preempted:
    SIGTERM or Ctrl-C, runtime/preemption.py). A run whose checkpoints already reach train.steps is
    complete: it says so and returns 0 without touching anything. Closes everything it opened on
    every exit path; raises manager.SaveFailed if a checkpoint save fails, NonFinite when a
    non-finite step stops the run, RunFilesFailed when the run's own files cannot be written, a
    ConfigError (before the first step) having written nothing: no goodput, metrics or config.yaml.
    What the checkpoint library logs goes to run_dir/shardtrain.log. `started`: when this process
    started (time.time(); for the goodput record), default now."""
    committed = listing.committed_steps(cfg)
    if committed and max(committed) >= cfg.train.steps:
        say(f"run {cfg.run_dir} is complete: checkpoint step {max(committed)} reaches train.steps="
            f"{cfg.train.steps}; nothing to do (raise train.steps to continue it)")
        return 0
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as opened:
        # first: a SIGTERM or Ctrl-C while building or compiling stops at once, nothing trained
        preemption = opened.enter_context(contextlib.closing(Preemption(jax.process_index(), jax.process_count())))
        opened.enter_context(manager.library_log(cfg.run_dir))
        clock = opened.enter_context(contextlib.closing(
            goodput.Clock(cfg.run_dir, started or time.time(), write=jax.process_index() == 0)))
        try:
            code = _train(cfg, opened, clock, preemption)
        except config_lib.ConfigError:
            clock.discard()  # refused before the first step: no trace in goodput.jsonl
            raise
        except NonFinite:
            clock.end("nonfinite")
            raise
        clock.end("done" if code == 0 else "preempted")
        return code


def _train(cfg: config_lib.RunConfig, opened: contextlib.ExitStack, clock: goodput.Clock,
           preemption: Preemption) -> int:
    """Build, then compile and start (or resume), then run the steps; `opened` closes what it opens.
    Nothing is written to run_dir before `clock.ready` (goodput.jsonl, config.yaml, metrics.jsonl):
    a ConfigError raised before it leaves the run dir as it was."""
    sources = loader.sources(cfg)  # a missing data path fails before anything is compiled
    cfg = weights.check_tokenizer(cfg, sources)  # the weights' tokenizer is the data's; data.tokenizer recorded
    if cfg.train.objective == "grpo" and prompts.is_jsonl(cfg):  # prompts tokenized by the model's own tokenizer
        sources = [prompts.prompts(cfg, "train", weights.model_tokenizer(cfg))]
    dataset = loader.samples(cfg, sources)
    init_from = weights.find(cfg.checkpoint.init_from) if cfg.checkpoint.init_from else None
    resumed = listing.newest_meta(cfg)
    optim.check_resume(cfg, resumed, listing.directory(cfg))  # another optimizer's state fails here, not at restore
    diagnose.check_changes(cfg, resumed, listing.directory(cfg), say)  # refuses a new function or data; says the rest
    cfg, lr_line = optim.resolve_schedule(cfg, resumed)  # a resume keeps the recorded schedule
    injected = faults.Faults(cfg.run_dir, jax.process_index(), jax.process_count())
    prog = step_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh), nan_at=injected.nan_step())
    evaluator = evaluate.Evaluator(prog) if cfg.train.eval_every else None  # a missing eval split fails here
    if jax.process_index() == 0:
        _announce(prog, sources, lr_line)
    t0 = time.perf_counter()
    compiled = prog.lower().compile()
    distributed.wait_for_peers("shardtrain_compiled", cfg.train.watchdog.startup_s)
    ckpt = opened.enter_context(contextlib.closing(
        manager.Checkpointer(cfg, prog.abstract_state, prog.mesh.shape)))
    local = (opened.enter_context(contextlib.closing(local_tier.LocalTier(cfg, prog.abstract_state)))
             if cfg.checkpoint.local.directory else None)
    state, start, tier, restore_s = _start(prog, ckpt, local, init_from)
    clock.ready(start, restore_s)  # past every check: from here on the run writes its files
    if jax.process_index() == 0:
        (Path(cfg.run_dir) / "config.yaml").write_text(config_lib.dump(prog.cfg))
    say(f"ready in {time.perf_counter() - t0:.1f} s; training steps {start}..{cfg.train.steps}")
    metrics = opened.enter_context(contextlib.closing(Metrics(cfg, prog.flops_per_token, start)))
    if start > 0:
        metrics.event("resume", step=start, tier=tier)
    watchdog = health.Watchdog(cfg.train.watchdog, cfg.run_dir, jax.process_index())
    opened.callback(watchdog.close)
    if cfg.train.objective == "grpo":  # sampling and scoring around the compiled update
        compiled = grpo.Sampler(prog, compiled, clock, sources[0], jax.process_index() == 0)
    run = Run(prog, compiled, ckpt, local, metrics, evaluator, preemption, clock, watchdog, injected)
    code = run.steps(state, start, dataset)
    metrics.goodput(goodput.report(cfg.run_dir) if jax.process_index() == 0 else None)
    if metrics.failed or clock.failed:  # at the last step, after the loop's last look
        raise RunFilesFailed(f"{metrics.failed or clock.failed}; the checkpoints were saved; make room and rerun "
                             f"the same command to finish")
    metrics.summary("preempted" if code == EXIT_PREEMPTED else "done")  # the closing line (then the ExitStack closes)
    return code


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
    """Process 0's first lines: what trains on which devices, the mode, the learning rate, the data."""
    cfg = prog.cfg
    print(model_line(prog), flush=True)
    print(mode_line(prog), flush=True)
    print(optimizer_line(prog), flush=True)
    print(lr_line, flush=True)
    print(loader.describe(cfg, sources), flush=True)


def _start(prog: step_lib.Program, ckpt: manager.Checkpointer, local: local_tier.LocalTier | None,
           init_from) -> tuple[dict, int, str | None, float]:
    """(state, first step, tier, seconds spent restoring): the newest restorable checkpoint of
    either tier, else the weights of checkpoint.init_from (a resume wins over init_from), else a
    fresh model from train.seed."""
    cfg = prog.cfg
    t0 = time.perf_counter()
    restored = local_tier.restore_newest(ckpt, local, say=say)
    restore_s = time.perf_counter() - t0
    if restored is None and init_from is not None:
        state = weights.initial_state(prog, init_from)
        say(f"starting from the weights of {init_from.step_dir or init_from.path} (step 0, fresh optimizer state)")
        start, tier = 0, None
    elif restored is None:
        state, start, tier = prog.init(cfg.train.seed), 0, None
    else:
        state, meta, tier = restored
        start = manager.start_step_from(meta, cfg)
        where = "local tier, " if tier == "local" else ""
        say(f"resuming from checkpoint step {start} ({where}written on mesh {listing.describe_mesh(meta)}; "
            f"data position {meta['data_position']} samples)")
    if local is not None:
        local.forget_after(start)
    return state, start, tier, restore_s


class NonFinite(RuntimeError):
    """A step whose loss or gradient norm is not finite stopped the run: train.on_nonfinite=stop, or
    under `skip` the SKIP_LIMIT-th skip of the last SKIP_WINDOW steps."""

    def __init__(self, step: int, values: dict, skipped: int = 0):
        shown = ", ".join(f"{k} {values[k]}" for k in ("loss", "grad_norm") if k in values)
        why = (f"the {SKIP_LIMIT}th skipped in the last {SKIP_WINDOW} steps: train.on_nonfinite=skip stops there; "
               f"{skipped} skipped in this start" if skipped else
               "train.on_nonfinite=stop; train.on_nonfinite=skip skips such steps")
        super().__init__(f"non-finite loss or gradients at step {step} ({shown}); stopped without saving "
                         f"anything from it ({why})")
        self.step = step


class RunFilesFailed(RuntimeError):
    """A file of the run's own (metrics.jsonl, TensorBoard, goodput.jsonl) could not be written."""


class StepLog:
    """Logs each step's metrics once the next step is dispatched (reading them waits for their
    step), with the time since the previous step finished (evaluation and saves excluded). Reading
    a step's values is where a non-finite step is found, a hang watchdog is told of progress, and
    (at log steps, with several processes) the processes' host times are compared."""

    def __init__(self, metrics: Metrics, cfg: config_lib.RunConfig, watchdog: health.Watchdog):
        self.metrics, self.cfg, self.watchdog = metrics, cfg, watchdog
        self.pending, self.last_done = None, time.perf_counter()
        self.recent: deque[bool] = deque(maxlen=SKIP_WINDOW)  # skipped or not, the last steps
        self.stragglers = health.Stragglers(cfg.train.watchdog, jax.process_count())
        self.host_times: list[float] = []

    def hold(self, step: int, values: dict, host_s: float) -> None:
        """Logs the step before, then keeps `values` (device arrays) of `step`, just dispatched;
        host_s: this process's time to get the step's batch and dispatch it."""
        self.flush()
        self.pending = (step, values)
        self.host_times.append(host_s)

    def flush(self) -> None:
        if self.pending is None:
            return
        step, values = self.pending[0], {k: float(v) for k, v in self.pending[1].items()}  # waits for that step
        now = time.perf_counter()
        step_time, self.last_done, self.pending = now - self.last_done, now, None
        self.watchdog.beat(step, step_time)
        finite = all(math.isfinite(values.get(k, 0.0)) for k in ("loss", "grad_norm"))
        self.recent.append(not finite)
        if not finite:
            if self.cfg.train.on_nonfinite == "stop":
                raise NonFinite(step, values)
            if sum(self.recent) >= SKIP_LIMIT:
                raise NonFinite(step, values, skipped=self.metrics.skipped + 1)
            self.metrics.skip(step)
        extra = self._host_times(step, step_time) if step % self.cfg.train.log_every == 0 else {}
        self.metrics.log(step, values, step_time, extra)

    def _host_times(self, step: int, step_time: float) -> dict:
        """{host_s_max, host_s_median} over the processes; names a straggler once it is one."""
        mine = sum(self.host_times) / max(len(self.host_times), 1)
        self.host_times = []
        if not self.stragglers.on:
            return {}
        times = health.gather_host_times(mine)
        median = statistics.median(times)
        for p in self.stragglers.update(times, step_time):
            self.metrics.event("straggler", step=step, process=p, host_s=times[p], median_host_s=median)
            self.metrics.message(f"straggler: process {p} took {times[p]:.3f} s of host time per step "
                                 f"({times[p] / max(median, 1e-9):.1f}x the median {median:.3f} s) for "
                                 f"{self.cfg.train.watchdog.straggler_logs} log steps")
        return {"host_s_max": max(times), "host_s_median": median, "slowest_process": times.index(max(times))}

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


@dataclasses.dataclass
class Run:
    """What the steps use: the program, checkpoint tiers, metrics, and the watchers."""

    prog: step_lib.Program
    compiled: object
    ckpt: manager.Checkpointer
    local: local_tier.LocalTier | None
    metrics: Metrics
    evaluator: evaluate.Evaluator | None
    preemption: Preemption
    clock: goodput.Clock
    watchdog: health.Watchdog
    faults: faults.Faults

    def steps(self, state, start: int, dataset) -> int:
        """The steps start..train.steps: evaluation, checkpoints, a save and exit 75 on preemption."""
        cfg = self.prog.cfg
        log, profile = StepLog(self.metrics, cfg, self.watchdog), ProfileWindow(cfg)
        exit_code, iteration_end = 0, time.perf_counter()
        for i, local_batch in loader.batches(dataset, cfg.train.global_batch_size, self.prog.local_rows(), start,
                                             cfg.train.steps, loader.read_threads(cfg)):
            done = i + 1
            self.clock.charge("data_wait")
            self.faults.inside_step(done, self.ckpt, self.local)
            profile.before(done)
            batch = local_batch if cfg.train.objective == "grpo" else self.prog.device_batch(local_batch)
            state, step_metrics = self.compiled(state, batch)
            log.hold(done, step_metrics, time.perf_counter() - iteration_end)
            self.clock.step(done)
            profile.after(done, state)
            failed = self.metrics.failed or self.clock.failed
            if failed and not self.preemption.requested:
                self.preemption.request()  # the run's own files: save and stop here
            if self.preemption.reached(done):
                log.flush()
                self.stop(done, state, failed)
                exit_code = EXIT_PREEMPTED
                break
            if self.evaluator and (done % cfg.train.eval_every == 0 or done == cfg.train.steps):
                log.flush()
                with self.watchdog.slow():
                    self.metrics.log_eval(done, self.evaluator(state["params"]))
                self.clock.charge("eval")
                log.restart_clock()
            self.save(done, state, log)
            iteration_end = time.perf_counter()
        log.flush()
        profile.stop()  # preempted inside the traced steps
        with self.watchdog.slow():
            self.ckpt.wait()
            if self.local is not None:
                self.local.wait()
        self.clock.charge("checkpoint_save")
        return exit_code

    def stop(self, done: int, state, failed: str | None) -> None:
        """Saves step `done` and says so: a preemption, or (`failed`) a file of the run's own that
        could not be written, which raises RunFilesFailed once the checkpoint is saved or not."""
        try:
            with self.watchdog.slow():
                self.ckpt.save(done, state)
                self.ckpt.wait()
        except manager.SaveFailed as e:
            if failed:
                raise RunFilesFailed(f"{failed}; stopped at step {done}, and its checkpoint failed too: {e}") from None
            raise
        if failed:
            raise RunFilesFailed(f"{failed}; stopped at step {done} and saved checkpoint step {done}; make room "
                                 f"and rerun the same command to resume")
        self.metrics.event("preempted", step=done)
        self.metrics.message(f"preempted at step {done}: saved checkpoint step {done}; rerun the same command to "
                             f"resume")

    def save(self, done: int, state, log: StepLog) -> None:
        """A persistent checkpoint every checkpoint.every_steps and at the last step, else a local one
        every checkpoint.local.every_steps; never of a step not yet read back (it may be non-finite)."""
        cfg = self.prog.cfg
        persistent = done % cfg.checkpoint.every_steps == 0 or done == cfg.train.steps
        local = self.local is not None and done % cfg.checkpoint.local.every_steps == 0
        if persistent or local:
            log.flush()
            with self.watchdog.slow():
                if persistent:
                    self.ckpt.save(done, state)
                else:
                    self.local.save(done, state, self.ckpt.meta(done))
                    manager.lower_writer_priority(cfg.checkpoint.writer_niceness)
            self.clock.charge("checkpoint_save")
            log.restart_clock()
        self.ckpt.check()  # a failed async save raises manager.SaveFailed at the next step boundary
