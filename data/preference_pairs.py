"""Preference pairs (``data.format=dpo``): ``{"prompt", "chosen", "rejected"}`` rows -> pairs of training rows.

Tokenized as TRL's ``DPOTrainer`` tokenizes them, so the same pairs give the same tokens:

- plain text: the prompt is tokenized alone and with each completion (``prompt + chosen``, the tokenizer's own
  special tokens, a BOS for Llama); the tokenizer's EOS text is appended to a completion that lacks it.
- conversational (``prompt`` a list of messages, ``chosen``/``rejected`` lists of assistant messages): the chat
  template renders the prompt with the generation prompt, and prompt + completion without it.
- the completion starts where the tokenized prompt and prompt + completion first differ (a template or a token
  merging across the boundary can make the prompt's tokenization differ from its start in the whole).

Truncation (TRL's ``keep_start``): each sequence keeps its first ``max_seq_length`` tokens; a pair whose prompt
alone fills ``max_seq_length`` is dropped (no completion token would be left) and counted.

In the cache a pair is two consecutive rows, chosen (2i) then rejected (2i + 1); labels are -100 on the prompt.
A micro-batch of B pairs is fed as 2B rows, the B chosen then the B rejected (TRL's order), and its labels are
``(labels [2B,S], pair ids [B], reference log-probabilities [2B] fp64)`` (the reference ones NaN until the reference
pass has filled them, so a missing reference can never pass for a zero one).
"""

from __future__ import annotations

import contextlib
import hashlib
import os

import numpy as np
import torch
from torch.utils.data import Dataset

from data.records import DataError, Example, SourceStats, WholeFileError
from models.loss import IGNORE_INDEX

REFERENCE_DTYPE = np.float64  # as the loss sums each sequence's log-probabilities (models/loss.py)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _is_messages(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


class PreferenceRenderer:
    """One ``{"prompt", "chosen", "rejected"}`` record -> (chosen, rejected) examples, or None when the prompt
    alone fills ``max_seq_length`` (counted in ``stats.dropped_no_trainable``)."""

    def __init__(self, tokenizer, max_seq_length: int, stats: SourceStats):
        self.tok, self.max_len, self.stats = tokenizer, max_seq_length, stats
        self.eos_text = tokenizer.eos_token

    def pair(self, where: str, record) -> tuple[Example, Example] | None:
        if not isinstance(record, dict):
            raise DataError(f"{where}: a preference row is an object with 'prompt', 'chosen' and 'rejected'")
        missing = [k for k in ("prompt", "chosen", "rejected") if k not in record]
        if missing:
            found = ", ".join(map(repr, record)) or "nothing"
            raise DataError(
                f"{where}: missing field(s) {', '.join(map(repr, missing))} of a preference row (found {found}): "
                "each row holds 'prompt', 'chosen' and 'rejected' (data.<name>_field names other columns)"
            )
        prompt, chosen, rejected = record["prompt"], record["chosen"], record["rejected"]
        if all(isinstance(v, str) for v in (prompt, chosen, rejected)):
            ids = self._plain(where, prompt, chosen, rejected)
        elif all(_is_messages(v) for v in (prompt, chosen, rejected)):
            ids = self._chat(where, prompt, chosen, rejected)
        else:
            kinds = ", ".join(f"{k} {_kind(record[k])}" for k in ("prompt", "chosen", "rejected"))
            raise DataError(
                f"{where}: 'prompt', 'chosen' and 'rejected' must all be strings (plain text) or all lists of "
                f"{{role, content}} messages (conversational); found {kinds}"
            )
        prompt_ids, with_chosen, with_rejected = ids
        start = min(_common_prefix(prompt_ids, with_chosen), _common_prefix(prompt_ids, with_rejected))
        pair = self._example(with_chosen, start), self._example(with_rejected, start)
        # a prompt filling max_seq_length leaves no completion token; position 0 is never a target
        if any(all(label == IGNORE_INDEX for label in ex.labels[1:]) for ex in pair):
            self.stats.dropped_no_trainable += 1
            return None
        self.stats.identical_pairs += pair[0].input_ids == pair[1].input_ids
        return pair

    def _example(self, ids: list[int], start: int) -> Example:
        if len(ids) > self.max_len:
            self.stats.truncated += 1
        ids = ids[: self.max_len]  # keep_start
        return Example(ids, [IGNORE_INDEX] * start + ids[start:])

    def _plain(self, where: str, prompt: str, chosen: str, rejected: str) -> tuple[list[int], ...]:
        if self.eos_text is None:
            raise WholeFileError(
                f"{where}: plain-text pairs end each completion with the tokenizer's EOS, and this tokenizer has "
                "none: use a tokenizer that defines eos_token"
            )
        chosen = chosen if chosen.endswith(self.eos_text) else chosen + self.eos_text
        rejected = rejected if rejected.endswith(self.eos_text) else rejected + self.eos_text
        return tuple(self.tok(text=t)["input_ids"] for t in (prompt, prompt + chosen, prompt + rejected))

    def _chat(self, where: str, prompt: list, chosen: list, rejected: list) -> tuple[list[int], ...]:
        if not getattr(self.tok, "chat_template", None):
            raise WholeFileError(
                f"{where}: conversational pairs are rendered with the tokenizer's chat template, and this tokenizer "
                "has none: use a tokenizer with a chat template, or write the pairs as plain text"
            )

        def render(messages: list, generation_prompt: bool = False) -> list[int]:
            try:
                return self.tok.apply_chat_template(
                    messages, tokenize=True, return_dict=True, add_generation_prompt=generation_prompt
                )["input_ids"]
            except Exception as e:  # templates raise what they like (raise_exception, TypeError, ...)
                roles = ", ".join(str(m.get("role")) for m in messages)
                raise DataError(
                    f"{where}: the chat template cannot render this pair (roles {roles}): {type(e).__name__}: {e}"
                ) from None

        return render(prompt, generation_prompt=True), render(prompt + chosen), render(prompt + rejected)


def _kind(value) -> str:
    if isinstance(value, str):
        return "a string"
    if _is_messages(value):
        return "messages"
    return f"a {type(value).__name__}"


def preference_examples(records, tokenizer, max_seq_length: int, stats: SourceStats, checked):
    """The examples of ``(where, record)`` preference rows: chosen then rejected of each kept pair. ``checked``
    is data.sources' per-record error handling (named, or skipped with data.skip_bad_lines)."""
    renderer = PreferenceRenderer(tokenizer, max_seq_length, stats)
    for pair in checked(records, renderer.pair):
        if pair is not None:
            yield from pair


def identical_pairs_report(source: str, identical: int, pairs: int) -> tuple[str, str]:
    """(error, warning) for a source's pairs whose chosen and rejected completions tokenize alike: their DPO loss
    is log 2 and their gradient zero whatever the model, so a source of nothing else cannot train (refused), and
    some of them dilute each batch (said once)."""
    if not identical:
        return "", ""
    what = f"{source}: {identical} of {pairs} preference pairs have chosen == rejected (the same tokens)"
    if identical == pairs:
        return f"{what}: DPO learns nothing from them (loss log 2, gradient 0); check the data's chosen/rejected", ""
    return "", f"{what}: they add loss log 2 and no gradient to their batches; remove them from the data"


class PairBlocks(Dataset):
    """The pairs of a preference cache entry (``TokenBlocks`` rows 2i and 2i + 1), optionally a subset of them
    (an eval split). Each sample is a pair: ``input_ids``/``labels``/``position_ids`` [2,S], ``num_tokens`` (both
    rows' real tokens), ``longest`` (the longer row's), ``pair`` (its id in the entry) and, once
    :meth:`attach_reference` has run, ``reference`` [2]."""

    def __init__(self, rows, indices: np.ndarray | None = None, tables: dict | None = None):
        if len(rows) % 2:
            raise DataError(f"{rows.entry} holds {len(rows)} rows: a preference cache holds pairs of rows")
        self.rows, self.indices = rows, indices
        self.entry = rows.entry
        # Shared with every subset of the entry: the reference attached to the training split reaches the eval
        # split (data.eval_fraction) cut from the same entry before it.
        self._tables = {} if tables is None else tables

    @property
    def num_pairs(self) -> int:
        """Pairs of the whole entry (a subset's ids index these)."""
        return len(self.rows) // 2

    @property
    def reference(self) -> np.ndarray | None:
        return self._tables.get("reference")

    def subset(self, indices: np.ndarray) -> PairBlocks:
        return PairBlocks(self.rows, indices, self._tables)

    def attach_reference(self, reference: np.ndarray) -> None:
        """The reference log-probabilities of every pair of the entry, float64 [pairs, 2] (chosen, rejected), for
        this dataset and every subset of the same entry."""
        if reference.shape != (self.num_pairs, 2):
            raise ValueError(f"reference of shape {reference.shape} for {self.num_pairs} pairs")
        self._tables["reference"] = reference

    def __len__(self) -> int:
        return self.num_pairs if self.indices is None else len(self.indices)

    def pair_id(self, i: int) -> int:
        return int(i if self.indices is None else self.indices[i])

    def __getitem__(self, i: int) -> dict:
        pair = self.pair_id(i)
        chosen, rejected = self.rows[2 * pair], self.rows[2 * pair + 1]
        sample = {n: torch.stack([chosen[n], rejected[n]]) for n in ("input_ids", "labels", "position_ids")}  # [2,S]
        sample.update(
            num_tokens=chosen["num_tokens"] + rejected["num_tokens"],
            longest=max(chosen["num_tokens"], rejected["num_tokens"]),
            pair=pair,
        )
        if self.reference is not None:
            sample["reference"] = torch.from_numpy(self.reference[pair].copy())  # [2]
        return sample

    def lengths(self) -> np.ndarray:
        """Real tokens of each of these pairs' longer row, int32 [N] (data.group_by_length sorts by it)."""
        rows = self.rows.lengths()
        longest = np.maximum(rows[0::2], rows[1::2])
        return longest if self.indices is None else longest[self.indices]

    def total_tokens(self) -> int:
        rows = self.rows.lengths().astype(np.int64)
        pairs = rows[0::2] + rows[1::2]
        return int(pairs.sum() if self.indices is None else pairs[self.indices].sum())


# ---------- the reference log-probabilities, stored beside the tokenized cache ----------


def reference_path(entry: str, model_key: str) -> str:
    """Where an entry's reference log-probabilities for the model ``model_key`` live: inside the cache entry."""
    return os.path.join(entry, f"reference-{model_key}.npy")


def model_key(parts: list[str]) -> str:
    """A short key of what fixes the reference: the starting model's identity and the settings it runs with."""
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def load_reference(path: str) -> np.ndarray | None:
    return np.load(path) if os.path.isfile(path) else None


def save_reference(path: str, reference: np.ndarray) -> None:
    """Written to a temporary file and renamed: a crash never leaves a half-written table that looks complete."""
    tmp = f"{path}.tmp-{os.getpid()}.npy"
    try:
        np.save(tmp, reference.astype(REFERENCE_DTYPE))
    except OSError as e:  # a full disk: a file object's error names no file (train.py's message names this one)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OSError(e.errno, e.strerror, e.filename or path) from e
    os.replace(tmp, path)
