"""metrics.jsonl across a resume."""

import json

from shardtrain import metrics


def test_resumed_metrics_keep_each_step_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 1.0 / s} for s in range(1, 7)] + [{"event": "resume", "step": 4}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "lo')  # cut by kill -9
    metrics.drop_rows_after(path, 4)
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r.get("step") for r in kept] == [1, 2, 3, 4, 4] and kept[-1]["event"] == "resume"
