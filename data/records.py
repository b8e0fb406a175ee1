"""What reading training data yields and how it fails: examples, the counts kept per source, the data errors.
Their own module so that the readers and renderers of each format (data/sources.py, data/render.py,
data/preference_pairs.py) share them."""

from __future__ import annotations

from dataclasses import dataclass, field


class DataError(ValueError):
    """Unusable training data, naming the file and line: a bad row, which data.skip_bad_lines may skip."""


class WholeFileError(DataError):
    """A problem no row can avoid (the tokenizer, the file itself): never skipped, and never hinted at
    data.skip_bad_lines, which would only turn it into "no usable example"."""


@dataclass
class Example:
    """One document or conversation: token ids and their labels (same length)."""

    input_ids: list[int]
    labels: list[int]


@dataclass
class SourceStats:
    """Counts reported after reading a file (and stored in the cache's meta.json)."""

    lines: int = 0  # records read (JSONL lines, or .txt documents)
    examples: int = 0  # examples kept
    tokens: int = 0  # tokens in kept examples, after truncation
    skipped_bad_lines: int = 0  # with data.skip_bad_lines=true
    dropped_no_trainable: int = 0  # SFT examples left with no response token to learn
    identical_pairs: int = 0  # preference pairs whose chosen and rejected rows are the same tokens (nothing to learn)
    truncated: int = 0  # examples cut to max_seq_length
    rows_without_labels: int = 0  # rows dropped for having no label token (only one-token documents make them)
    bytes_read: int = 0  # progress through the file
    bad_line_examples: list[str] = field(default_factory=list)  # first few skipped lines, for the log
