"""README.md's table of shipped configs is bench/plan_table.py's, from the newest plan records
(bench/results/plan_table.jsonl): no figure in it is typed by hand, and a config added or changed
without planning it again fails here, naming the command. Nothing is compiled."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))  # plan_table.py starts with `import harness`, as a script does
import plan_table  # noqa: E402

RECORDS = REPO / "bench" / "results" / "plan_table.jsonl"


def test_every_shipped_config_with_hardware_has_a_record():
    configs = plan_table.shipped_configs(REPO)
    assert "meshes/llama3_70b_tpu7x_128.yaml" in configs and "meshes/demo.yaml" not in configs
    missing = [c for c in configs if c not in plan_table.newest(RECORDS)]
    assert not missing, (f"no plan record of {', '.join(missing)}; run "
                         f"`{plan_table.COMMAND} --configs {' '.join(missing)}` and commit its records and README.md")


def test_readme_table_is_rendered_from_the_newest_records():
    configs = plan_table.shipped_configs(REPO)
    records = plan_table.newest(RECORDS)
    expected = plan_table.table({c: records[c] for c in configs if c in records}, [c for c in configs if c in records])
    readme = (REPO / "README.md").read_text()
    assert plan_table.readme_table(readme) == expected, \
        f"README.md's table of shipped configs is not the records' (hand-edited?); run `{plan_table.COMMAND} --readme`"


def test_the_newest_record_wins_and_failures_show():
    base = {"chip": "tpu7x", "topology": "4x4x8", "slices": 1}
    ok = {**base, "devices": 256, "chips": 128, "mesh": {"fsdp": 256}, "dcn_axes": [], "fits": False,
          "memory_bytes": {"arguments": 2 ** 30, "temp": 200 * 2 ** 30, "total": 201 * 2 ** 30, "limit": 96 * 2 ** 30},
          "step_time_s": 0.5, "mfu": 0.4, "bottleneck": "compute", "compile_s": 12.3}
    assert plan_table.row("meshes/x.yaml", ok) == ("| `meshes/x.yaml` | 128 tpu7x (4x4x8), 256 devices | fsdp 256 | "
                                                   "**does not fit**: 1.00 + 200.00 = 201.00 GiB of 96 | 500 ms | "
                                                   "40.0% | compute | 12 |")
    failed = plan_table.row("meshes/x.yaml", {**base, "error": "ConfigError: a | b"})
    assert "**did not plan**: ConfigError: a / b" in failed and failed.count(" | ") == 7


def test_newest_keeps_the_last_line_of_each_config(tmp_path):
    path = tmp_path / "plan_table.jsonl"
    path.write_text('{"config": "a", "figures": {"n": 1}}\n{"config": "b", "figures": {"n": 2}}\n'
                    '{"config": "a", "figures": {"n": 3}}\n')
    assert plan_table.newest(path) == {"a": {"n": 3}, "b": {"n": 2}}
