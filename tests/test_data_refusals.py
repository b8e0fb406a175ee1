"""Data settings that cannot work (missing fields, a source's format against the run's, per-source advice given
globally) are refused before start with the knob to change.

The cases:

- a data.<field>_field naming a column that is not there (never read as the default column instead);
- a source's own ``format`` bypassing a whole-run rule on data.format (pairs need train_objective=dpo, the
  tokenizer check, the packing default);
- advice for one source given as a global setting (a mistyped source key, an SFT file or a .txt file in a
  mixture of another format)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from data.checks import data_problems, default_packing, packs
from data.sources import SourceStats, first_record_problems, read_records
from tests.support.scripts import run_script
from tests.test_data import write_jsonl
from training.configuration.overrides import override_key_problems
from training.configuration.schema import DataConfig, SourceConfig, TrainConfig
from training.configuration.validate import objective_problems

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = "a source's keys are path, weight, name, format"


def cfg_of(**data) -> TrainConfig:
    return TrainConfig(data=DataConfig(**data))


def fields_of(**set_) -> dict[str, str]:
    from data.checks import field_names

    return field_names(DataConfig(**{f"{k}_field": v for k, v in set_.items()}))


# 2. A setting naming something that is not there, silently replaced by a default.


def test_a_text_field_missing_from_a_parquet_is_refused_not_read_as_text(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "docs.parquet")
    pq.write_table(pa.table({"text": ["a document"], "id": [1]}), path)
    assert first_record_problems(path, "text", fields_of(text="clen")) == [
        f"{path}: data.text_field=clen names a column that is not there (its columns are text, id): set "
        "data.text_field to the column holding the text (or drop it to read 'text')"
    ]


def test_a_prompt_field_missing_from_jsonl_rows_is_refused_by_the_config_check(tmp_path):
    path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "q", "response": "a"}])
    cfg = cfg_of(train_file=path, format="sft", prompt_field="question")
    assert data_problems(cfg) == [
        f"data.train_file {path}: data.prompt_field=question names a column that is not there (its first record's "
        "keys are prompt, response): set data.prompt_field to the column holding the prompt (or drop it to read "
        "'prompt')"
    ]
    # the same rule per source of a mixture, and for a chat column (data.messages_field)
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    cfg = cfg_of(format="sft", sources=[SourceConfig(path=chat)], messages_field="chat")
    assert data_problems(cfg) == [
        f"data.sources[0] {chat}: data.messages_field=chat names a column that is not there (its first record's "
        "keys are messages): set data.messages_field to the column holding the messages (or drop it to read "
        "'messages')"
    ]


def test_a_renamed_field_never_reads_the_default_column(tmp_path):
    # data.text_field=body on rows holding both: the body, whatever the column order (it was the later column)
    path = write_jsonl(tmp_path / "both.jsonl", [{"body": "the body", "text": "not this"}])
    records = list(read_records(path, "text", False, SourceStats(), {"text": "body"}))
    assert records == [(f"{path}:1", {"text": "the body"})]
    # two fields swapped read each other's column
    swapped = list(read_records(path, "sft", False, SourceStats(), {"prompt": "text", "response": "body"}))
    assert swapped == [(f"{path}:1", {"response": "the body", "prompt": "not this"})]


def test_dpo_fields_that_are_not_there_are_named_together(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}])
    assert first_record_problems(path, "dpo", fields_of(chosen="good", rejected="bad")) == [
        f"{path}: data.chosen_field=good, data.rejected_field=bad name columns that are not there (its first "
        "record's keys are prompt, chosen, rejected): set data.chosen_field to the column holding the chosen "
        "(or drop it to read 'chosen') and data.rejected_field to the column holding the rejected (or drop it to "
        "read 'rejected')"
    ]


# 3. A per-source setting that bypasses a whole-run rule.


def test_a_dpo_source_in_an_sft_mixture_is_refused(tmp_path):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}])
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "q", "response": "a"}])
    cfg = cfg_of(format="sft", sources=[SourceConfig(path=sft), SourceConfig(path=pairs, format="dpo")])
    cfg = dataclasses.replace(cfg, train_objective="sft")
    assert objective_problems(cfg, layout=None) == [
        f"data.sources[1] ({pairs}) has format dpo, and train_objective is sft: its preference pairs would train "
        "as two SFT rows each (the rejected completion a target); drop the source from the mixture, or train on it "
        f"alone (data=dpo data.train_file={pairs})"
    ]
    evals = dataclasses.replace(
        cfg.data, sources=[SourceConfig(path=sft)], eval_sources=[SourceConfig(pairs, format="dpo")]
    )
    assert "data.eval_sources[0] (" in objective_problems(dataclasses.replace(cfg, data=evals), layout=None)[0]


def test_a_source_that_tokenizes_needs_the_tokenizer_under_data_format_tokens(tmp_path):
    chat = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "q", "response": "a"}])
    tokens = write_jsonl(tmp_path / "tokens.jsonl", [{"input_ids": [1, 2]}])
    (tmp_path / "ckpt").mkdir()  # a checkpoint without tokenizer files
    cfg = cfg_of(sources=[SourceConfig(path=tokens), SourceConfig(path=chat, format="sft")])
    cfg = dataclasses.replace(cfg, model_name_or_path=str(tmp_path / "ckpt"))
    assert data_problems(cfg) == [
        f"data.sources[1] ({chat}) format sft tokenizes with the model's tokenizer, but {tmp_path}/ckpt has none "
        "(tokenizer.json or tokenizer.model): copy the tokenizer files there"
    ]


def test_the_packing_default_follows_each_sources_format():
    text = DataConfig(format="tokens", sources=[SourceConfig(path="a.txt", format="text")])
    assert default_packing(text) and packs(text, "text") and not packs(text, "sft")
    mixed = DataConfig(format="text", sources=[SourceConfig(path="a.txt"), SourceConfig(path="b", format="sft")])
    assert not default_packing(mixed)  # the SFT rows are padded: grouping by length and the padding hint act
    assert default_packing(dataclasses.replace(mixed, packing=True))


# 6. Messages that point the wrong way.


def test_a_typo_inside_a_source_names_the_key_and_a_sources_keys():
    assert override_key_problems(["data.sources=[{path: a.jsonl, weigth: 3}]"]) == [
        f"unknown key weigth in data.sources[0]: did you mean weight? ({KEYS})"
    ]
    assert override_key_problems(
        ["data.eval_sources=[a.jsonl, {path: b.jsonl, format: sfft, weight: abc}]", "data.sources={path: c}"]
    ) == [
        f"data.eval_sources[0] 'a.jsonl' is not a source: write it as {{path: a.jsonl}} ({KEYS})",
        "data.eval_sources[1] format 'sfft': set one of tokens, text, sft, dpo, grpo, or leave it out (the source then "
        "has data.format)",
        "data.eval_sources[1] weight 'abc' is not a number: set e.g. weight: 3",
        f"data.sources is a list of sources, e.g. data.sources='[{{path: a.jsonl, weight: 3}}]' ({KEYS})",
    ]
    assert override_key_problems(["data.sources=[{path: a.jsonl, weight: 3, name: a, format: sft}]"]) == []


def test_an_sft_file_in_a_text_mixture_is_told_its_own_format(tmp_path):
    (tmp_path / "a.txt").write_text("a document\n")
    sft = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "q", "response": "a"}])
    cfg = cfg_of(format="text", sources=[SourceConfig(path=str(tmp_path / "a.txt")), SourceConfig(path=sft)])
    assert data_problems(cfg) == [
        f"data.sources[1] {sft}: data.format=text reads a 'text' column, and its first record's keys are prompt, "
        f"response: give this source its own format ({{path: {sft}, format: sft}})"
    ]


def test_a_txt_file_in_an_sft_mixture_is_told_its_own_format_before_start(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("a document\n")
    sft = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "q", "response": "a"}])
    cfg = cfg_of(format="sft", sources=[SourceConfig(path=str(txt)), SourceConfig(path=sft)])
    assert data_problems(cfg) == [
        f"data.sources[0] {txt}: .txt files hold raw text, and this source's format is sft: give this source its "
        f"own format ({{path: {txt}, format: text}})"
    ]
    assert data_problems(cfg_of(format="sft", train_file=str(txt))) == [
        f"data.train_file {txt}: .txt files hold raw text; use data.format=text or a .jsonl file"
    ]


def test_a_prepared_directory_of_another_format_is_told_its_own_format_before_start(tmp_path):
    prepared = tmp_path / "chat-prepared"
    prepared.mkdir()
    (prepared / "meta.json").write_text(json.dumps({"prepared": 1, "settings": {"format": "sft"}}))
    cfg = cfg_of(format="text", sources=[SourceConfig(path=str(prepared))])
    assert data_problems(cfg) == [
        f"data.sources[0] {prepared}: prepared as format sft, and this source's format is text: give this source "
        f"its own format ({{path: {prepared}, format: sft}}), or prepare it again as text"
    ]
    assert data_problems(cfg_of(format="text", train_file=str(prepared))) == [
        f"data.train_file {prepared}: prepared as format sft, and data.format is text: set data.format=sft, or "
        "prepare it again as text"
    ]


def test_a_source_without_its_formats_column_is_told_the_field_names_it_everywhere(tmp_path):
    body = write_jsonl(tmp_path / "b.jsonl", [{"body": "x"}])
    cfg = cfg_of(format="text", sources=[SourceConfig(path=body, format="text")])
    assert data_problems(cfg) == [
        f"data.sources[0] {body}: its format text reads a 'text' column, and its first record's keys are body: name "
        "the column with data.text_field (e.g. data.text_field=body), which names it in every source"
    ]


def test_prepare_data_and_preflight_refuse_a_missing_field_and_a_source_typo(tmp_path, capsys):
    from scripts.prepare_data import main as prepare
    from training.configuration.preflight import check

    path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "q", "response": "a"}])
    args = ["data=sft", f"data.train_file={path}", "data.prompt_field=question"]
    assert prepare(["--output", str(tmp_path / "out"), *args]) == 1
    assert "data.prompt_field=question names a column that is not there" in capsys.readouterr().err
    with pytest.raises(ValueError, match="data.prompt_field=question names a column that is not there"):
        check(1, args)
    with pytest.raises(ValueError, match=r"unknown key weigth in data.sources\[0\]: did you mean weight\?"):
        check(1, [f"data.sources=[{{path: {path}, weigth: 3}}]"])


@pytest.mark.e2e
def test_train_py_refuses_a_missing_field_and_a_source_typo(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "docs.parquet")
    pq.write_table(pa.table({"text": ["a document"]}), path)

    def train(*args: str) -> str:
        proc = run_script(["train.py", *args])
        assert proc.returncode == 1, proc.stdout + proc.stderr
        return proc.stderr

    err = train("data=text", f"data.train_file={path}", "data.text_field=clen", f"output_dir={tmp_path}/out")
    assert f"{path}: data.text_field=clen names a column that is not there (its columns are text)" in err
    err = train(f"data.sources=[{{path: {path}, weigth: 3}}]")
    assert "train.py: error: invalid configuration:\n  unknown key weigth in data.sources[0]: did you mean " in err
    assert "+data.sources" not in err  # Hydra's advice to add the typo
