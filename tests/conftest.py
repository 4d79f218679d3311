"""8 simulated CPU devices for every test, requested before jax is imported."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("SHARDTRAIN_NUM_PROCESSES", "1")  # in-process CLI calls: no cluster detection

import jax  # noqa: E402
import pytest  # noqa: E402

from shardtrain import config  # noqa: E402

TINY = ["model.d_model=32", "model.n_layers=2", "model.d_ff=64", "data.seq_len=16", "train.global_batch_size=8",
        "data.source=synthetic"]
"""Overrides of a model and run small enough for any test (`from conftest import TINY`); a test adds
or overrides what it needs after them (later overrides win)."""


@pytest.fixture
def cfg_factory(tmp_path):
    """cfg_factory('mesh.data=2', ...) -> a small RunConfig writing under tmp_path."""
    def make(*overrides, path=None):
        return config.load(path, [f"run_dir={tmp_path / 'run'}", *overrides])
    return make


def pytest_collection_modifyitems(items):
    assert jax.device_count() == 8, "tests need 8 simulated devices (XLA_FLAGS set too late?)"
