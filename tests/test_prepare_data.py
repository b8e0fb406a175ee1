"""Offline tokenization (scripts/prepare_data.py, data/prepare.py) writes the in-job cache's rows, whatever the number
of workers, and a run reads them as they are.

A source is cut into pieces that do not depend on
the number of workers, tokenized by worker processes into cache-format shards; the same rows with 1 and 2 workers
and as the in-job cache (unpacked); bad lines named by their line in the whole file; a training run reads the
shards as they are and refuses them when they were made with other settings or another tokenizer."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from data import prepare as prep
from data.cache import TokenBlocks, build_or_reuse
from data.sources import DataError
from tests.support.scripts import load_entry_point
from tests.test_data import settings, write_jsonl


def all_rows(blocks: TokenBlocks) -> np.ndarray:
    return np.stack(
        [np.stack([blocks[i][k].numpy() for k in ("input_ids", "labels", "position_ids")]) for i in range(len(blocks))]
    )


def test_a_jsonl_file_is_cut_at_line_ends_with_its_line_numbers(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"input_ids": [3] * (1 + i % 7)} for i in range(100)])
    parts = prep.pieces(path, piece_bytes=300)
    assert len(parts) > 5 and parts[0].start == 0 and parts[-1].end == os.path.getsize(path)
    data = open(path, "rb").read()
    for a, b in zip(parts, parts[1:]):
        assert a.end == b.start and data[a.end - 1 : a.end] == b"\n"  # whole lines, no gap
        assert b.first_line == data[: b.start].count(b"\n") + 1


@pytest.mark.e2e  # spawns worker processes (seconds of imports each)
@pytest.mark.parametrize("fmt, packing", [("tokens", False), ("text", True)])
def test_one_or_two_workers_write_the_same_shards(tmp_path, tokenizer_dir, monkeypatch, fmt, packing):
    if fmt == "tokens":
        rows = [{"input_ids": [3 + (i * j) % 500 for j in range(1 + i % 30)]} for i in range(200)]
    else:
        rows = [{"text": " ".join(["word"] * (1 + i % 40)) + f" {i}"} for i in range(200)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    monkeypatch.setattr(prep, "PIECE_BYTES", 2000)  # several pieces (the workers are spawned: the parent cuts)
    s = settings(fmt, seq=32, packing=packing)
    one = prep.prepare(path, s, tokenizer_dir, str(tmp_path / "one"), workers=1, log=print)
    two = prep.prepare(path, s, tokenizer_dir, str(tmp_path / "two"), workers=2, log=print)
    assert len(one["shards"]) > 3 and one["shards"] == two["shards"] and one["tokens"] == two["tokens"]
    a, b = TokenBlocks(str(tmp_path / "one")), TokenBlocks(str(tmp_path / "two"))
    assert len(a) == one["num_samples"] and np.array_equal(all_rows(a), all_rows(b))
    assert np.array_equal(a.lengths(), b.lengths()) and a.total_tokens() <= one["tokens"]  # rows without labels dropped
    if not packing:  # one example per row: the in-job cache's rows, in the same order
        entry, _ = build_or_reuse(path, s, tokenizer_dir, str(tmp_path / "cache"), print)
        assert np.array_equal(all_rows(a), all_rows(TokenBlocks(entry)))


def test_a_bad_line_is_named_by_its_line_in_the_whole_file(tmp_path, tokenizer_dir, monkeypatch):
    rows = [json.dumps({"input_ids": [5, 6, 7]})] * 150 + ['{"input_ids": [5, 6, 7000]}']
    (tmp_path / "d.jsonl").write_text("\n".join(rows) + "\n")
    monkeypatch.setattr(prep, "PIECE_BYTES", 500)
    with pytest.raises(DataError, match=r"d.jsonl:151: input_ids must be a non-empty list of ints in \[0, 512\)"):
        prep.prepare(str(tmp_path / "d.jsonl"), settings("tokens", seq=8, packing=False), None, str(tmp_path / "o"), 1)
    assert not [f for f in os.listdir(tmp_path) if f.startswith("o")]  # nothing half-written left


def test_a_run_reads_prepared_shards_and_refuses_other_settings_or_tokenizers(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"document {i} " * (1 + i % 5)} for i in range(40)])
    s = settings("text", seq=32, packing=True)
    out = str(tmp_path / "prepared")
    prep.prepare(path, s, tokenizer_dir, out, workers=1)
    entry, meta = build_or_reuse(out, s, tokenizer_dir, str(tmp_path / "cache"), print)
    assert entry == out and meta["prepared"] and not (tmp_path / "cache").exists()  # nothing tokenized again
    with pytest.raises(DataError) as err:
        build_or_reuse(out, settings("text", seq=64, packing=False), tokenizer_dir, str(tmp_path / "c"), print)
    assert str(err.value).startswith(
        f"{out} was prepared for another run: data.max_seq_length 32 there, 64 here; data.packing True there, "
        "False here. Prepare it again"
    )
    other = tmp_path / "other_tok"
    shutil.copytree(tokenizer_dir, other)
    config = other / "tokenizer_config.json"
    config.write_text(config.read_text().replace("}", ', "model_max_length": 7}', 1))
    with pytest.raises(DataError, match=rf"the tokenizer \({other} here: other files\)"):
        build_or_reuse(out, s, str(other), str(tmp_path / "c"), print)


@pytest.mark.multirank
def test_prepare_data_then_train_on_it(tmp_path, tiny_ckpt):
    """The script with train.py's overrides and 2 workers, then train.py on its output (pipe 2): it reads the
    shards without tokenizing, and trains the same losses as on the in-job cache of the same file."""
    from models.tiny import write_text_corpus
    from tests.support.parity import parity_args
    from tests.support.ranks import train_run
    from tests.support.runs import read_metrics

    corpus = str(tmp_path / "corpus.jsonl")
    write_text_corpus(corpus)
    common = {"num_stages": 2, "gradient_accumulation_steps": 2, "loss_chunk_tokens": 16, "data.format": "text"}
    args = parity_args(tiny_ckpt, corpus, str(tmp_path / "cached"), 64, 2, 2, {}, **common)
    script = load_entry_point("scripts/prepare_data.py")
    assert script.main(["--workers", "2", "--output", str(tmp_path / "prepared"), *args]) == 0
    losses = {}
    for name, data in (("cached", corpus), ("prepared", str(tmp_path / "prepared"))):
        train_run(tmp_path, name, 2, parity_args(tiny_ckpt, data, str(tmp_path / name), 64, 2, 2, {}, **common))
        losses[name] = [m["loss"] for m in read_metrics(str(tmp_path / name))]
    log = (tmp_path / "prepared.log").read_text()
    assert "reading prepared data" in log and "(no tokenizing)" in log and "tokenized " not in log
    # One piece here (the corpus is under PIECE_BYTES): the same packed rows as the in-job cache.
    assert losses["prepared"] == losses["cached"]


def test_a_mixture_is_prepared_one_source_at_a_time(tmp_path, tiny_hf, capsys):
    script = load_entry_point("scripts/prepare_data.py")
    a = write_jsonl(tmp_path / "a.jsonl", [{"input_ids": [1, 2, 3]}])
    mixture = f"data.sources=[{{path:{a}}}]"
    args = ["--output", str(tmp_path / "out"), f"model_name_or_path={tiny_hf}", mixture]
    assert script.main(args) == 1
    assert "a mixture is prepared one source at a time: run this once per source" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
