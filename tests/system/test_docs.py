"""Every command in the docs works as pasted. The code blocks of README.md, launch/README.md and
bench/README.md are scanned for `shardtrain ...`, `make ...`, `launch/...` (and cluster tools) lines;
each one is checked, so a README section added later is tested without touching this file.

How a command is run (kept cheap: this suite runs in CI on 2 cores):
- `shardtrain train|plan`: the CLI's parser, the config with the command's overrides, the mesh for
  the device count the command implies (`--devices N`, `XLA_FLAGS=...device_count=N`, else 8), the
  shardings and a trace of the train step on an abstract mesh: every user error the command can hit
  before compiling (exit 2). Other subcommands: parsed, and their config loaded if they take one.
  The slow test runs the first command of each subcommand for real (train: train.steps=2, a tmp
  run_dir, then `shardtrain ckpt` on it), in a mirror of the checkout so relative outputs land in
  tmp; SHARDTRAIN_DOCS_ALL=1 runs every command for real (`plan --search` and local.sh included).
- `launch/tpu_vm.sh --dry-run` runs as it is; `launch/local.sh` is checked like the `shardtrain train`
  it starts (tests/system/test_multihost.py runs it end to end; SHARDTRAIN_DOCS_ALL=1 here too).
- `make train` / `make test` are what CI itself runs, so they are not rerun here.
Markers, as a trailing comment on the command's line in the README:
- `# not run here: REASON` for what needs hardware or a cluster (a TPU VM, SLURM, GKE);
- `# fails: exit N` for a command shown to fail; it must exit N.
Placeholders (TPU_NAME, ZONE, CONFIG, N, ID) are filled in by PLACEHOLDERS below.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env

REPO = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "launch/README.md", "bench/README.md"]
PLACEHOLDERS = {"TPU_NAME": "my-tpu", "ZONE": "us-central2-b", "CONFIG": "meshes/demo.yaml", "N": "2",
                "ID": "my-project"}
CLUSTER_TOOLS = ("sbatch", "srun", "kubectl", "gcloud", "docker")
NOT_RERUN = {"make train", "make test", "make test-fast", "make lint"}  # CI runs these itself
FAST_TRAIN = ["train.steps=2", "checkpoint.every_steps=1000", "train.compile_cache=false"]


@dataclasses.dataclass
class Command:
    doc: str
    line: int
    text: str  # as written, continuation lines joined
    comment: str  # the trailing comment

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def words(self) -> list[str]:
        return [PLACEHOLDERS.get(w, w) for w in shlex.split(self.text)]

    @property
    def env(self) -> dict[str, str]:
        env = {}
        for w in self.words:
            if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", w):
                break
            key, _, value = w.partition("=")
            env[key] = value
        return env

    @property
    def argv(self) -> list[str]:
        words = self.words[len(self.env):]
        return ["shardtrain", *words[1:]] if words[0] in (".venv/bin/shardtrain",) else words

    @property
    def marker(self) -> str | None:
        m = re.match(r"(not run here|fails)\b", self.comment)
        return m and m[1]


def code_lines(text: str):
    """(line number, line) of every line inside fenced or 4-space indented code blocks."""
    fenced, previous_blank = False, True
    indented = False
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            yield i, line
            continue
        if line.startswith("    ") and (previous_blank or indented):
            indented = True
            yield i, line[4:]
        elif line.strip():
            indented = False
        previous_blank = not line.strip()


def is_command(words: list[str]) -> bool:
    words = [w for w in words if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", w)]
    if not words:
        return False
    first = words[0]
    return (first in ("shardtrain", ".venv/bin/shardtrain", "make") or first.startswith("launch/")
            or first in CLUSTER_TOOLS)


def collect() -> list[Command]:
    commands = []
    for doc in DOCS:
        lines = list(code_lines((REPO / doc).read_text()))
        i = 0
        while i < len(lines):
            start, text = lines[i]
            while text.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text.rstrip()[:-1] + " " + lines[i][1].strip()
            i += 1
            code, _, comment = text.partition(" #")
            code = code.strip()
            if code.startswith("$ "):
                code = code[2:]
            try:
                words = shlex.split(code)
            except ValueError:
                continue
            if not words or not is_command(words):
                continue
            if re.search(r"\[-|\.\.\.\]|\[KEY", code):  # a usage synopsis (`[--dry-run] ... [KEY=VALUE ...]`)
                continue
            commands.append(Command(doc, start, code, comment.strip()))
    return commands


COMMANDS = collect()


def kind(c: Command) -> str:
    argv = c.argv
    if c.marker == "not run here":
        return "not run here"
    if argv[0] in CLUSTER_TOOLS or (argv[0] == "launch/tpu_vm.sh" and "--dry-run" not in argv):
        return "unmarked cluster command"
    if " ".join(argv[:2]) in NOT_RERUN:
        return "run by CI"
    if argv[0] == "make":
        return "make"
    if argv[0] == "shardtrain":
        return f"shardtrain {argv[1]}" + (" --search" if "--search" in argv else "")
    return argv[0]


def test_the_docs_commands_are_collected():
    kinds = {kind(c) for c in COMMANDS}
    assert {"shardtrain train", "shardtrain plan", "shardtrain plan --search", "launch/local.sh",
            "launch/tpu_vm.sh", "run by CI", "not run here"} <= kinds, kinds
    assert len(COMMANDS) >= 20


@pytest.mark.parametrize("c", [c for c in COMMANDS if kind(c) == "unmarked cluster command"] or [None],
                         ids=lambda c: c.id if c else "none")
def test_cluster_commands_are_marked_not_run_here(c):
    assert c is None, f"{c.id}: `{c.text}` needs a cluster: add `# not run here: REASON` to its line"


def test_python_commands_name_the_projects_venv():
    for doc in DOCS:
        for i, line in code_lines((REPO / doc).read_text()):
            assert not re.match(r"\s*python3? ", line), f"{doc}:{i}: `{line.strip()}`: write .venv/bin/python"


# ----------------------------------------------------------------------------- shardtrain train / plan


def devices_of(c: Command) -> int:
    argv = c.argv
    if "--devices" in argv:
        return int(argv[argv.index("--devices") + 1])
    m = re.search(r"device_count=(\d+)", c.env.get("XLA_FLAGS", ""))
    return int(m[1]) if m else 8


def check_statically(c: Command, tmp_path) -> None:
    """What the command does before it compiles, on an abstract mesh of its device count. Raises
    ConfigError where the CLI would exit 2."""
    from jax.sharding import AbstractMesh, AxisType

    from shardtrain import cli, config, step
    from shardtrain.data import loader
    from shardtrain.parallel import mesh as mesh_lib

    argv = c.argv
    if argv[0] == "launch/local.sh":  # N processes of one `shardtrain train CONFIG ...` on 8 devices
        argv = argv[2:] if argv[1] != "--restarts" else argv[4:]
        argv = ["shardtrain", "train", *argv]
    try:
        args = cli.parse(argv[1:])
    except SystemExit as e:  # argparse: an unknown subcommand or option
        raise AssertionError(f"{c.id}: `{c.text}`: the CLI rejects its arguments (exit {e.code})") from None
    if args.command == "plan" and args.devices is not None and args.devices < 1:
        raise config.ConfigError("--devices")
    if not hasattr(args, "config") or args.command not in ("train", "plan"):
        if getattr(args, "config", None) is not None:  # another subcommand that reads a config
            config.load(args.config, getattr(args, "overrides", None) or [])
        return
    cfg = config.load(args.config, [*args.overrides, f"run_dir={tmp_path / 'run'}"])
    if args.command == "train":
        loader.samples(cfg)
    if args.command == "plan" and args.search:
        return  # the search itself lists what does not build
    n = devices_of(c)
    if args.command == "plan":  # a TPU topology (hardware: or --topology) has its own chip count
        from shardtrain.plan import planner, topology
        hw = planner.hardware(cfg, args.chip, args.topology, args.slices)
        n = topology.chip_count(hw.topology, hw.slices) if hw.topology else n
    sizes = mesh_lib.resolve_sizes(cfg.mesh, n)
    axes = config.MESH_AXES
    mesh = AbstractMesh(tuple(sizes[a] for a in axes), axes, axis_types=(AxisType.Auto,) * len(axes))
    prog = step.build(cfg, mesh)
    prog.step.trace(prog.abstract_state, prog.abstract_batch())


STATIC = [c for c in COMMANDS if kind(c).startswith("shardtrain ") or kind(c) == "launch/local.sh"]


@pytest.mark.parametrize("c", STATIC, ids=lambda c: c.id)
def test_documented_shardtrain_command_builds(c, tmp_path):
    from shardtrain.config import ConfigError
    if c.marker == "fails":
        with pytest.raises(ConfigError):
            check_statically(c, tmp_path)
    else:
        check_statically(c, tmp_path)


# ----------------------------------------------------------------------------- run as pasted


def mirror(tmp_path: Path) -> Path:
    """A directory that looks like the checkout (its entries symlinked), so that what a command
    writes to a relative path (runs/..., an output directory) lands in tmp, not in the repo."""
    root = tmp_path / "checkout"
    root.mkdir()
    for p in REPO.iterdir():
        if p.name == "meshes":  # copied: `plan --search --write meshes/NEW.yaml` writes there
            shutil.copytree(p, root / p.name)
        elif p.name not in (".git", ".venv", "runs"):
            (root / p.name).symlink_to(p)
    return root


def run(c: Command, extra=(), timeout=900, cwd=REPO):
    argv = c.argv
    if argv[0] == "shardtrain":
        argv = [sys.executable, "-m", "shardtrain.cli", *argv[1:]]
    env = cli_env()
    env |= {"JAX_PLATFORMS": "cpu", "SHARDTRAIN_CMD": f"{sys.executable} -m shardtrain.cli",
            "SHARDTRAIN_HEARTBEAT_TIMEOUT": "100",  # local.sh's 10 s misfires when CI's 2 cores compile twice
            **c.env}
    return subprocess.run([*argv, *extra], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def expect(c: Command, r) -> None:
    want = re.search(r"fails: exit (\d+)", c.comment)
    if want:
        assert r.returncode == int(want[1]), f"{c.id}: `{c.text}` exit {r.returncode}, want {want[1]}"
        assert "Traceback" not in r.stderr
    else:
        assert r.returncode == 0, f"{c.id}: `{c.text}` exit {r.returncode}:\n{r.stderr[-3000:]}"


LAUNCH = [c for c in COMMANDS if kind(c) in ("launch/tpu_vm.sh",)]


@pytest.mark.parametrize("c", LAUNCH, ids=lambda c: c.id)
def test_documented_dry_run_works(c):
    r = run(c, timeout=60)
    expect(c, r)
    assert "gcloud compute tpus tpu-vm ssh" in r.stdout
    install = [line for line in r.stdout.splitlines() if "pip install" in line]
    config = next(w for w in c.argv if w.endswith(".yaml"))
    gs = "gs://" in c.text or re.search(r"^[^#\n]*gs://", (REPO / config).read_text(), re.M)
    assert install and all(("[gcs]" in line) == bool(gs) for line in install), install


MAKE = [c for c in COMMANDS if kind(c) == "make"]


@pytest.mark.parametrize("c", MAKE, ids=lambda c: c.id)
def test_documented_make_target_works(c):
    expect(c, run(c, timeout=300))


def runnable() -> list[Command]:
    """Every shardtrain and local.sh command with SHARDTRAIN_DOCS_ALL=1; otherwise the first of each
    kind (`shardtrain train`, `shardtrain plan`, `shardtrain SUBCOMMAND`): the static test covers
    the rest up to compiling."""
    wanted = [c for c in COMMANDS if (kind(c).startswith("shardtrain ") or kind(c) == "launch/local.sh")
              and c.marker != "fails"]
    if os.environ.get("SHARDTRAIN_DOCS_ALL"):
        return wanted
    # tests/system/test_multihost.py runs local.sh end to end already; a search compiles every mesh
    wanted = [c for c in wanted if kind(c) != "launch/local.sh" and not kind(c).endswith("--search")]
    firsts: dict[str, Command] = {}
    for c in wanted:
        firsts.setdefault(kind(c), c)
    return list(firsts.values())


@pytest.mark.slow
@pytest.mark.parametrize("c", runnable(), ids=lambda c: c.id)
def test_documented_command_runs(c, tmp_path):
    argv = c.argv
    extra = []
    if argv[0] == "launch/local.sh" or argv[:2] == ["shardtrain", "train"]:
        extra = [*FAST_TRAIN, f"run_dir={tmp_path / 'run'}"]
    r = run(c, extra, cwd=mirror(tmp_path))
    expect(c, r)
    if argv[:2] == ["shardtrain", "train"]:
        assert "mode: mesh " in r.stdout and "loss plot: " in r.stdout
        listing = subprocess.run([sys.executable, "-m", "shardtrain.cli", "ckpt", str(tmp_path / "run")],
                                 cwd=REPO, capture_output=True, text=True, timeout=120)
        assert listing.returncode == 0 and "committed" in listing.stdout, listing.stderr


OWN_SOURCE = [c for c in COMMANDS if c.doc == "README.md" and ("what `make train` runs" in c.comment or
                                                             "data.path=runs/own-source " in c.text or
                                                             "--out runs/own-source " in c.text)]
"""`make train`'s command, then README's "own source" prepare and train commands, in the README's order."""
SMALL = ["model.d_model=32", "model.n_layers=1", "model.d_ff=64", "data.seq_len=32", "train.global_batch_size=8",
         "train.eval_steps=2"]


@pytest.mark.slow
def test_own_source_commands_run_as_pasted_right_after_make_train(tmp_path):
    """Commands that share a checkout's relative paths run in the README's order, in one mirror: the
    own-source training used to default to make train's runs/demo (`nothing to do`, and with more
    train.steps a model of another vocabulary size). Small model and 2 steps: the order is the test."""
    assert [kind(c) for c in OWN_SOURCE] == ["shardtrain train", "shardtrain prepare", "not run here"], OWN_SOURCE
    root = mirror(tmp_path)
    for c in OWN_SOURCE:
        r = run(c, [*FAST_TRAIN, *SMALL] if c.argv[1] == "train" else [], cwd=root)
        expect(c, r)
        assert "nothing to do" not in r.stdout and "resuming" not in r.stdout, r.stdout
    assert (root / "runs" / "demo" / "checkpoints" / "2").is_dir()
    assert (root / "runs" / "own-source-run" / "checkpoints" / "2").is_dir()


def test_bench_overhead_help_is_argparse():
    r = subprocess.run([sys.executable, "bench/overhead.py", "--help"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: overhead.py") and "Traceback" not in r.stderr
