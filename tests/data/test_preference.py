"""`shardtrain prepare --preference`: each row's two documents with their masks (exactly the
completion and its EOS), read back as one sample holding both; over-long rows dropped and counted."""

import json
from pathlib import Path

import numpy as np
import pytest

from prepared_data import run_cli
from shardtrain.config import ConfigError
from shardtrain.data import chat, preference, prepare, token_shards, tokenize

ROWS = [{"prompt": "def f(x):\n", "chosen": "    return x\n", "rejected": "zq%\n"},
        {"prompt": "p" * 40, "chosen": "c", "rejected": "r"},
        {"prompt": "import os\n", "chosen": "import sys\n", "rejected": "#\n"}]


@pytest.fixture
def prefs(tmp_path):
    (tmp_path / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "pref"
    prepare.prepare([str(tmp_path / "prefs.jsonl")], prepare.Options("bytes", str(out), preference=True),
                    workers=1, say=lambda _: None)
    return out


def test_a_rows_chosen_and_rejected_are_one_sample_masked_on_the_completion(prefs):
    assert json.loads((prefs / "manifest.json").read_text())["preference"] is True
    pairs = preference.PreferencePairs(token_shards.TokenSplit(str(prefs), "train"), 33, 264)
    assert (len(pairs), pairs.dropped) == (2, 1)  # row 1: 40 + 1 + 1 tokens > 33
    for sample, row in zip((pairs[0], pairs[1]), (ROWS[0], ROWS[2])):
        for name in ("chosen", "rejected"):
            ids, mask = sample[name], sample[f"{name}_mask"]
            text = (row["prompt"] + row[name]).encode()
            n, p = len(text), len(row["prompt"].encode())
            assert ids[:n].tolist() == list(text) and ids[n] == 256 and not ids[n + 1:].any()
            assert np.flatnonzero(mask).tolist() == list(range(p, n + 1))  # the completion and its EOS


def test_rows_all_too_long_or_malformed_are_refused(prefs, tmp_path, capsys):
    with pytest.raises(ConfigError, match="every one of its 3 preference rows is longer than data.seq_len"):
        preference.PreferencePairs(token_shards.TokenSplit(str(prefs), "train"), 8, 264)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    code, _, err = run_cli(capsys, "prepare", str(tmp_path / "bad.jsonl"), "--preference", "--tokenizer", "bytes",
                        "--out", str(tmp_path / "o"))
    assert code == 2 and "bad.jsonl:1: no 'rejected'" in err


def test_chat_rows_mask_the_completion_the_template_adds(tmp_path):
    """Chat lists through the tokenizer's chat template: the prompt is the conversation with the
    generation prompt, the mask covers what the chosen (rejected) turn adds to it, and EOS."""
    qwen = "tests/fixtures/hf/qwen2"
    row = {"prompt": [{"role": "user", "content": "Add 2 and 3."}], "chosen": "5", "rejected": [
        {"role": "assistant", "content": "23"}]}
    (tmp_path / "p.jsonl").write_text(json.dumps(row) + "\n")
    prepare.prepare([str(tmp_path / "p.jsonl")], prepare.Options(qwen, str(tmp_path / "o"), preference=True),
                    workers=1, say=lambda _: None)
    tok = tokenize.load(qwen)
    template = chat.ChatTemplate(Path(qwen), tok)
    head = template.prompt(row["prompt"])
    pair = preference.PreferencePairs(token_shards.TokenSplit(str(tmp_path / "o"), "train"), 64, tok.vocab_size)[0]
    for name, reply in (("chosen", "5"), ("rejected", "23")):
        full = template.render([*row["prompt"], {"role": "assistant", "content": reply}], "test")[0]
        assert full.startswith(head) and reply in full[len(head):]
        ids, mask = pair[name], pair[f"{name}_mask"]
        n_prompt = len(tok.encode(head))
        completion = ids[mask == 1].tolist()
        assert not mask[:n_prompt].any() and completion[-1] == tok.eos_id
        assert tok.decode(completion[:-1]) == full[len(head):] and ids[:n_prompt].tolist() == tok.encode(head)
