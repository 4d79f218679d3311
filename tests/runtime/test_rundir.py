"""One trainer per run dir (runtime/rundir.py): a held lock refuses a second holder naming it, a
dead owner's lock is taken over with a line, another host's counts until its heartbeat is stale.
The two-trainer run is in tests/checkpoint/test_checkpoint_e2e.py."""

import json
import os
import socket
import subprocess
import time

import pytest

from shardtrain.config import ConfigError
from shardtrain.runtime import rundir


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_held_lock_refuses_a_second_holder_naming_it_and_a_clean_end_leaves_no_owner(tmp_path):
    said = []
    first = rundir.Lock(str(tmp_path), said.append)
    record = rundir.holder(tmp_path / rundir.FILE)
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    with pytest.raises(ConfigError, match=f"run_dir={tmp_path} is being trained by pid {os.getpid()} on host "
                                          f"{socket.gethostname()}, started {record['started']}"):
        rundir.Lock(str(tmp_path), said.append)  # another open file: flock refuses it, even in this process
    first.close()
    assert rundir.holder(tmp_path / rundir.FILE) is None
    rundir.Lock(str(tmp_path), said.append).close()
    assert said == []  # nothing to take over after a clean end


def test_the_lock_of_a_dead_process_is_taken_over_with_a_line(tmp_path):
    pid = dead_pid()
    (tmp_path / rundir.FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "started": "then",
                                                    "heartbeat": time.time()}))
    said = []
    rundir.Lock(str(tmp_path), said.append).close()
    assert said == [f"lock: took over {tmp_path / rundir.FILE} from pid {pid} on host {socket.gethostname()}, "
                    f"started then: it is no longer running (its flock was released)"]


@pytest.mark.parametrize("age, taken", [(5, False), (rundir.STALE_S + 5, True)])
def test_another_hosts_lock_counts_until_its_heartbeat_is_stale(tmp_path, age, taken):
    """Where flock does not reach across hosts, the heartbeat decides."""
    (tmp_path / rundir.FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": "then",
                                                    "heartbeat": time.time() - age}))
    said = []
    if taken:
        rundir.Lock(str(tmp_path), said.append).close()
        assert len(said) == 1 and "from pid 1 on host elsewhere" in said[0] and "heartbeat is 65 s old" in said[0]
    else:
        with pytest.raises(ConfigError, match="being trained by pid 1 on host elsewhere"):
            rundir.Lock(str(tmp_path), said.append)
