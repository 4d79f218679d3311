"""8 simulated CPU devices for every test, requested before jax is imported."""

import os
import sys
import tempfile

FAST_COMPILE = "--xla_backend_optimization_level=0"
"""The tests compile hundreds of small programs, and LLVM's code optimization, not the program,
dominates that time (2.4x less CPU without it on tests/test_program.py + test_sharding.py). The
lowered program is the same; every comparison a test makes runs under the same flag. Runs outside
the tests (make train, bench/) keep XLA's default."""
_flags = os.environ.get("XLA_FLAGS", "").split()  # make test's workers inherit the flags their parent added
os.environ["XLA_FLAGS"] = " ".join(_flags + [f for f in (FAST_COMPILE, "--xla_force_host_platform_device_count=8")
                                             if f not in _flags])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("SHARDTRAIN_NUM_PROCESSES", "1")  # in-process CLI calls: no cluster detection
if "PYTEST_XDIST_WORKER" in os.environ:  # make test's workers: a persistent compile cache each (JAX writes
    # entries in place, so a worker could read one another worker is writing); subprocesses inherit it
    worker = os.environ["PYTEST_XDIST_WORKER"]
    os.environ["XDG_CACHE_HOME"] = os.path.join(tempfile.gettempdir(), f"shardtrain-tests-{worker}")

import jax  # noqa: E402
import one_worker  # noqa: E402
import pytest  # noqa: E402

from shardtrain import config  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's bench/
from bench.harness import bare_loop_batches  # noqa: E402

pytest_plugins = ["prepared_data"]  # the prepared token data's fixtures (tests/prepared_data.py), for any test

TINY = ["model.d_model=32", "model.n_layers=2", "model.d_ff=64", "data.seq_len=16", "train.global_batch_size=8",
        "data.source=synthetic"]
"""Overrides of a model and run small enough for any test (`from conftest import TINY`); a test adds
or overrides what it needs after them (later overrides win)."""


def run_steps(prog, steps: int) -> tuple[dict, list[float]]:
    """(the state after, each step's loss) of `steps` steps of a step.Program from its fresh state,
    outside the trainer's loop (`from conftest import run_steps`)."""
    state, losses = prog.init(prog.cfg.train.seed), []
    for batch in bare_loop_batches(prog, steps):
        state, metrics = prog.step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def cli_env(**extra: str) -> dict:
    """The environment for a CLI subprocess that sets its own device count (`--devices`, the mesh's):
    XLA_FLAGS keeps FAST_COMPILE only."""
    return {**os.environ, "XLA_FLAGS": FAST_COMPILE, **extra}


@pytest.fixture
def cfg_factory(tmp_path):
    """cfg_factory('mesh.data=2', ...) -> a small RunConfig writing under tmp_path."""
    def make(*overrides, path=None):
        return config.load(path, [f"run_dir={tmp_path / 'run'}", *overrides])
    return make


def pytest_collection_modifyitems(items):
    assert jax.device_count() == 8, "tests need 8 simulated devices (XLA_FLAGS set too late?)"


# Under `pytest -n N --dist loadgroup` (make test), the tests named here run on one worker, so that what they
# share is built once, not once per worker (tests/one_worker.py says why not `xdist_group` marks).
# A prefix of a node id -> what its tests share.
ONE_WORKER = {
    "tests/system/test_multihost.py::": "the one- and two-process runs",
    "tests/checkpoint/test_checkpoint_e2e.py::": "the uninterrupted run",
    "tests/test_step.py::": "the single-device reference step",
    "tests/plan/test_planner.py::": "planned()",
    "tests/test_step_packed.py::": "packed_loss()",
    "tests/parallel/test_pipeline.py::": "mlp_reference",
    "tests/system/test_scale.py::": "small",
    "tests/data/test_chat.py::": "chat_data",
    **{f"tests/plan/test_plan_tpu.py::{name}": "planned() (three TPU compiles)" for name in (
        "test_config_hardware_plans_on_the_tpu_compiler_without_flags",
        "test_tpu_argument_bytes_are_the_analytical_shard_bytes",
        "test_tpu_fsdp_gathers_weights_and_reduce_scatters_gradients", "test_tpu_estimate_is_within_the_chip",
        "test_parallel_tpu_plans_keep_the_compilation_cache_off_until_the_last_one_ends")},
}


def pytest_xdist_make_scheduler(config, log):
    return one_worker.scheduler(config, log, ONE_WORKER) if config.getvalue("dist") == "loadgroup" else None
