"""Examples -> rows of exactly ``seq_len`` tokens: (input_ids, labels, position_ids).

Every row has the same length because DeepSpeed fixes the shapes sent between pipeline stages.

- Packing: examples are concatenated into rows. ``position_ids`` restart at 0 at each example, which
  is how the decoder stages know where documents begin: attention never crosses that boundary
  (``create_causal_mask`` turns restarts into a per-document causal mask). The first token of each
  example gets label -100, so no token is predicted from another document either. Text documents may
  be split across rows (each piece restarts its positions); SFT examples are never split.
- No packing: one example per row, truncated to ``seq_len`` and right-padded.

Padding: ``pad_id`` tokens with label -100, positions counting on (padding sits at the end of a row,
where causal attention keeps it from affecting any real token). Each row carries its count of real
(non-padding) tokens, so throughput can count the tokens trained on rather than the row length.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from data.records import Example, SourceStats
from models.loss import IGNORE_INDEX

Row = tuple[list[int], list[int], list[int], int]  # input_ids, labels, position_ids (seq_len each); real tokens


def _pad(ids: list[int], labels: list[int], pos: list[int], seq_len: int, pad_id: int) -> Row:
    n = seq_len - len(ids)
    next_pos = pos[-1] + 1 if pos else 0
    return ids + [pad_id] * n, labels + [IGNORE_INDEX] * n, pos + list(range(next_pos, next_pos + n)), len(ids)


def pad_rows(examples: Iterable[Example], seq_len: int, pad_id: int, stats: SourceStats) -> Iterator[Row]:
    """One example per row: truncated to ``seq_len``, then right-padded."""
    for ex in examples:
        if len(ex.input_ids) > seq_len:
            stats.truncated += 1
        ids, labels = ex.input_ids[:seq_len], ex.labels[:seq_len]
        stats.tokens += len(ids)
        yield _pad(ids, labels, list(range(len(ids))), seq_len, pad_id)


def pack_rows(examples: Iterable[Example], seq_len: int, pad_id: int, split: bool, stats: SourceStats) -> Iterator[Row]:
    """Greedy packing in file order. ``split``: an example may continue in the next row (text)."""
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []
    for ex in examples:
        piece_ids, piece_labels = ex.input_ids, ex.labels
        if not split:
            if len(piece_ids) > seq_len:  # SFT examples were truncated already; others are cut here
                stats.truncated += 1
                piece_ids, piece_labels = piece_ids[:seq_len], piece_labels[:seq_len]
            if len(ids) + len(piece_ids) > seq_len:
                yield _pad(ids, labels, pos, seq_len, pad_id)
                ids, labels, pos = [], [], []
        stats.tokens += len(piece_ids)
        while piece_ids:
            take = min(seq_len - len(ids), len(piece_ids))
            ids += piece_ids[:take]
            labels += [IGNORE_INDEX] + piece_labels[1:take]  # not predicted from the previous document
            pos += list(range(take))
            piece_ids, piece_labels = piece_ids[take:], piece_labels[take:]
            if len(ids) == seq_len:
                yield ids, labels, pos, seq_len
                ids, labels, pos = [], [], []
    if ids:
        yield _pad(ids, labels, pos, seq_len, pad_id)
