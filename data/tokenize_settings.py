"""The settings a source is tokenized with, and the check of a directory scripts/prepare_data.py made against them
(cfg: training.configuration.schema.TrainConfig): shared by the config check, the data's opening and prepare_data.py."""

from __future__ import annotations

import json
import os

from transformers import AutoTokenizer

from data.cache import DataSettings, entry_files_problem, prepared_mismatch, vocab_problem
from data.checks import LOADABLE_TOKENIZER_FILES, field_names, packs, source_formats
from data.sources import is_prepared


def tokenizer_dir(cfg) -> str:
    """Where the tokenizer files are: the checkpoint, or model.tokenizer when training from scratch."""
    return cfg.model_name_or_path or cfg.model.tokenizer


def data_settings(cfg, model_config, fmt: str | None = None) -> DataSettings:
    """The settings a source is tokenized with (``fmt``: a source's own format, default data.format)."""
    pad = model_config.pad_token_id
    fmt = fmt or cfg.data.format
    return DataSettings(
        format=fmt,
        max_seq_length=cfg.data.max_seq_length,
        packing=packs(cfg.data, fmt),
        skip_bad_lines=cfg.data.skip_bad_lines,
        pad_id=pad if pad is not None else 0,  # any id works: padding has label -100 and sits at the row's end
        vocab_size=model_config.vocab_size,
        fields=tuple(sorted((k, v) for k, v in field_names(cfg.data).items() if k != v)),
    )


def prepared_problems(cfg, model_config) -> list[str]:
    """The run's sources that are directories made by scripts/prepare_data.py with other data settings or another
    tokenizer: refused before start (training.configuration.validate.resolve, so the preflight refuses them too), in the
    words the data's opening uses (data.cache.prepared_mismatch)."""
    if model_config is None:
        return []  # resolve_model says why
    d = cfg.data
    keyed = [("data.train_file", d.train_file, None), ("data.eval_file", d.eval_file, None)]
    for key in ("sources", "eval_sources"):
        keyed += [(f"data.{key}[{i}]", s.path, s.format) for i, s in enumerate(getattr(d, key))]
    problems = []
    for key, path, fmt in keyed:
        if path and os.path.isdir(path) and is_prepared(path):
            with open(os.path.join(path, "meta.json")) as f:
                damaged = entry_files_problem(path, json.load(f))
            if damaged:
                problems.append(f"{key} {damaged}")
                continue
            settings = data_settings(cfg, model_config, fmt)
            meta, mismatch = prepared_mismatch(path, settings, tokenizer_dir(cfg) or None)
            if mismatch and meta["settings"].get("format") == settings.format:  # another format: data_problems says it
                problems.append(f"{key} {mismatch}")
    return problems


def vocab_problems(cfg, model_config) -> list[str]:
    """From scratch, model.architecture's vocab_size against model.tokenizer both ways (too few rows, or many more
    than tokens: data.cache.vocab_problem), before start, where a source tokenizes (with data=tokens the ids are the
    data's, checked as they are read). A checkpoint's vocabulary is checked where its data is tokenized (too few
    rows; a tokenized cache already built for the same files needs no tokenizer)."""
    path = tokenizer_dir(cfg)
    if (
        cfg.model_name_or_path
        or model_config is None
        or not path
        or not any(os.path.isfile(os.path.join(path, f)) for f in LOADABLE_TOKENIZER_FILES)
    ):
        return []  # resolve_model or data_problems says why
    if all(fmt == "tokens" for _, fmt in source_formats(cfg.data)):
        return []
    try:
        tokens = len(AutoTokenizer.from_pretrained(path))
    except (OSError, ValueError, TypeError):
        return []  # the data's opening says what is wrong with it, in transformers' words
    problem = vocab_problem(tokens, model_config.vocab_size, path, f"model.architecture (model={cfg.model.name})")
    return [problem] if problem else []
