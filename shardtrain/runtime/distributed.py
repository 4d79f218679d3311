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
An error in one process is printed with its process index, and that process then exits at once:
`initialize` returns the `Cluster` (index, count, message tag) and the CLI hands each error it
catches to `Cluster.report_and_leave`. Nothing here is process-wide state: no global, no excepthook.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import sys
import time
import traceback
from collections.abc import Mapping

from shardtrain.config import ConfigError

EXIT_PEER_LOST = 69
"""Exit code of a process that stopped because another process of the run died (EX_UNAVAILABLE)."""
EXIT_ERROR = 1
COORDINATOR_LINGER_S = 2.0
"""After an error barrier, how long process 0 (the coordination service's host) outlives its peers."""


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


@dataclasses.dataclass(frozen=True)
class Cluster:
    """This process's place in the run, as `initialize` found it (a lone process: 0 of 1). The CLI
    keeps it and hands it to what prints errors or has to leave after one."""

    process_index: int = 0
    process_count: int = 1

    @property
    def several(self) -> bool:
        return self.process_count > 1

    @property
    def tag(self) -> str:
        """'shardtrain' or, in a run of several processes, 'shardtrain[process i/N]' for messages."""
        return f"shardtrain[process {self.process_index}/{self.process_count}]" if self.several else "shardtrain"

    def report_and_leave(self, error: BaseException) -> None:
        """An error in a run of several processes: print it with the process index and leave at once
        (`leave_after_error`). A ConfigError (a mistake every process finds) is one line, exit 2;
        a failed collective most likely means another process died (EXIT_PEER_LOST)."""
        if isinstance(error, ConfigError):
            print(f"{self.tag}: error: {error}", file=sys.stderr, flush=True)
            self.leave_after_error(2, wait_for_peers_s=30)
        text = "".join(traceback.format_exception(error))
        kind = type(error).__name__
        if kind == "JaxRuntimeError" and any(s in str(error) for s in PEER_FAILURE_SIGNS):
            print(f"{text}{self.tag}: error: a collective with another process failed ({error}). Another process "
                  f"most likely died; its own log says why. Stopping (exit {EXIT_PEER_LOST}).",
                  file=sys.stderr, flush=True)
            self.leave_after_error(EXIT_PEER_LOST)
        print(f"{text}{self.tag}: error: {kind}: {error}", file=sys.stderr, flush=True)
        self.leave_after_error(EXIT_ERROR)

    def leave_after_error(self, code: int, wait_for_peers_s: float = 0) -> None:
        """In a run of several processes, exits now: after an error the peers may never reach JAX's
        shutdown barrier, and a normal exit would wait there for minutes. `wait_for_peers_s`: first
        wait that long at a barrier for peers that hit the same error (a config mistake every process
        finds), so none is cut off by the coordinator's exit before it has said so. A lone process returns."""
        if not self.several:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        if wait_for_peers_s:
            import orbax.checkpoint as ocp  # JAX's own API has no barrier with a timeout; orbax's wraps the client's

            try:
                ocp.multihost.get_barrier_sync_fn()(key="shardtrain_error", timeout_ms=int(wait_for_peers_s * 1000))
            except Exception:  # a peer did not come (another state, or dead): leave anyway
                pass
            else:
                if self.process_index == 0:  # hosts the coordination service: a peer released by the same
                    time.sleep(COORDINATOR_LINGER_S)  # barrier that still sees it go aborts (exit 134)
        os._exit(code)


LONE = Cluster()


def wait_for_peers(key: str, timeout_s: float) -> None:
    """A barrier of every process through JAX's coordination service (no device collective), so
    that a process that compiled slower (a loaded host, a cold compile cache after a restart) does
    not make the first collective with it time out (gloo gives up after 30 s). Once per `key`."""
    import jax
    if jax.process_count() > 1:
        import orbax.checkpoint as ocp  # JAX's own API has no barrier with a timeout; orbax's wraps the client's
        ocp.multihost.get_barrier_sync_fn()(key=key, timeout_ms=int(timeout_s * 1000))


def check_port_free(address: str, source: str) -> None:
    """Process 0 hosts the coordination service at `address`: a port already in use there (another
    job's coordinator) is one line here, not a SIGSEGV inside jax.distributed.initialize."""
    port = int(address.rpartition(":")[2])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection's TIME_WAIT is no user
        try:
            s.bind(("", port))
        except OSError as e:
            raise ConfigError(f"coordinator port {port} ({address}, from {source}) is already in use on this host "
                              f"({e.strerror}): another job's coordinator? give this job a free port") from None


def initialize(env: Mapping[str, str] = os.environ) -> Cluster:
    """Joins the run described by the environment and says where this process stands in it;
    does nothing for a lone process (LONE)."""
    import jax
    p = plan(env)
    if p.kwargs is None:
        return LONE
    if p.kwargs.get("process_id") == 0 and p.kwargs.get("coordinator_address"):
        check_port_free(p.kwargs["coordinator_address"], p.source)
    timeout = (_ints(env, "SHARDTRAIN_HEARTBEAT_TIMEOUT") or [100])[0]
    try:
        jax.distributed.initialize(**p.kwargs, heartbeat_timeout_seconds=timeout)
    except ValueError as e:
        if p.kwargs or "coordinator_address should be defined" not in str(e):
            raise
        return LONE  # JAX found no cluster: a single process
    cluster = Cluster(jax.process_index(), jax.process_count())
    if cluster.several:
        print(f"{cluster.tag} joined via {p.source}: {jax.local_device_count()} local of {jax.device_count()} devices",
              file=sys.stderr, flush=True)
    return cluster


PEER_FAILURE_SIGNS = ("Gloo", "Connection reset", "connection reset", "heartbeat", "NCCL", "DEADLINE_EXCEEDED")
"""Words in a runtime error that most likely follows from another process's death."""
