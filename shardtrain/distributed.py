"""`jax.distributed` initialisation from the environment.

Order: explicit SHARDTRAIN_* variables, then JAX's own cluster detection (Cloud TPU, SLURM,
Open MPI, GKE); a single process needs nothing.
"""

from __future__ import annotations

import os

import jax


def initialize() -> None:
    env = os.environ
    if "SHARDTRAIN_COORDINATOR" in env:
        local = env.get("SHARDTRAIN_LOCAL_DEVICE_IDS")
        jax.distributed.initialize(
            coordinator_address=env["SHARDTRAIN_COORDINATOR"],
            num_processes=int(env["SHARDTRAIN_NUM_PROCESSES"]),
            process_id=int(env["SHARDTRAIN_PROCESS_ID"]),
            local_device_ids=[int(i) for i in local.split(",")] if local else None,
            heartbeat_timeout_seconds=int(env.get("SHARDTRAIN_HEARTBEAT_TIMEOUT", "30")),
        )
