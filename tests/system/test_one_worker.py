"""tests/one_worker.py under real xdist: a small suite on 2 workers keeps a group on one worker and
still hands out the other tests (fails if xdist stops calling the private method it overrides)."""

import os
import subprocess
import sys
from pathlib import Path

TEST = '''
import os, pathlib, time, pytest

@pytest.mark.parametrize("i", range(6))
def test_{name}(i):
    time.sleep(0.1)
    pathlib.Path("{ran}", "{name}%d" % i).write_text(os.environ["PYTEST_XDIST_WORKER"])
'''

CONFTEST = '''
import one_worker

def pytest_xdist_make_scheduler(config, log):
    return one_worker.scheduler(config, log, {"test_a.py::": "a"})
'''


def test_a_group_runs_on_one_worker_and_the_rest_spread(tmp_path):
    suite, ran = tmp_path / "suite", tmp_path / "ran"
    suite.mkdir()
    ran.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    for name in "ab":
        (suite / f"test_{name}.py").write_text(TEST.format(name=name, ran=ran))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env["PYTHONPATH"] = str(Path(__file__).parents[1])  # tests/, where one_worker.py is
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                        "loadgroup", "."], cwd=suite, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    workers = {name: {(ran / f"{name}{i}").read_text() for i in range(6)} for name in "ab"}
    assert len(workers["a"]) == 1, workers  # the group: one worker
    assert workers["a"] | workers["b"] == {"gw0", "gw1"}, workers  # the others, one by one: both workers busy
