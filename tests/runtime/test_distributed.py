"""How `distributed.plan` joins a run from the environment (no processes started), and how a
process of a run of several reports an error and leaves (in a subprocess: it ends with os._exit)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shardtrain.config import ConfigError
from shardtrain.runtime import distributed

SLURM_2_NODES = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[017-018]", "SLURM_NTASKS": "2",
                 "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
                 "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}


def test_explicit_variables_win_and_disable_detection():
    p = distributed.plan({"SHARDTRAIN_COORDINATOR": "10.0.0.1:1234", "SHARDTRAIN_NUM_PROCESSES": "4",
                          "SHARDTRAIN_PROCESS_ID": "3", "SHARDTRAIN_LOCAL_DEVICE_IDS": "0,1", **SLURM_2_NODES})
    assert p.kwargs == dict(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=3,
                            local_device_ids=[0, 1], cluster_detection_method="deactivate")


def test_bad_explicit_variables_name_the_variable():
    with pytest.raises(ConfigError, match="SHARDTRAIN_COORDINATOR is set but SHARDTRAIN_PROCESS_ID is not"):
        distributed.plan({"SHARDTRAIN_COORDINATOR": "h:1", "SHARDTRAIN_NUM_PROCESSES": "2"})
    explicit = {"SHARDTRAIN_COORDINATOR": "h:1", "SHARDTRAIN_NUM_PROCESSES": "2", "SHARDTRAIN_PROCESS_ID": "2"}
    with pytest.raises(ConfigError, match=r"SHARDTRAIN_PROCESS_ID=2 must be in 0..SHARDTRAIN_NUM_PROCESSES-1 \(1\)"):
        distributed.plan(explicit)
    with pytest.raises(ConfigError, match="SHARDTRAIN_LOCAL_DEVICE_IDS='a,b' must be an integer"):
        distributed.plan({**explicit, "SHARDTRAIN_PROCESS_ID": "0", "SHARDTRAIN_LOCAL_DEVICE_IDS": "a,b"})


def test_single_process_needs_nothing():
    assert distributed.plan({}).kwargs == {}  # JAX's detection runs; finding nothing means alone
    assert distributed.plan({"SHARDTRAIN_NUM_PROCESSES": "1", **SLURM_2_NODES}).kwargs is None


def test_slurm_one_task_per_node_keeps_all_gpus():
    """JAX alone would give this task local_device_ids=[SLURM_LOCALID]=[0]: 1 GPU of 8 (jax#16788)."""
    p = distributed.plan(SLURM_2_NODES)
    assert p.kwargs == dict(coordinator_address=f"gpu017:{4242 % 4096 + 61440}", num_processes=2, process_id=1,
                            local_device_ids=None, cluster_detection_method="deactivate")


def test_slurm_one_task_per_gpu():
    env = {**SLURM_2_NODES, "SLURM_NTASKS": "16", "SLURM_PROCID": "13", "SLURM_LOCALID": "5",
           "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "JAX_COORDINATOR_PORT": "7777"}
    p = distributed.plan(env)
    assert (p.kwargs["coordinator_address"], p.kwargs["process_id"], p.kwargs["local_device_ids"]) == \
        ("gpu017:7777", 13, [5])
    # --gpus-per-task=1 binds one GPU per task: it is device 0 of that process, not SLURM_LOCALID.
    assert distributed.plan({**env, "CUDA_VISIBLE_DEVICES": "5"}).kwargs["local_device_ids"] == [0]


def test_slurm_single_task_is_not_distributed():
    env = {**SLURM_2_NODES, "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_STEP_TASKS_PER_NODE": "1"}
    assert distributed.plan(env).kwargs is None


@pytest.mark.parametrize("spec,node,tasks", [("4(x2),2", 0, 4), ("4(x2),2", 1, 4), ("4(x2),2", 2, 2), ("8", 0, 8)])
def test_slurm_tasks_on_node(spec, node, tasks):
    assert distributed.slurm_tasks_on_node({"SLURM_STEP_TASKS_PER_NODE": spec, "SLURM_NODEID": str(node)}) == tasks


@pytest.mark.parametrize("nodes,host", [("node001", "node001"), ("node001,host2", "node001"),
                                        ("node[001-0015],host2", "node001"), ("node[007,009-015]", "node007")])
def test_slurm_coordinator_is_the_first_node(nodes, host):
    assert distributed.slurm_coordinator({"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": nodes}) == f"{host}:61441"


def test_a_lone_process_is_tagged_plainly_and_returns_from_leave():
    assert distributed.initialize({"SHARDTRAIN_NUM_PROCESSES": "1"}) == distributed.LONE
    assert distributed.LONE.tag == "shardtrain" and distributed.Cluster(1, 4).tag == "shardtrain[process 1/4]"
    assert distributed.LONE.leave_after_error(2, wait_for_peers_s=10) is None  # no exit, no barrier


ERROR = {  # what process 1 of 2 raises -> its exit code and what it prints
    "ConfigError('mesh: needs 16 devices')": (2, "shardtrain[process 1/2]: error: mesh: needs 16 devices\n"),
    "jax.errors.JaxRuntimeError('INTERNAL: Gloo connection reset by peer')": (
        distributed.EXIT_PEER_LOST, "shardtrain[process 1/2]: error: a collective with another process failed"),
    "ValueError('bad value')": (distributed.EXIT_ERROR, "shardtrain[process 1/2]: error: ValueError: bad value"),
}


@pytest.mark.parametrize("error", ERROR)
def test_an_error_in_a_run_of_several_is_printed_with_the_process_and_leaves_at_once(error):
    code = f"""
import jax
from shardtrain import cli
from shardtrain.runtime import distributed
from shardtrain.config import ConfigError
with cli.leaving_on_error(distributed.Cluster(1, 2)):
    raise {error}
print("not reached")
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    want_code, want_text = ERROR[error]
    assert r.returncode == want_code and want_text in r.stderr, r.stderr
    assert "not reached" not in r.stdout
    assert ("Traceback" in r.stderr) == (want_code != 2), r.stderr  # a config mistake is one line


def test_a_coordinator_port_in_use_is_one_line_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"coordinator port {port} .*is already in use on this host"):
            distributed.initialize({"SHARDTRAIN_COORDINATOR": f"127.0.0.1:{port}", "SHARDTRAIN_NUM_PROCESSES": "2",
                                    "SHARDTRAIN_PROCESS_ID": "0"})
