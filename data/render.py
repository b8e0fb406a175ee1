"""Rendering examples: records (data/sources.py's ``read_records``) -> tokenized examples (input ids + labels),
streamed, with errors naming file and line.

Formats (``data.format``):

- ``tokens``: JSONL ``{"input_ids": [...]}``; labels = input ids.
- ``text``: JSONL ``{"text": "..."}``, or a ``.txt`` file whose documents are separated by blank lines.
  Each document becomes ``[BOS] + tokens + [EOS]`` (the tokenizer's own BOS/EOS, where it defines them).
- ``sft``: JSONL ``{"prompt": ..., "response": ...}``, ``{"messages": [{"role", "content"}, ...]}``, or
  ShareGPT's ``{"conversations": [{"from", "value"}, ...]}`` (mapped to messages); chats are rendered with
  the tokenizer's chat template. Labels are -100 except on response / assistant tokens.
- ``dpo``: JSONL ``{"prompt", "chosen", "rejected"}``, plain text or conversational: two rows per pair, tokenized
  as TRL's DPOTrainer does (data/preference_pairs.py).
"""

from __future__ import annotations

from collections.abc import Iterator

from data.preference_pairs import preference_examples
from data.records import DataError, Example, SourceStats, WholeFileError
from data.sources import bad_line, read_records
from models.loss import IGNORE_INDEX

FORMATS = ("tokens", "text", "sft", "dpo")
TOKENIZE_BATCH = 256  # documents per call of the (Rust, multi-threaded) tokenizer


ROLES = ("system", "user", "assistant", "tool", "ipython")  # what chat templates know; ipython is Llama 3.1's tool
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
CHAT_LAYOUTS = (
    f"'messages' entries with string 'role' and 'content' (role one of {', '.join(ROLES)}), or ShareGPT "
    f"'conversations' entries with string 'from' and 'value' (from one of {', '.join(SHAREGPT_ROLES)})"
)


def read_examples(
    path: str,
    fmt: str,
    tokenizer,
    max_seq_length: int,
    vocab_size: int,
    skip_bad_lines: bool,
    stats: SourceStats,
    fields: dict[str, str] | None = None,
) -> Iterator[Example]:
    """Tokenized examples of ``path`` (any source :func:`read_records` reads), in file order. ``tokenizer``
    is None for ``tokens``."""
    records = read_records(path, fmt, skip_bad_lines, stats, fields)
    return examples_of(records, fmt, tokenizer, max_seq_length, vocab_size, skip_bad_lines, stats)


def examples_of(records, fmt, tokenizer, max_seq_length, vocab_size, skip_bad_lines, stats) -> Iterator[Example]:
    """Tokenized examples of ``(where, record)`` pairs (:func:`read_records`)."""
    for example in _examples(records, fmt, tokenizer, max_seq_length, vocab_size, skip_bad_lines, stats):
        stats.examples += 1
        yield example


def _examples(records, fmt, tokenizer, max_seq_length, vocab_size, skip_bad_lines, stats) -> Iterator[Example]:
    if fmt == "tokens":
        parse = _tokens_example(vocab_size)
        yield from _checked(records, parse, skip_bad_lines, stats)
    elif fmt == "text":
        yield from _text_examples(records, tokenizer, skip_bad_lines, stats)
    elif fmt == "dpo":
        checked = lambda recs, parse: _checked(recs, parse, skip_bad_lines, stats)  # noqa: E731
        yield from preference_examples(records, tokenizer, max_seq_length, stats, checked)
    else:
        sft = SFTRenderer(tokenizer, max_seq_length, stats)
        for example in _checked(records, sft.example, skip_bad_lines, stats):
            if example is None:
                stats.dropped_no_trainable += 1
            else:
                yield example


def _checked(records, parse, skip_bad_lines: bool, stats: SourceStats) -> Iterator:
    for where, record in records:
        stats.lines += 1
        try:
            yield parse(where, record)
        except DataError as e:
            bad_line(e, skip_bad_lines, stats)


def _tokens_example(vocab_size: int):
    def parse(where: str, record) -> Example:
        ids = _field(where, record, "input_ids", list)
        if not ids or not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids):
            raise DataError(f"{where}: input_ids must be a non-empty list of ints in [0, {vocab_size})")
        return Example(ids, list(ids))

    return parse


def _text_examples(records, tokenizer, skip_bad_lines: bool, stats: SourceStats) -> Iterator[Example]:
    """Batched tokenization: [BOS] + tokens + [EOS] per document."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    batch: list[str] = []

    def flush() -> Iterator[Example]:
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            ids = bos + ids + eos
            yield Example(ids, list(ids))
        batch.clear()

    for where, record in records:
        stats.lines += 1
        try:
            text = record if isinstance(record, str) else _field(where, record, "text", str)
        except DataError as e:
            bad_line(e, skip_bad_lines, stats)
            continue
        batch.append(text)
        if len(batch) == TOKENIZE_BATCH:
            yield from flush()
    if batch:
        yield from flush()


class SFTRenderer:
    """prompt/response or chat messages -> Example with labels only on response / assistant tokens.

    prompt/response: ``[BOS] prompt response [EOS]``, the EOS trained so the model learns to stop.
    messages: the chat template's own rendering (it supplies BOS and end-of-turn tokens).
    Over-long examples lose tokens from the left (after a leading BOS) so the final response keeps
    its tokens; if that response alone is too long, its end is cut. An example with no response token
    left gives None, and the caller counts it as dropped.
    """

    def __init__(self, tokenizer, max_seq_length: int, stats: SourceStats):
        self.tok, self.max_len, self.stats = tokenizer, max_seq_length, stats
        self.bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        self.eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def example(self, where: str, record) -> Example | None:
        if isinstance(record, dict) and ("messages" in record or "conversations" in record):
            self._check_chat_tokenizer(where)
            return self._truncate(self._chat_example(where, _chat_messages(where, record)))
        if not isinstance(record, dict) or ("prompt" not in record and "response" not in record):
            raise DataError(
                f"{where}: no SFT fields (found {_describe(record)}): expected 'prompt' and "
                f"'response', or a chat: {CHAT_LAYOUTS}"
            )
        prompt = _field(where, record, "prompt", str)
        response = _field(where, record, "response", str)
        prompt_ids = self.bos + (self.tok(prompt, add_special_tokens=False)["input_ids"] if prompt else [])
        response_ids = self.tok(response, add_special_tokens=False)["input_ids"] + self.eos if response else []
        return self._truncate(Example(prompt_ids + response_ids, [IGNORE_INDEX] * len(prompt_ids) + response_ids))

    def _check_chat_tokenizer(self, where: str) -> None:
        """Chats need a template and character offsets; a tokenizer lacking either fails every chat row."""
        name = getattr(self.tok, "name_or_path", "")
        tokenizer = f"the tokenizer in {name}" if name else "this tokenizer"
        if not getattr(self.tok, "chat_template", None):
            raise WholeFileError(
                f"{where}: chat rows are rendered with the tokenizer's chat template, and {tokenizer} "
                f"has none (a base model's usually has none): use a tokenizer with a chat template, e.g. copy "
                f"the instruct model's tokenizer files there, or write the data as prompt/response rows"
            )
        if not getattr(self.tok, "is_fast", False):
            raise WholeFileError(
                f"{where}: chat rows need a fast tokenizer (for character offsets), and {tokenizer} "
                f"loads as a slow one: add the model's tokenizer.json there"
            )

    def _chat_example(self, where: str, messages: list[dict]) -> Example:
        """The whole rendering tokenized at once (segment-wise tokenization would differ at the
        boundaries); a token is trained when its first character lies in an assistant's content."""
        text, spans = "", []
        for piece, trainable in self._chat_segments(where, messages):
            if trainable:
                spans.append((len(text), len(text) + len(piece)))
            text += piece
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        labels = [
            t if any(a <= start < b for a, b in spans) else IGNORE_INDEX
            for t, (start, _) in zip(ids, enc["offset_mapping"])
        ]
        return Example(ids, labels)

    def _truncate(self, ex: Example) -> Example | None:
        excess = len(ex.input_ids) - self.max_len
        if excess > 0:
            self.stats.truncated += 1
            keep = 1 if self.bos and ex.input_ids[:1] == self.bos else 0
            final_start = _final_trainable_run_start(ex.labels)
            cut = min(excess, max(final_start - keep, 0))  # left side first, never into the final response
            ids = ex.input_ids[:keep] + ex.input_ids[keep + cut :]
            labels = ex.labels[:keep] + ex.labels[keep + cut :]
            ex = Example(ids[: self.max_len], labels[: self.max_len])  # then the response's end
        # Position 0's label is never a target (the loss predicts token t+1 from t).
        return ex if any(label != IGNORE_INDEX for label in ex.labels[1:]) else None

    def _chat_segments(self, where: str, messages: list) -> list[tuple[str, bool]]:
        """Chat template rendering split into (text, is_assistant_content) pieces.

        Each message's text is the difference between the template rendered with and without it, so
        the segments concatenate to exactly the full rendering; an assistant turn is split into its
        header (the generation prompt, not trained) and its content (trained).
        """
        if messages[0]["role"] == "assistant":  # its header would be the rendering of an empty chat
            raise DataError(
                f"{where}: the chat opens with an assistant turn, which has no prompt to answer: "
                f"start it with a user (or system) turn"
            )

        def render(msgs, generation_prompt=False) -> str:
            if not msgs:
                return ""
            try:
                return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)
            except Exception as e:  # templates raise what they like (raise_exception, TypeError, ...)
                roles = ", ".join(m["role"] for m in messages)
                raise DataError(
                    f"{where}: the chat template cannot render this chat (roles {roles}): {type(e).__name__}: {e}"
                ) from None

        segments, done = [], ""
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                header = render(messages[:i], generation_prompt=True)
                full = render(messages[: i + 1])
                if not header.startswith(done) or not full.startswith(header):
                    raise DataError(f"{where}: the chat template does not render conversations incrementally")
                segments += [(header[len(done) :], False), (full[len(header) :], True)]
            else:
                full = render(messages[: i + 1])
                if not full.startswith(done):
                    raise DataError(f"{where}: the chat template does not render conversations incrementally")
                segments.append((full[len(done) :], False))
            done = full
        return segments


def _chat_messages(where: str, record: dict) -> list[dict]:
    """The record's chat as role/content messages: ``messages`` checked, ShareGPT ``conversations`` mapped.

    Anything else is refused: a role the labels do not know would train nothing, or the wrong turns.
    """
    if "messages" in record and "conversations" in record:
        raise DataError(f"{where}: both 'messages' and 'conversations': keep one of them")
    key = "messages" if "messages" in record else "conversations"
    entries = record[key]
    if not isinstance(entries, list) or not entries:
        found = "an empty list" if entries == [] else f"a {type(entries).__name__}"
        raise DataError(f"{where}: '{key}' is {found}: expected {CHAT_LAYOUTS}")
    role_key, text_key = ("role", "content") if key == "messages" else ("from", "value")
    messages = []
    for i, entry in enumerate(entries, 1):
        ok = isinstance(entry, dict) and isinstance(entry.get(role_key), str) and isinstance(entry.get(text_key), str)
        role = entry[role_key] if ok else None
        role = role if key == "messages" else SHAREGPT_ROLES.get(role)
        if role not in ROLES:
            found = ("has " if isinstance(entry, dict) else "is ") + _describe(entry, role_key, text_key)
            raise DataError(f"{where}: '{key}' entry {i} {found}: expected {CHAT_LAYOUTS}")
        messages.append({"role": role, "content": entry[text_key]})
    return messages


def _describe(value, role_key: str = "", text_key: str = "") -> str:
    """What a refused record or chat entry holds, briefly: its keys, its role, a text field's wrong type."""
    if not isinstance(value, dict):
        return f"a {type(value).__name__}"
    found = "keys " + (", ".join(f"'{k}'" for k in list(value)[:8]) or "none")
    if isinstance(value.get(role_key), str):
        found += f", {role_key} '{value[role_key][:40]}'"
    for k in (role_key, text_key):
        if k in value and not isinstance(value[k], str):
            found += f", '{k}' a {type(value[k]).__name__}"
    return found


def _final_trainable_run_start(labels: list[int]) -> int:
    """Index where the last run of trainable labels starts (len(labels) if there is none)."""
    end = len(labels)
    while end > 0 and labels[end - 1] == IGNORE_INDEX:
        end -= 1
    start = end
    while start > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return start if end > 0 else len(labels)


def _field(where: str, record, name: str, kind: type):
    """record[name] checked for presence and type; DataError naming file, line and field otherwise."""
    if not isinstance(record, dict) or name not in record:
        raise DataError(f"{where}: missing field '{name}'")
    value = record[name]
    if not isinstance(value, kind):
        raise DataError(f"{where}: field '{name}' must be a {kind.__name__}, got {type(value).__name__}")
    return value
