"""`shardtrain train | plan | prepare | eval | ckpt | goodput | import-hf | export-hf | generate`. Mistakes in user
input exit 2 with one message, no traceback."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from shardtrain import config as config_lib
from shardtrain.runtime import distributed

DEFAULT_CPU_DEVICES = 8


def simulated_devices(n: int) -> None:
    """Asks for `n` CPU devices unless XLA_FLAGS already does; must run before jax is imported.
    Accelerators, when present, are used instead (the flag only affects the host platform)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def skip_absent_accelerators() -> None:
    """With libtpu or jax's CUDA plugin installed (the `tpu` / `gpu` extras, for planning) but no TPU or
    GPU here, jax would try to start their backends and print tracebacks (the CUDA plugin's cuInit
    check) and libtpu's warnings, and libtpu would hold its lockfile so that compiling for a TPU topology
    fails; ask for the CPU instead (compile-only TPU and GPU devices still work). Must run before jax is
    imported; JAX_PLATFORMS set by the user wins, and machines with a TPU or a GPU are left alone."""
    import importlib.util

    from shardtrain.plan import topology
    if "JAX_PLATFORMS" in os.environ or topology.tpu_present() or topology.gpu_present():
        return
    if importlib.util.find_spec("libtpu") or topology.cuda_plugin_installed():
        os.environ["JAX_PLATFORMS"] = "cpu"


def prepare_dir(path: str, field_name: str) -> None:
    """Creates a local output directory and checks that it can be written, so that a run_dir that
    is a file or read-only stops before anything is compiled. gs:// paths are left to orbax."""
    if config_lib.is_url(path):
        return
    p = Path(path)
    blocker = next((q for q in [p, *p.parents] if q.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise config_lib.ConfigError(
            f"{field_name}={path}: '{blocker}' is a file, not a directory; pick another {field_name}")
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise config_lib.ConfigError(f"{field_name}={path}: cannot write there ({e.strerror or e}); "
                                     f"pick a directory you can write, e.g. {field_name}=/tmp/run") from None


def mesh_devices(cfg: config_lib.RunConfig) -> int:
    """The device count a mesh asks for (the CLI's default when one axis is -1)."""
    return cfg.mesh.device_count(DEFAULT_CPU_DEVICES)


def stop_before_training(signum, _frame) -> None:
    """SIGINT or SIGTERM before the run handles them (runtime/preemption.py): nothing to save."""
    from shardtrain.runtime.preemption import EXIT_PREEMPTED
    print(f"\nshardtrain: {signal.Signals(signum).name} before training started: nothing was trained; stopping "
          f"(exit {EXIT_PREEMPTED})", file=sys.stderr, flush=True)
    os._exit(EXIT_PREEMPTED)


@contextlib.contextmanager
def stopping_before_training():
    """Within the block SIGINT and SIGTERM stop the process at once (loop.train installs the run's
    own handling inside it); a signal ignored from the start stays ignored."""
    main = threading.current_thread() is threading.main_thread()  # only it may set handlers
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM) if main}
    previous = {sig: h for sig, h in previous.items() if h not in (signal.SIG_IGN, None)}  # None: not Python's
    for sig in previous:
        signal.signal(sig, stop_before_training)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def cmd_train(args) -> int:
    with stopping_before_training():
        return train(args)


def train(args) -> int:
    started = time.time()
    cfg = config_lib.load(args.config, args.overrides)
    if cfg.checkpoint.init_from and Path(cfg.checkpoint.init_from).resolve() == Path(cfg.run_dir).resolve():
        raise config_lib.ConfigError(f"run_dir={cfg.run_dir} is checkpoint.init_from itself, so the run would resume "
                                     "from those weights' checkpoint; give the run its own run_dir=DIR")
    from shardtrain.parallel import sharding
    sharding.check_adapters(cfg)  # the LoRA targets against the model, before anything is written
    if cfg.checkpoint.init_from:
        from shardtrain import weights
        weights.find(cfg.checkpoint.init_from)  # a missing or unreadable init_from, before anything is written
    prepare_dir(cfg.run_dir, "run_dir")  # a file or read-only run_dir stops before compiling
    if not config_lib.is_url(cfg.checkpoint_dir()):
        prepare_dir(cfg.checkpoint_dir(), "checkpoint.directory")
    if cfg.checkpoint.local.directory:
        prepare_dir(cfg.checkpoint.local.directory, "checkpoint.local.directory")
        from shardtrain.checkpoint import local
        local.owner_conflict(cfg)  # another run's local tier stops before anything is written
    from shardtrain.runtime import faults
    faults.parse(os.environ.get(faults.VARIABLE))  # a malformed SHARDTRAIN_FAULT stops before any work
    simulated_devices(DEFAULT_CPU_DEVICES)
    from shardtrain import loop
    from shardtrain.checkpoint import manager
    from shardtrain.runtime import rundir
    cluster = distributed.initialize()
    with leaving_on_error(cluster):
        enable_compile_cache(cfg)  # before the lock's broadcast compiles anything
        with rundir.held(cfg.run_dir, cluster.process_index, cluster.process_count):  # one trainer per run dir
            try:
                return loop.train(cfg, started)
            except (manager.SaveFailed, loop.RunFilesFailed) as e:
                print(f"{cluster.tag}: error: {e}", file=sys.stderr, flush=True)
                return 1
            except loop.NonFinite as e:
                print(f"{cluster.tag}: error: {e}", file=sys.stderr, flush=True)
                return loop.EXIT_NONFINITE


def cmd_goodput(args) -> int:
    from shardtrain.runtime import goodput
    return goodput.main(args.run_dir, args.json)


def cmd_plan(args) -> int:
    if args.devices is not None and args.devices < 1:
        raise config_lib.ConfigError(
            f"--devices: must be a positive device count, e.g. --devices 8; got {args.devices}")
    cfg = config_lib.load(args.config, args.overrides)
    if args.budget < 0:
        raise config_lib.ConfigError(f"--budget: must be >= 0 compiles (0: rank meshes only), got {args.budget}")
    if args.meshes < 0:
        raise config_lib.ConfigError(f"--meshes: must be >= 0 meshes to compile (0: all), got {args.meshes}")
    if args.write and not args.search:
        raise config_lib.ConfigError("--write needs --search (it writes the fastest config found)")
    n_devices = args.devices or mesh_devices(cfg)
    simulated_devices(n_devices)
    from shardtrain.plan import planner
    devices, chip = planner.target(cfg, n_devices, args.devices, args.chip, args.topology, args.slices,
                                   args.memory_limit)
    if args.search:
        from shardtrain.plan import search, tune
        if args.budget == 0:
            return search.main(cfg, devices, chip, as_json=args.json, write=args.write, meshes=args.meshes)
        return tune.main(cfg, devices, chip, as_json=args.json, write=args.write, budget=args.budget,
                         meshes=args.meshes)
    return planner.main(cfg, devices, chip, as_json=args.json)


def cmd_prepare(args) -> int:
    from shardtrain.data import prepare
    opts = prepare.Options(tokenizer=args.tokenizer, out=args.out, text_field=args.text_field,
                           eval_fraction=args.eval_fraction, eos=args.eos, chat=args.chat,
                           preference=args.preference)
    prepare.prepare(args.inputs, opts, workers=args.workers)
    return 0


def eval_paths(words: list[str]) -> tuple[str, str, list[str]]:
    """(config, checkpoint, overrides) of `shardtrain eval [CONFIG] CHECKPOINT [KEY=VALUE ...]`; without
    CONFIG, the config.yaml of the checkpoint's run (the run dir, or one or two levels above it)."""
    overrides = [w for w in words if "=" in w and not Path(w).exists()]
    paths = [w for w in words if w not in overrides]
    if len(paths) == 2:
        return paths[0], paths[1], overrides
    if len(paths) != 1:
        raise config_lib.ConfigError(f"eval: give [CONFIG] CHECKPOINT [KEY=VALUE ...], got {len(paths)} paths: "
                                     f"{' '.join(paths)}")
    p = Path(paths[0])
    found = next((d / "config.yaml" for d in (p, p.parent, p.parent.parent) if (d / "config.yaml").is_file()), None)
    if found is None:
        raise config_lib.ConfigError(f"eval: no config.yaml in the run of '{p}'; give the run's config too: "
                                     f"shardtrain eval CONFIG {p}")
    return str(found), paths[0], overrides


def cmd_eval(args) -> int:
    config, checkpoint, overrides = eval_paths([*args.paths, *args.overrides])
    cfg = config_lib.load(config, overrides)
    simulated_devices(DEFAULT_CPU_DEVICES)
    from shardtrain import evaluate
    with leaving_on_error(distributed.initialize()):
        return evaluate.main(cfg, checkpoint)


def cmd_ckpt(args) -> int:
    from shardtrain.checkpoint import listing
    return (listing.verify_main if args.verify else listing.list_main)(args.run_dir)


def cmd_import_hf(args) -> int:
    simulated_devices(DEFAULT_CPU_DEVICES)
    from shardtrain import weights
    weights.import_hf(args.hf_dir, args.out_dir, args.overrides)
    return 0


def cmd_export_hf(args) -> int:
    simulated_devices(DEFAULT_CPU_DEVICES)
    from shardtrain import weights
    with leaving_on_error(distributed.initialize()):  # on every host of a multi-host run: process 0 writes
        weights.export_hf(args.source, args.out_dir, args.dtype, args.max_shard_size)
    return 0


def cmd_generate(args) -> int:
    simulated_devices(DEFAULT_CPU_DEVICES)
    import json

    from shardtrain import generate
    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
        raise config_lib.ConfigError("generate: need --max-new-tokens >= 1, --temperature >= 0, 0 < --top-p <= 1")
    gen = generate.Generator.from_source(args.source, args.overrides)
    prompts = [gen.encode_chat(p) if args.chat else gen.encode(p) for p in args.prompt]
    stream = not args.json and len(prompts) == 1
    shown = {"ids": [], "text": ""}

    def on_tokens(tokens_b):  # prints the new text of a single prompt as it comes
        if tokens_b[0] >= 0:
            shown["ids"].append(int(tokens_b[0]))
            text = gen.decode(shown["ids"]).rstrip("\ufffd")  # a character's bytes may be incomplete yet
            print(text[len(shown["text"]):], end="", flush=True)
            shown["text"] = text
    if stream:
        print(args.prompt[0], end="", flush=True)
    outs = gen.generate(prompts, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                        seed=args.seed, on_tokens=on_tokens if stream else None)
    for text, ids, new in zip(args.prompt, prompts, outs):
        if args.json:
            print(json.dumps({"prompt": text, "prompt_ids": ids, "generated_ids": new, "text": gen.decode(new)}))
        elif stream:
            print(gen.decode(new)[len(shown["text"]):])
        else:
            print(text + gen.decode(new))
    return 0


@contextlib.contextmanager
def leaving_on_error(cluster: distributed.Cluster):
    """In a run of several processes, an error (not SystemExit) is printed with the process index
    and the process leaves at once (`Cluster.report_and_leave`); a lone process raises as usual.
    Only errors of the main thread reach here, as they alone reached sys.excepthook."""
    try:
        yield
    except BaseException as e:
        if isinstance(e, SystemExit) or not cluster.several:
            raise
        cluster.report_and_leave(e)


def enable_compile_cache(cfg: config_lib.RunConfig) -> None:
    import jax
    if cfg.train.compile_cache:
        cache_home = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
        jax.config.update("jax_compilation_cache_dir", os.path.join(cache_home, "shardtrain", "jax"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardtrain", description="Sharded JAX training from a mesh config.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a model from a YAML config")
    t.add_argument("config", help="YAML config, e.g. meshes/demo.yaml")
    t.add_argument("overrides", nargs="*", help="dotted KEY=VALUE overrides, e.g. train.steps=50 mesh.tensor=4")
    t.set_defaults(func=cmd_train)
    pl = sub.add_parser("plan", help="memory, communication and speed of a mesh, without running it")
    pl.add_argument("config")
    pl.add_argument("overrides", nargs="*")
    pl.add_argument("--devices", type=int, help="device count to plan for (default: the mesh's product)")
    pl.add_argument("--chip", default=None, help="chip to plan for: v4, v5e, v5p, v6e, tpu7x, a100, h100, h200, cpu "
                    "(default: the config's hardware.chip, else the devices present)")
    pl.add_argument("--topology", default=None, help="TPU chips per dimension, e.g. 16x16: compile with the TPU "
                    "compiler for that slice (needs libtpu; default: the config's hardware.topology)")
    pl.add_argument("--slices", type=int, default=None, help="with --topology: TPU slices joined over DCN")
    pl.add_argument("--json", action="store_true", help="print one JSON object")
    pl.add_argument("--search", action="store_true", help="rank the meshes of --devices devices, then tune the best "
                    "ones' remat, optimizer offload and accumulation")
    pl.add_argument("--meshes", type=int, default=6, metavar="N",
                    help="with --search: compile the N meshes the analytical model predicts fastest "
                    "(default 6; 0: all)")
    pl.add_argument("--budget", type=int, default=12, metavar="N",
                    help="with --search: compile at most N candidates while tuning (default 12; 0: rank meshes only)")
    pl.add_argument("--write", metavar="YAML", help="with --search: write the fastest config that fits")
    pl.add_argument("--memory-limit", type=float, metavar="BYTES", help="memory per device instead of the chip's")
    pl.set_defaults(func=cmd_plan)
    pr = sub.add_parser("prepare", help="tokenize text / JSONL / Parquet into shards for data.source=tokens")
    pr.add_argument("inputs", nargs="+", help="files, directories or globs (.jsonl, .parquet, else plain text)")
    pr.add_argument("--tokenizer", required=True, help="a tokenizer.json, a sentencepiece .model, a tiktoken "
                    "file, a directory holding one, or `bytes`")
    pr.add_argument("--out", required=True, help="output directory (rerun the same command to resume)")
    pr.add_argument("--text-field", default="text", help="JSONL key / Parquet column of the text (default: text)")
    pr.add_argument("--eval-fraction", type=float, default=0.0, help="fraction of documents held out as `eval`")
    pr.add_argument("--eos", default=None, help="EOS token when the tokenizer has none of <eos> </s> <|endoftext|>")
    pr.add_argument("--workers", type=int, default=None,
                    help="processes (default: one per CPU, at most one per file or part of a large file)")
    pr.add_argument("--chat", action="store_true", help="JSONL conversations ({\"messages\": [...]}) through the "
                    "tokenizer's chat template; the loss counts only the assistant's tokens")
    pr.add_argument("--preference", action="store_true", help="JSONL preference rows ({\"prompt\", \"chosen\", "
                    "\"rejected\"}: strings or chat message lists) for train.objective=dpo: both completions of a row "
                    "kept together, the loss on the completions only")
    pr.set_defaults(func=cmd_prepare)
    ev = sub.add_parser("eval", help="loss and perplexity of a checkpoint on the held-out split")
    ev.add_argument("paths", nargs="+", metavar="[CONFIG] CHECKPOINT [KEY=VALUE ...]",
                    help="the run's YAML config (default: the run's config.yaml); a run dir, its checkpoints/ dir "
                    "(newest step) or one step's dir; dotted overrides, e.g. train.eval_steps=20")
    ev.set_defaults(func=cmd_eval, overrides=[])
    gp = sub.add_parser("goodput", help="where a run's wall time went, across restarts, and its goodput")
    gp.add_argument("run_dir")
    gp.add_argument("--json", action="store_true", help='print {"wall_s", "goodput", "categories": {name: seconds}}')
    gp.set_defaults(func=cmd_goodput)
    c = sub.add_parser("ckpt", help="list a run's checkpoints, or check them against their checksums")
    c.add_argument("run_dir")
    c.add_argument("--verify", action="store_true", help="read every committed step of both tiers back against its "
                   "checksums without training; exit 1 and a line per damaged step if one is")
    c.set_defaults(func=cmd_ckpt)
    i = sub.add_parser("import-hf", help="a Hugging Face model directory -> a shardtrain checkpoint + config")
    i.add_argument("hf_dir", help="directory with config.json, *.safetensors and the tokenizer")
    i.add_argument("out_dir")
    i.add_argument("overrides", nargs="*", help="config KEY=VALUEs for the written config (mesh.*, train.*)")
    i.set_defaults(func=cmd_import_hf)
    e = sub.add_parser("export-hf", help="a run, checkpoint or import-hf directory -> a Hugging Face model directory")
    e.add_argument("source", help="run directory, checkpoint step directory or import-hf directory")
    e.add_argument("out_dir")
    e.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the written weights (default: the imported model's, else float32)")
    e.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    e.set_defaults(func=cmd_export_hf)
    g = sub.add_parser("generate", help="generate text from an HF, import-hf, run or checkpoint directory")
    g.add_argument("source")
    g.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", action="store_true", help="one JSON line per prompt: prompt and generated ids, text")
    g.add_argument("--chat", action="store_true", help="each prompt as a user message through the model's chat "
                   "template, the assistant's turn opened")
    g.add_argument("overrides", nargs="*", help="config KEY=VALUEs before the options (mesh.tensor=..., rules.*)")
    g.set_defaults(func=cmd_generate)
    return p


def parse(argv=None) -> argparse.Namespace:
    """The command line's arguments; config overrides may also follow the flags: plan X --chip v5e k=v."""
    p = parser()
    args, extra = p.parse_known_args(argv)
    if extra and (not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x for x in extra)):
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv=None) -> None:
    args = parse(argv)
    skip_absent_accelerators()
    for line in config_lib.repeated(getattr(args, "overrides", None) or []):  # train.steps=3 ... train.steps=5
        print(f"shardtrain: {line}", flush=True)
    try:
        code = args.func(args)
    except config_lib.ConfigError as e:  # in a run of several processes, leaving_on_error reports it
        print(f"shardtrain: error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:  # Ctrl-C before `train` handles it (importing, loading), or in another command
        print(f"\nshardtrain: interrupted (Ctrl-C); stopped {args.command} (exit 130)", file=sys.stderr)
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
