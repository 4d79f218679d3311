"""`jax.distributed` initialisation from the environment.

Order (the first that applies wins):
  1. explicit SHARDTRAIN_COORDINATOR / SHARDTRAIN_NUM_PROCESSES / SHARDTRAIN_PROCESS_ID (and
     optional SHARDTRAIN_LOCAL_DEVICE_IDS): what `launch/local.sh` and the GPU JobSet set;
     SHARDTRAIN_NUM_PROCESSES=1 alone forces a single process (no cluster detection);
  2. SLURM: JAX's own SLURM detection gives each process the single GPU `[SLURM_LOCALID]`, which is
     wrong for one task per node (jax#16788, maxtext#865: 1 of 8 GPUs used) and for tasks bound
     to one GPU each by `--gpus-per-task` (GPU 0 is the only one visible there). Both are fixed here;
  3. JAX's cluster detection (Open MPI, Cloud TPU VM, GKE TPU, Kubernetes), in JAX's order;
  4. nothing found: a single process, no initialisation.

When a process dies, the others stop instead of hanging: a collective with the dead process fails
at once when its connections are reset (they then print why and exit with EXIT_PEER_LOST), and
otherwise JAX's coordination service aborts them (SIGABRT, "tasks are unhealthy (stopped sending
heartbeats)") after SHARDTRAIN_HEARTBEAT_TIMEOUT seconds (default 100, like JAX). JAX's runtime
client takes a missed-heartbeat callback, but jax 0.10.2 cannot call a Python one (std::bad_cast).
An uncaught error in one process is printed with its process index, which then exits at once.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import traceback
from collections.abc import Mapping

from shardtrain.config import ConfigError

EXIT_PEER_LOST = 69
"""Exit code of a process that stopped because another process of the run died (EX_UNAVAILABLE)."""
EXIT_ERROR = 1


@dataclasses.dataclass(frozen=True)
class InitPlan:
    """How this process joins the run: `kwargs` for `jax.distributed.initialize`, None = alone."""

    source: str
    kwargs: dict | None


def slurm_tasks_on_node(env: Mapping[str, str]) -> int | None:
    """Tasks of this job step on this node, from SLURM_STEP_TASKS_PER_NODE ("4(x2),2") and SLURM_NODEID."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return int(env["SLURM_NTASKS_PER_NODE"]) if "SLURM_NTASKS_PER_NODE" in env else None
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = int(env.get("SLURM_NODEID", "0"))
    return counts[node] if node < len(counts) else None


def visible_gpus(env: Mapping[str, str]) -> int | None:
    ids = env.get("CUDA_VISIBLE_DEVICES", env.get("ROCR_VISIBLE_DEVICES"))
    return None if ids is None else len([i for i in ids.split(",") if i.strip()])


def slurm_coordinator(env: Mapping[str, str]) -> str:
    """The first node of the step and a port derived from the job id, as JAX's SlurmCluster picks them."""
    port = env.get("JAX_COORDINATOR_PORT") or str(int(env["SLURM_JOB_ID"]) % 2 ** 12 + 65536 - 2 ** 12)
    m = re.match(r"([^,\[]+)(?:\[([^,\-\]]+))?", env["SLURM_STEP_NODELIST"])  # "gpu[017-018],x" -> gpu, 017
    return f"{m.group(1)}{m.group(2) or ''}:{port}"


def slurm_plan(env: Mapping[str, str]) -> InitPlan:
    kwargs = dict(coordinator_address=slurm_coordinator(env),
                  num_processes=int(env["SLURM_NTASKS"]), process_id=int(env["SLURM_PROCID"]),
                  cluster_detection_method="deactivate")
    if slurm_tasks_on_node(env) == 1:
        return InitPlan("slurm, one process per node (all its GPUs)", {**kwargs, "local_device_ids": None})
    if visible_gpus(env) == 1:
        return InitPlan("slurm, one GPU bound per process", {**kwargs, "local_device_ids": [0]})
    return InitPlan("slurm, one process per GPU",
                    {**kwargs, "local_device_ids": [int(env["SLURM_LOCALID"])]})


def plan(env: Mapping[str, str] = os.environ) -> InitPlan:
    """Decides from the environment alone how to initialise (see the module docstring)."""
    if "SHARDTRAIN_COORDINATOR" in env:
        missing = [v for v in ("SHARDTRAIN_NUM_PROCESSES", "SHARDTRAIN_PROCESS_ID") if v not in env]
        if missing:
            raise ConfigError(f"SHARDTRAIN_COORDINATOR is set but {' and '.join(missing)} is not; set all three")
        n, i = _ints(env, "SHARDTRAIN_NUM_PROCESSES")[0], _ints(env, "SHARDTRAIN_PROCESS_ID")[0]
        if not 0 <= i < n:
            raise ConfigError(f"SHARDTRAIN_PROCESS_ID={i} must be in 0..SHARDTRAIN_NUM_PROCESSES-1 ({n - 1})")
        return InitPlan("SHARDTRAIN_* variables", dict(
            coordinator_address=env["SHARDTRAIN_COORDINATOR"], num_processes=n, process_id=i,
            cluster_detection_method="deactivate", local_device_ids=_ints(env, "SHARDTRAIN_LOCAL_DEVICE_IDS") or None))
    if env.get("SHARDTRAIN_NUM_PROCESSES") == "1":
        return InitPlan("SHARDTRAIN_NUM_PROCESSES=1", None)
    slurm_vars = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(v in env for v in slurm_vars):
        # One task: no initialisation, so it keeps all of its GPUs (JAX would keep GPU 0 only).
        return slurm_plan(env) if int(env["SLURM_NTASKS"]) > 1 else InitPlan("slurm, a single task", None)
    return InitPlan("JAX cluster detection", {})


def _ints(env: Mapping[str, str], name: str) -> list[int]:
    """The comma-separated integers in env[name] ([] when unset)."""
    try:
        return [int(x) for x in env.get(name, "").split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{name}={env[name]!r} must be an integer (or a comma-separated list of them)") from None


def initialize(env: Mapping[str, str] = os.environ) -> None:
    """Joins the run described by the environment; does nothing for a lone process."""
    import jax
    p = plan(env)
    if p.kwargs is None:
        return
    global _tag
    if "process_id" in p.kwargs:
        _tag = f"shardtrain[process {p.kwargs['process_id']}/{p.kwargs['num_processes']}]"
    timeout = (_ints(env, "SHARDTRAIN_HEARTBEAT_TIMEOUT") or [100])[0]
    try:
        jax.distributed.initialize(**p.kwargs, heartbeat_timeout_seconds=timeout)
    except ValueError as e:
        if p.kwargs or "coordinator_address should be defined" not in str(e):
            raise
        return  # JAX found no cluster: a single process
    if jax.process_count() > 1:
        _tag = f"shardtrain[process {jax.process_index()}/{jax.process_count()}]"
        sys.excepthook = _report_and_exit
        print(f"{tag()} joined via {p.source}: {jax.local_device_count()} local of {jax.device_count()} devices",
              file=sys.stderr, flush=True)


_tag = "shardtrain"


def tag() -> str:
    """'shardtrain' or, in a run of several processes, 'shardtrain[process i/N]' for messages."""
    return _tag


PEER_FAILURE_SIGNS = ("Gloo", "Connection reset", "connection reset", "heartbeat", "NCCL", "DEADLINE_EXCEEDED")
"""Words in a runtime error that most likely follows from another process's death."""


def _report_and_exit(kind, value, tb) -> None:
    """Uncaught error in a run of several processes: print it with the process index and leave at
    once. A normal exit would wait in JAX's shutdown barrier for peers that are stuck in a collective
    with this process; exiting makes them notice (connection reset, or the heartbeat timeout)."""
    text = "".join(traceback.format_exception(kind, value, tb))
    if kind.__name__ == "JaxRuntimeError" and any(s in str(value) for s in PEER_FAILURE_SIGNS):
        print(f"{text}{tag()}: error: a collective with another process failed ({value}). Another process most "
              f"likely died; its own log says why. Stopping (exit {EXIT_PEER_LOST}).", file=sys.stderr, flush=True)
        leave_after_error(EXIT_PEER_LOST)
    print(f"{text}{tag()}: error: {kind.__name__}: {value}", file=sys.stderr, flush=True)
    leave_after_error(EXIT_ERROR)


def leave_after_error(code: int, wait_for_peers_s: float = 0) -> None:
    """In a run of several processes, exits now: after an error the peers may never reach JAX's
    shutdown barrier, and a normal exit would wait there for minutes. `wait_for_peers_s`: first wait
    that long at a barrier for peers that hit the same error (a config mistake every process finds),
    so none is cut off by the coordinator's exit before it has said so. A lone process returns."""
    if _tag != "shardtrain":
        sys.stdout.flush()
        sys.stderr.flush()
        if wait_for_peers_s:
            from jax._src import distributed as jax_distributed  # the client's barrier with a timeout

            try:
                jax_distributed.global_state.client.wait_at_barrier("shardtrain_error", int(wait_for_peers_s * 1000))
            except Exception:  # a peer did not come (another state, or dead): leave anyway
                pass
        os._exit(code)
