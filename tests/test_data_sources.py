"""Data sources beyond one JSONL file (data/sources.py) give the JSONL file's tokenized rows, and bad ones are refused.

Parquet, arrow and JSON files read through Hugging Face ``datasets`` (streamed), directories and globs of files,
``save_to_disk`` directories, and ``data.fields`` for other column names. Each source of the same rows gives the same
tokenized rows as the JSONL file; bad rows are named by file and row; a source that cannot work is refused before
anything is tokenized."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from data.cache import TokenBlocks, build_or_reuse, cache_key
from data.sources import DataError, WholeFileError, source_problems
from tests.test_config import good, problems_of  # noqa: F401 (a fixture)
from tests.test_data import settings, write_jsonl

DOCS = [
    {"text": f"document {i}: " + " ".join(["alpha", "beta", "gamma", "delta"][: 1 + i % 4] * (1 + i))}
    for i in range(12)
]


def rows_of(source: str, tokenizer_dir: str, cache: str, fmt: str = "text", **fields) -> dict[str, np.ndarray]:
    s = settings(fmt, seq=32, packing=False)
    if fields:
        s = type(s)(**{**s.__dict__, "fields": tuple(sorted(fields.items()))})
    entry, _ = build_or_reuse(source, s, tokenizer_dir, cache, print)
    blocks = TokenBlocks(entry)
    return {name: np.asarray(a) for name, a in blocks.arrays.items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.fixture
def jsonl_rows(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    return rows_of(path, tokenizer_dir, str(tmp_path / "c0"))


def test_parquet_arrow_json_and_saved_datasets_give_the_jsonl_rows(tmp_path, tokenizer_dir, jsonl_rows):
    from datasets import Dataset

    ds = Dataset.from_list(DOCS)
    ds.to_parquet(str(tmp_path / "docs.parquet"))
    ds.to_json(str(tmp_path / "docs.json"), lines=False)  # a JSON array
    ds.save_to_disk(str(tmp_path / "saved"))
    (arrow,) = [f for f in os.listdir(tmp_path / "saved") if f.endswith(".arrow")]
    sources = {
        "parquet": str(tmp_path / "docs.parquet"),
        "json": str(tmp_path / "docs.json"),
        "save_to_disk": str(tmp_path / "saved"),
        "arrow": str(tmp_path / "saved" / arrow),
    }
    for name, source in sources.items():
        assert source_problems(source) == []
        assert same(rows_of(source, tokenizer_dir, str(tmp_path / f"c_{name}")), jsonl_rows), name


def test_directories_and_globs_read_their_files_in_name_order(tmp_path, tokenizer_dir, jsonl_rows):
    from datasets import Dataset

    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "a-0.jsonl", DOCS[:5])
    Dataset.from_list(DOCS[5:9]).to_parquet(str(shards / "a-1.parquet"))
    write_jsonl(shards / "a-2.jsonl", DOCS[9:])
    (shards / "README.md").write_text("not data")  # not a data file: left out
    assert same(rows_of(str(shards), tokenizer_dir, str(tmp_path / "c1")), jsonl_rows)
    assert same(rows_of(str(shards / "a-*"), tokenizer_dir, str(tmp_path / "c2")), jsonl_rows)
    # The cache key covers every file: one changed shard is a new entry.
    s = settings("text", seq=32, packing=False)
    before = cache_key(str(shards), s, tokenizer_dir)
    write_jsonl(shards / "a-2.jsonl", DOCS[9:] + DOCS[:1])
    assert cache_key(str(shards), s, tokenizer_dir) != before


def test_fields_name_other_columns(tmp_path, tokenizer_dir, jsonl_rows):
    from datasets import Dataset

    renamed = [{"content": d["text"], "id": i} for i, d in enumerate(DOCS)]
    Dataset.from_list(renamed).to_parquet(str(tmp_path / "c.parquet"))
    assert same(rows_of(str(tmp_path / "c.parquet"), tokenizer_dir, str(tmp_path / "c1"), text="content"), jsonl_rows)
    path = write_jsonl(tmp_path / "c.jsonl", renamed)
    assert same(rows_of(path, tokenizer_dir, str(tmp_path / "c2"), text="content"), jsonl_rows)
    sft = [{"question": "what is alpha", "answer": "a letter"}, {"question": "and beta", "answer": "the next one"}]
    Dataset.from_list(sft).to_parquet(str(tmp_path / "sft.parquet"))
    fields = dict(prompt="question", response="answer")
    got = rows_of(str(tmp_path / "sft.parquet"), tokenizer_dir, str(tmp_path / "c3"), fmt="sft", **fields)
    plain = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": r["question"], "response": r["answer"]} for r in sft])
    assert same(got, rows_of(plain, tokenizer_dir, str(tmp_path / "c4"), fmt="sft"))


def test_sources_that_cannot_work_are_named(tmp_path, tokenizer_dir):
    from datasets import Dataset

    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.csv").write_text("a,b\n")
    assert source_problems(str(tmp_path / "nowhere.jsonl")) == [f"{tmp_path}/nowhere.jsonl does not exist"]
    assert source_problems(str(tmp_path / "*.parquet")) == [f"{tmp_path}/*.parquet: the pattern matches no file"]
    assert source_problems(str(tmp_path / "empty")) == [
        f"{tmp_path}/empty: a directory without data files (.jsonl, .txt, .parquet, .arrow, .json)"
    ]
    assert source_problems(str(tmp_path / "notes.csv")) == [
        f"{tmp_path}/notes.csv: not a data file this reads (.jsonl, .txt, .parquet, .arrow, .json, or a saved "
        "dataset directory)"
    ]
    # Columns without the format's field: refused before a row is tokenized, with the columns and the knob.
    Dataset.from_list([{"body": "x", "id": 1}]).to_parquet(str(tmp_path / "b.parquet"))
    with pytest.raises(
        WholeFileError, match=r"b.parquet: data.format=text reads a 'text' column, and its columns are "
    ):
        rows_of(str(tmp_path / "b.parquet"), tokenizer_dir, str(tmp_path / "c1"))
    with pytest.raises(WholeFileError, match=r"name the column with data.text_field \(e.g. data.text_field=body\)"):
        rows_of(str(tmp_path / "b.parquet"), tokenizer_dir, str(tmp_path / "c1"))
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(WholeFileError, match=r"broken.parquet: cannot be read as parquet \("):
        rows_of(str(tmp_path / "broken.parquet"), tokenizer_dir, str(tmp_path / "c2"))


def test_a_bad_row_is_named_by_file_and_row(tmp_path, tokenizer_dir):
    from datasets import Dataset

    Dataset.from_list([{"input_ids": [5, 6]}, {"input_ids": [7, 9000]}]).to_parquet(str(tmp_path / "t.parquet"))
    with pytest.raises(DataError, match=r"t.parquet row 1: input_ids must be a non-empty list of ints in \[0, 512\)"):
        rows_of(str(tmp_path / "t.parquet"), tokenizer_dir, str(tmp_path / "c"), fmt="tokens")


def test_config_refuses_empty_or_doubled_column_names(good):  # noqa: F811
    import dataclasses

    cfg = dataclasses.replace(good, data=dataclasses.replace(good.data, text_field=" ", prompt_field="response"))
    problems = problems_of(cfg, 4)
    assert "data.text_field empty: set each to the source's column name (or leave its default)" in problems
    assert "data.*_field: the column 'response' is named for two fields: data.text_field= , data.prompt_field=" in (
        problems
    )


@pytest.mark.multirank
def test_train_py_reads_parquet_shards_with_other_column_names(tmp_path, tiny_ckpt):
    """pipe 2 on parquet shards of SFT pairs under other column names (and a glob for eval): the same losses
    as the same pairs in one JSONL file, micro-batches cut to their longest row on the way through."""
    from datasets import Dataset

    from models.tiny import write_uneven_sft
    from tests.support.parity import parity_args
    from tests.support.ranks import train_run
    from tests.support.runs import read_metrics

    write_uneven_sft(str(tmp_path / "sft.jsonl"), 48)
    pairs = [json.loads(line) for line in open(tmp_path / "sft.jsonl")]
    (tmp_path / "shards").mkdir()
    for i in range(3):
        rows = [{"question": p["prompt"], "answer": p["response"]} for p in pairs[16 * i : 16 * (i + 1)]]
        Dataset.from_list(rows).to_parquet(str(tmp_path / "shards" / f"part-{i}.parquet"))
    optim = dict(lr=1e-3, max_grad_norm=0.0)
    common = dict(num_stages=2, gradient_accumulation_steps=4, loss_chunk_tokens=16, **{"data.format": "sft"})
    runs = {}
    for name, data, extra in (
        ("parquet", str(tmp_path / "shards"), {"data.prompt_field": "question", "data.response_field": "answer"}),
        ("jsonl", str(tmp_path / "sft.jsonl"), {}),
    ):
        args = parity_args(tiny_ckpt, data, str(tmp_path / name), 64, 2, 3, optim, **common, **extra)
        train_run(tmp_path, name, 2, args)
        runs[name] = read_metrics(str(tmp_path / name))
    assert [m["loss"] for m in runs["parquet"]] == [m["loss"] for m in runs["jsonl"]]
    assert all(0 < m["padding"] < 0.5 for m in runs["parquet"])  # rows of 64, cut to each micro-batch's longest
