"""Prepared token data that the tests of shardtrain/data/ and of training on tokens share: DOCS, a
byte-level BPE tokenizer trained on them, the corpus in three formats and its prepared directory
(session fixtures: tests/conftest.py loads this module as a plugin), and helpers."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers

from shardtrain import cli
from shardtrain.data import prepare, token_shards

DOCS = [f"document {i}: " + " ".join(f"w{(i * 7 + j) % 13}" for j in range(3 + i % 9)) for i in range(60)]


@pytest.fixture(scope="session")
def tok_path(tmp_path_factory):
    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """DOCS[:30] as JSONL (with a blank line), DOCS[30:50] as Parquet, DOCS[50:] as text files."""
    d = tmp_path_factory.mktemp("corpus")
    (d / "a.jsonl").write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(DOCS[:30])) + "\n\n")
    pq.write_table(pa.table({"text": DOCS[30:50]}), d / "b.parquet")
    for i, t in enumerate(DOCS[50:]):
        (d / f"c{i}.txt").write_text(t)
    return d


@pytest.fixture(scope="session")
def prepared(tok_path, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("ds")
    inputs = [str(corpus / "a.jsonl"), str(corpus / "b.parquet"), str(corpus / "c*.txt")]
    prepare.prepare(inputs, prepare.Options(str(tok_path), str(out), eval_fraction=0.25), workers=1, say=lambda _: None)
    return out


def cfg_for(cfg_factory, ds, *extra):
    return cfg_factory("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "data.source=tokens", f"data.path={ds}",
                       "model.vocab_size=320", "data.seq_len=15",
                       "train.global_batch_size=8", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=2",
                       "model.n_layers=2", "model.d_ff=64", *extra)


def split_docs(ds: Path, split: str) -> list[list[int]]:
    """The split's documents as the stream reads them (cut where the document id changes)."""
    s = token_shards.TokenSplit(str(ds), split)
    tokens, doc_ids, _ = s.read(0, len(s), 1 << 20)
    return [t.tolist() for t in np.split(tokens, np.flatnonzero(np.diff(doc_ids)) + 1)]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """`shardtrain ARGV...` in this process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    captured = capsys.readouterr()
    return e.value.code, captured.out, captured.err
