"""GRPO's prompts: records with a ``prompt`` -> the token ids TRL 1.16.0's ``GRPOTrainer`` generates from, and the
columns it passes to the reward functions.

As ``GRPOTrainer._tokenize_prompts`` renders them:

- plain text (``prompt`` a string): ``tokenizer(text=prompt)``, the tokenizer's own special tokens (a BOS for Llama).
- a conversation (``prompt`` a list of ``{role, content}`` messages): the chat template with the generation prompt
  (``add_generation_prompt=True`` whatever the last role), tokenized without special tokens, so a template that
  writes its BOS has one BOS.

Every other column but ``completion`` and ``completion_ids`` (TRL's ``_calculate_rewards`` drops them too) reaches
the reward functions by name, one value per completion: each prompt's value repeated ``num_generations`` times in a
row (TRL's ``RepeatSampler`` order), :func:`reward_columns`.

Length: TRL 1.16 has no ``max_prompt_length`` and never cuts a prompt; here a prompt and its completion share
``max_seq_length``, so a prompt longer than ``max_seq_length - max_completion_length`` tokens is left out and counted
(:func:`within_budget`), not cut from the left: a cut prompt is another question than the one the reward functions
read, and generation from it would not be TRL's. :func:`length_report` words the count for a check before start.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from data.records import DataError, SourceStats, WholeFileError
from data.rewards import NOT_COLUMNS
from data.sources import bad_line, is_saved_dataset, read_records, source_files

# data/sources.py's column check of a dataset source for this format: the sft one reads a 'prompt' column
READ_AS = "sft"
MESSAGE = "an object with string 'role' and 'content'"


@dataclass(frozen=True)
class Prompt:
    """One record's prompt: ``prompt`` as the record holds it (TRL's ``prompts`` argument of the reward functions),
    ``text`` its rendering, ``ids`` the tokens generation starts from, ``columns`` what the reward functions get."""

    where: str
    prompt: str | list
    text: str
    ids: list[int]
    columns: dict

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def render_prompt(where: str, record, tokenizer) -> Prompt:
    """One record -> its :class:`Prompt`; DataError naming ``where`` (``FILE:LINE``) and the fix for a record
    without a usable prompt, WholeFileError for a conversation and a tokenizer without a chat template."""
    prompt = _prompt_of(where, record)
    if isinstance(prompt, str):
        text, ids = prompt, tokenizer(text=prompt)["input_ids"]
    else:
        text, ids = _chat(where, prompt, tokenizer)
    columns = {k: v for k, v in record.items() if k not in NOT_COLUMNS}
    return Prompt(where, prompt, text, ids, columns)


def _prompt_of(where: str, record) -> str | list:
    if not isinstance(record, dict):
        raise DataError(f"{where}: a GRPO record is an object with a 'prompt' (found a {type(record).__name__})")
    if "prompt" not in record:
        found = ", ".join(f"'{k}'" for k in list(record)[:8]) or "none"
        raise DataError(
            f"{where}: no 'prompt' (keys {found}): each record holds a 'prompt', a string or a list of "
            "{role, content} messages (data.prompt_field names another column)"
        )
    prompt = record["prompt"]
    if not isinstance(prompt, (str, list)):
        raise DataError(
            f"{where}: 'prompt' is a {type(prompt).__name__}: expected a string (plain text) or a list of "
            "{role, content} messages (a conversation)"
        )
    if not prompt:
        raise DataError(f"{where}: 'prompt' is empty: give the record a prompt to answer, or remove it")
    for i, message in enumerate(prompt if isinstance(prompt, list) else (), 1):
        if not (isinstance(message, dict) and all(isinstance(message.get(k), str) for k in ("role", "content"))):
            raise DataError(f"{where}: 'prompt' message {i} {_described(message)}: expected {MESSAGE}")
    return prompt


def _described(message) -> str:
    if not isinstance(message, dict):
        return f"is a {type(message).__name__}"
    wrong = [f"'{k}' a {type(message[k]).__name__}" for k in ("role", "content") if k in message]
    missing = [f"no '{k}'" for k in ("role", "content") if k not in message]
    return "has " + ", ".join(missing + [w for w in wrong if not w.endswith(" a str")])


def _chat(where: str, messages: list, tokenizer) -> tuple[str, list[int]]:
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "")
        it = f"the tokenizer in {name}" if name else "this tokenizer"
        raise WholeFileError(
            f"{where}: a conversation is rendered with the tokenizer's chat template, and {it} has none: use a "
            "tokenizer with a chat template (e.g. the instruct model's tokenizer files), or write the prompts as "
            "plain text"
        )
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # templates raise what they like (raise_exception, TypeError, ...)
        roles = ", ".join(m["role"] for m in messages)
        raise DataError(
            f"{where}: the chat template cannot render this prompt (roles {roles}): {type(e).__name__}: {e}"
        ) from None
    # what apply_chat_template(tokenize=True) does with the text: the template wrote the special tokens it wants
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def read_prompts(
    spec: str, tokenizer, skip_bad_lines: bool, stats: SourceStats, fields: dict[str, str] | None = None
) -> Iterator[Prompt]:
    """The prompts of every record ``spec`` names (data/sources.py's ``read_records``), in order. A bad record is
    raised naming it, or skipped and counted with ``skip_bad_lines``; so is a record whose prompt is not of the
    first prompt's kind (plain or conversation): TRL renders a whole batch as its first prompt is."""
    if not is_saved_dataset(spec):
        for path in source_files(spec):
            if path.endswith(".txt"):
                raise WholeFileError(
                    f"{path}: .txt files hold raw text: write the prompts as JSONL ({{'prompt': ...}})"
                )
    first: Prompt | None = None
    for where, record in read_records(spec, READ_AS, skip_bad_lines, stats, fields):
        stats.lines += 1
        try:
            prompt = render_prompt(where, record, tokenizer)
            _check_kind(prompt, first)
        except DataError as e:
            bad_line(e, skip_bad_lines, stats)
            continue
        first = first or prompt
        stats.examples += 1
        stats.tokens += len(prompt.ids)
        yield prompt


def _check_kind(prompt: Prompt, first: Prompt | None) -> None:
    if first is None or prompt.conversational == first.conversational:
        return
    kinds = ("plain text", "a conversation")
    raise DataError(
        f"{prompt.where}: the prompt is {kinds[prompt.conversational]}, and the first one ({first.where}) is "
        f"{kinds[first.conversational]}: write every prompt one way"
    )


def prompt_budget(max_seq_length: int, max_completion_length: int) -> int:
    """The most tokens a prompt may have: its completion needs ``max_completion_length`` of ``max_seq_length``."""
    budget = max_seq_length - max_completion_length
    if budget < 1:
        raise ValueError(
            f"max_completion_length {max_completion_length} leaves no token of max_seq_length {max_seq_length} "
            "for the prompt: raise max_seq_length or lower max_completion_length"
        )
    return budget


@dataclass
class PromptLengths:
    """Prompts seen against a budget: how many, how many longer (left out), and the longest."""

    budget: int
    prompts: int = 0
    over: int = 0
    longest: int = 0


def within_budget(prompts: Iterable[Prompt], lengths: PromptLengths) -> Iterator[Prompt]:
    """The prompts of at most ``lengths.budget`` tokens; the others are counted in ``lengths`` and left out."""
    for prompt in prompts:
        lengths.prompts += 1
        lengths.longest = max(lengths.longest, len(prompt.ids))
        if len(prompt.ids) > lengths.budget:
            lengths.over += 1
        else:
            yield prompt


def count_lengths(prompts: Iterable[Prompt], budget: int) -> PromptLengths:
    """:class:`PromptLengths` of all ``prompts`` (a check before start reads the whole source once)."""
    lengths = PromptLengths(budget)
    for _ in within_budget(prompts, lengths):
        pass
    return lengths


def length_report(source: str, lengths: PromptLengths) -> tuple[str, str]:
    """(error, warning) for prompts longer than the budget: all of them leave nothing to train on (refused), some
    are left out (said once)."""
    if not lengths.over:
        return "", ""
    what = (
        f"{source}: {lengths.over} of {lengths.prompts} prompts are longer than {lengths.budget} tokens "
        f"(max_seq_length - max_completion_length; the longest has {lengths.longest})"
    )
    fix = "raise max_seq_length, lower max_completion_length, or shorten the prompts"
    if lengths.over == lengths.prompts:
        return f"{what}: none is left to train on: {fix}", ""
    return "", f"{what}: they are left out ({fix} to keep them)"


def repeated(items: Sequence, num_generations: int) -> list:
    """One entry per completion, TRL's order: each item ``num_generations`` times in a row."""
    return [item for item in items for _ in range(num_generations)]


def reward_columns(prompts: Sequence[Prompt], num_generations: int, names: Sequence[str] | None = None) -> dict:
    """The columns TRL's ``_calculate_rewards`` passes the reward functions, one value per completion: ``names``
    (default the first prompt's columns, as TRL reads ``inputs[0]``), None where a record lacks one (as a dataset
    loaded with ``datasets`` holds it)."""
    names = list(prompts[0].columns) if names is None else list(names)
    return {name: repeated([p.columns.get(name) for p in prompts], num_generations) for name in names}
