"""`shardtrain prepare`: the round trip from text, JSONL and Parquet to each document's tokens and
EOS in its split, resuming an interrupted run, parts of large files in parallel processes byte
for byte, and input mistakes that exit 2 naming the file and line."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prepared_data import DOCS, run_cli, split_docs
from shardtrain.config import ConfigError
from shardtrain.data import prepare, tokenize


def test_prepare_round_trip_gives_each_documents_tokens_and_eos(prepared, tok_path):
    tok = tokenize.load(str(tok_path))
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["eos_id"] == tok.eos_id == tok.tok.token_to_id("<|endoftext|>")
    assert manifest["vocab_size"] == 300 and manifest["dtype"] == "uint16"
    names = ["a.jsonl"] * 30 + ["b.parquet"] * 20 + [f"c{i}.txt" for i in range(10)]
    index = list(range(30)) + list(range(20)) + [0] * 10
    want = {"train": [], "eval": []}
    for doc, name, i in zip(DOCS, names, index):
        ids = tok.tok.encode(doc, add_special_tokens=False).ids + [tok.eos_id]
        want["eval" if prepare.is_eval(name, i, 0.25) else "train"].append(ids)
    assert want["eval"] and want["train"]
    for split in ("train", "eval"):
        assert split_docs(prepared, split) == want[split]
        assert manifest["splits"][split]["documents"] == len(want[split])
    assert tok.decode(want["train"][0][:-1]) in DOCS


def test_prepare_resumes_and_runs_in_parallel(tok_path, corpus, tmp_path):
    inputs, opts = [str(corpus / "a.jsonl"), str(corpus / "b.parquet")], prepare.Options(str(tok_path), str(tmp_path))
    first = prepare.prepare(inputs, opts, workers=2, say=lambda _: None)
    (tmp_path / "parts" / "00001.json").unlink()  # as if killed while writing file 1
    (tmp_path / "train" / "00000.bin").write_bytes(b"")  # a finished file is not read again
    said = []
    assert prepare.prepare(inputs, opts, workers=1, say=said.append) == first
    assert said[0].startswith("prepare: 1 of 2 input files or parts already done")
    prepare.prepare(inputs, opts, workers=1, say=said.append)  # all done: no "0 tokens/s"
    assert said[-1].endswith("EOS id 0; nothing to tokenize: every part was done already"), said[-1]


def test_large_files_split_into_parts_give_the_same_bytes(tok_path, tmp_path):
    """A JSONL file cut into byte ranges at line starts (and a Parquet file into runs of row
    groups) tokenized by 2 processes gives the same shards, byte for byte, as 1 process, and the
    same token stream, eval split and error line numbers as the file read whole."""
    jsonl, table = tmp_path / "big.jsonl", tmp_path / "big.parquet"
    jsonl.write_text("".join(json.dumps({"text": t}) + ("\n\n" if i % 7 == 3 else "\n") for i, t in enumerate(DOCS)))
    pq.write_table(pa.table({"text": DOCS}), table, row_group_size=8)
    opts = dict(eval_fraction=0.25)
    dirs = {}
    for name, workers, part_bytes in (("whole", 1, 1 << 30), ("parts1", 1, 700), ("parts2", 2, 700)):
        dirs[name] = tmp_path / name
        prepare.prepare([str(jsonl), str(table)], prepare.Options(str(tok_path), str(dirs[name]), **opts),
                        workers=workers, say=lambda _: None, part_bytes=part_bytes)
    parts = sorted(p.name for p in (dirs["parts1"] / "parts").iterdir())
    assert len(parts) > 6 and "00000.0000.json" in parts and "00001.0001.json" in parts  # both files were cut

    def files(d):
        return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}
    assert files(dirs["parts1"]) == files(dirs["parts2"])
    (dirs["parts2"] / "parts" / "00000.0001.json").unlink()  # as if killed while writing that part
    (dirs["parts2"] / "train" / "00000.0001.bin").unlink()
    prepare.prepare([str(jsonl), str(table)], prepare.Options(str(tok_path), str(dirs["parts2"]), **opts),
                    workers=2, say=lambda _: None, part_bytes=700)
    assert files(dirs["parts1"]) == files(dirs["parts2"])
    for split in ("train", "eval"):
        assert split_docs(dirs["parts1"], split) == split_docs(dirs["whole"], split)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(jsonl.read_text() + '{"body": 1}\n')
    with pytest.raises(ConfigError, match=f"bad.jsonl:{len(jsonl.read_text().splitlines()) + 1}: no string field"):
        prepare.prepare([str(bad)], prepare.Options(str(tok_path), str(tmp_path / "bad")), workers=1,
                        say=lambda _: None, part_bytes=700)


@pytest.mark.parametrize("content, message", [
    ('{"text": "fine"}\n{"body": "x"}\n', "bad.jsonl:2: no string field 'text' (has: body)"),
    ('{"text": "fine"}\nnot json\n', "bad.jsonl:2: not valid JSON"),
])
def test_bad_jsonl_exits_2_naming_file_and_line(capsys, tmp_path, tok_path, content, message):
    (tmp_path / "bad.jsonl").write_text(content)
    code, _, err = run_cli(capsys, "prepare", str(tmp_path / "bad.jsonl"), "--tokenizer", str(tok_path),
                        "--out", str(tmp_path / "out"))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err  # found at once: no bar


def test_prepare_errors(capsys, tmp_path, tok_path, corpus):
    cases = [(["--tokenizer", str(tmp_path / "none.json")], "no tokenizer file there"),
             (["--tokenizer", str(tok_path), "--eos", "<nope>"], "--eos <nope>: no such token"),
             (["--tokenizer", str(tok_path), "--eval-fraction", "0.0001"], "held out none of the 10 documents"),
             (["--tokenizer", str(tok_path), "--text-field", "body"], "no column 'body'"),
             (["--tokenizer", str(tok_path), "--out", "gs://b/ds"], "--out gs://b/ds: prepare writes to local disk")]
    for args, message in cases:
        inputs = [str(corpus / "b.parquet")] if "body" in args else [str(corpus / "c*.txt")]
        code, _, err = run_cli(capsys, "prepare", *inputs, "--out", str(tmp_path / "out"), *args)
        assert code == 2 and message in err.strip().splitlines()[-1] and "Traceback" not in err, err
    (tmp_path / "shard.bin").write_bytes(b"\1\0\2\0")  # a binary file among the inputs is refused, named
    code, _, err = run_cli(capsys, "prepare", str(tmp_path / "shard.bin"), "--tokenizer", str(tok_path), "--out",
                           str(tmp_path / "out"))
    assert code == 2 and f"{tmp_path}/shard.bin: not a text file (a NUL byte at byte 1" in err, err

