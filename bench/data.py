"""Data throughput: `shardtrain prepare` against the tokenizers batch encoder alone (per core), and
the training loader's tokens/s per host against what a v5p-128 step of Llama-3-8B consumes.

    python bench/data.py [--copies N]

Corpus: the Python standard library's *.py files as JSONL documents (no download), `--copies`
times over; tokenizer: a 8192-token byte-level BPE trained on it here. RAYON_NUM_THREADS=1 pins
the tokenizer to one core, so both rates are per core. Loader: a prepared directory of 64M
tokens (2048-token documents' worth of random ids), read as one host of 16 reads its rows:
global batch 512 x 2048, 32 rows per host, through loader.samples + loader.batches (grain, shuffled).
Record: bench/results/data.jsonl.
"""

import harness  # isort: split

import argparse
import glob
import json
import os
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ["RAYON_NUM_THREADS"] = "1"  # before tokenizers (shardtrain.data.tokenize) is imported

from shardtrain import config  # noqa: E402
from shardtrain.data import loader, prepare, tokenize  # noqa: E402

V5P_PEAK = 459e12  # bf16 FLOP/s per chip (shardtrain/plan/chips.py)


def corpus(directory: Path, copies: int) -> tuple[Path, list[str]]:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    texts = [Path(f).read_text(errors="replace") for f in files]
    path = directory / "docs.jsonl"
    with open(path, "w") as f:
        for _ in range(copies):
            for t in texts:
                f.write(json.dumps({"text": t}) + "\n")
    return path, texts


def train_tokenizer(texts, path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))


def bench_prepare(tmp: Path, copies: int) -> dict:
    path, texts = corpus(tmp, copies)
    train_tokenizer(texts, tmp / "tok.json")
    tok = tokenize.load(str(tmp / "tok.json"))
    docs = [json.loads(line)["text"] for line in open(path)]
    t = time.perf_counter()
    n_encoder = sum(len(ids) for ids in tok.encode_batch(docs))
    encoder = n_encoder / (time.perf_counter() - t)
    t = time.perf_counter()
    manifest = prepare.prepare([str(path)], prepare.Options(str(tmp / "tok.json"), str(tmp / "ds"), eval_fraction=0.01),
                               workers=1, say=lambda _: None)
    seconds = time.perf_counter() - t
    tokens = manifest["splits"]["train"]["tokens"] + manifest["splits"]["eval"]["tokens"]
    return {"documents": len(docs), "bytes": path.stat().st_size, "tokens": tokens,
            "encoder_tokens_per_s": encoder, "prepare_tokens_per_s": tokens / seconds,
            "prepare_vs_encoder": tokens / seconds / encoder}


def bench_loader(tmp: Path, steps: int, url: bool = False) -> dict:
    """The loader on a 64M-token shard, from disk (os.pread) or, with `url`, through tensorstore's
    kvstore (file://, the code path of gs://)."""
    n_tokens, doc = 64 << 20, 2048
    (tmp / "big" / "train").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rng.integers(0, 32768, n_tokens, dtype=np.uint16).tofile(tmp / "big" / "train" / "00000.bin")
    np.save(tmp / "big" / "train" / "00000.idx.npy", np.arange(0, n_tokens + 1, doc, dtype=np.int64))
    entry = {"file": "train/00000.bin", "index": "train/00000.idx.npy", "tokens": n_tokens,
             "documents": n_tokens // doc, "sha256": ""}
    (tmp / "big" / "manifest.json").write_text(json.dumps({"vocab_size": 32768, "eos_id": 0, "dtype": "uint16",
                                                           "splits": {"train": {"shards": [entry]}}}))
    where = f"file://{tmp / 'big'}" if url else str(tmp / "big")
    cfg = config.load(None, ["data.source=tokens", f"data.path={where}", "data.seq_len=2048",
                             "model.vocab_size=32768", "train.global_batch_size=512", f"run_dir={tmp / 'run'}"])
    rows = slice(0, 512 // 16)
    it = loader.batches(loader.samples(cfg), 512, rows, 0, steps + 1)
    next(it)  # thread start, first batch
    t = time.perf_counter()
    for _ in range(steps):
        next(it)
    seconds = (time.perf_counter() - t) / steps
    tokens_per_host_step = 512 * 2048 // 16
    flops = 6 * 8.03e9 * 512 * 2048  # Llama-3-8B, 6 N per token, attention ignored
    step_s = flops / (64 * V5P_PEAK)  # v5p-128 = 64 chips at 100% MFU: the fastest a step can be
    need = tokens_per_host_step / step_s
    have = rows.stop * 2049 / seconds
    return {"rows_per_host": rows.stop, "loader_s_per_step": seconds, "loader_tokens_per_s": have,
            "v5p128_step_s_at_100pct_mfu": step_s, "needed_tokens_per_s_per_host": need, "margin": have / need}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--copies", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        kvstore = {f"kvstore_{k}": v for k, v in bench_loader(Path(tmp), args.steps, url=True).items()}
        figures = {**bench_prepare(Path(tmp), args.copies), **bench_loader(Path(tmp), args.steps), **kvstore}
    print(json.dumps(figures, indent=1))
    harness.record("data", figures, copies=args.copies, steps=args.steps,
                   rayon_num_threads=os.environ["RAYON_NUM_THREADS"])


if __name__ == "__main__":
    main()
