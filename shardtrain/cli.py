"""`shardtrain train | plan | prepare | eval | ckpt`. Mistakes in user input exit 2 with one message, no traceback."""

from __future__ import annotations

import argparse
import math
import os
import sys

from shardtrain import config as config_lib, distributed


DEFAULT_CPU_DEVICES = 8


def simulated_devices(n: int) -> None:
    """Asks for `n` CPU devices unless XLA_FLAGS already does; must run before jax is imported.
    Accelerators, when present, are used instead (the flag only affects the host platform)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def mesh_devices(cfg: config_lib.RunConfig) -> int:
    """The device count a mesh asks for (the default when one axis is -1)."""
    sizes = cfg.mesh.sizes().values()
    return math.prod(sizes) if all(s > 0 for s in sizes) else DEFAULT_CPU_DEVICES


def cmd_train(args) -> int:
    cfg = config_lib.load(args.config, args.overrides)
    config_lib.prepare_dir(cfg.run_dir, "run_dir")  # a file or read-only run_dir stops before compiling
    if not cfg.checkpoint_dir().startswith("gs://"):
        config_lib.prepare_dir(cfg.checkpoint_dir(), "checkpoint.directory")
    simulated_devices(DEFAULT_CPU_DEVICES)
    from shardtrain import checkpoint, loop
    distributed.initialize()
    enable_compile_cache(cfg)
    try:
        return loop.train(cfg)
    except checkpoint.SaveFailed as e:
        print(f"{distributed.tag()}: error: {e}", file=sys.stderr)
        return 1


def cmd_plan(args) -> int:
    if args.devices is not None and args.devices < 1:
        raise config_lib.ConfigError(f"--devices: must be a positive device count, e.g. --devices 8; got {args.devices}")
    cfg = config_lib.load(args.config, args.overrides)
    simulated_devices(args.devices or mesh_devices(cfg))
    from shardtrain import plan
    return plan.main(cfg, args)


def cmd_prepare(args) -> int:
    from shardtrain import prepare
    opts = prepare.Options(tokenizer=args.tokenizer, out=args.out, text_field=args.text_field,
                           eval_fraction=args.eval_fraction, eos=args.eos)
    prepare.prepare(args.inputs, opts, workers=args.workers)
    return 0


def cmd_eval(args) -> int:
    cfg = config_lib.load(args.config, args.overrides)
    simulated_devices(DEFAULT_CPU_DEVICES)
    from shardtrain import evaluate
    distributed.initialize()
    return evaluate.main(cfg, args.checkpoint)


def cmd_ckpt(args) -> int:
    from shardtrain import checkpoint
    return checkpoint.list_main(args.run_dir)


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
    pl.add_argument("--chip", default=None, help="chip for the roofline estimate: v4, v5e, v5p, v6e, a100, h100, h200, cpu")
    pl.add_argument("--json", action="store_true", help="print one JSON object")
    pl.add_argument("--search", action="store_true", help="rank every mesh of --devices devices")
    pl.add_argument("--write", metavar="YAML", help="with --search: write the best mesh as a config")
    pl.add_argument("--memory-limit", type=float, metavar="BYTES", help="memory per device instead of the chip's")
    pl.set_defaults(func=cmd_plan)
    pr = sub.add_parser("prepare", help="tokenize text / JSONL / Parquet into shards for data.source=tokens")
    pr.add_argument("inputs", nargs="+", help="files, directories or globs (.jsonl, .parquet, else plain text)")
    pr.add_argument("--tokenizer", required=True, help="a tokenizer.json, a directory holding one, or `bytes`")
    pr.add_argument("--out", required=True, help="output directory (rerun the same command to resume)")
    pr.add_argument("--text-field", default="text", help="JSONL key / Parquet column of the text (default: text)")
    pr.add_argument("--eval-fraction", type=float, default=0.0, help="fraction of documents held out as `eval`")
    pr.add_argument("--eos", default=None, help="EOS token when the tokenizer has none of <eos> </s> <|endoftext|>")
    pr.add_argument("--workers", type=int, default=None, help="processes (default: one per CPU, at most one per file)")
    pr.set_defaults(func=cmd_prepare)
    ev = sub.add_parser("eval", help="loss and perplexity of a checkpoint on the held-out split")
    ev.add_argument("config", help="the run's YAML config")
    ev.add_argument("checkpoint", help="a run dir, its checkpoints/ dir (newest step) or one step's dir")
    ev.add_argument("overrides", nargs="*", help="dotted KEY=VALUE overrides, e.g. train.eval_steps=20")
    ev.set_defaults(func=cmd_eval)
    c = sub.add_parser("ckpt", help="list a run's checkpoints")
    c.add_argument("run_dir")
    c.set_defaults(func=cmd_ckpt)
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    try:
        code = args.func(args)
    except config_lib.ConfigError as e:
        print(f"{distributed.tag()}: error: {e}", file=sys.stderr)
        code = 2
        distributed.leave_after_error(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
