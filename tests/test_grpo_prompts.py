"""GRPO prompts (data/prompts.py) are the token ids TRL 1.16.0's GRPOTrainer generates from, and the reward columns
are the ones it passes: plain and conversational prompts against its ``_tokenize_prompts``, the columns against its
``_calculate_rewards`` on ``RepeatSampler``'s order, bad records named by file and line with their fix, and the
prompts longer than the budget counted.

A rendering without the generation prompt, with a second BOS before a template's own, or without the plain text's
BOS gives other ids: each is shown to break the equality."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from data.prompts import (
    PromptLengths,
    count_lengths,
    length_report,
    prompt_budget,
    read_prompts,
    render_prompt,
    repeated,
    reward_columns,
    within_budget,
)
from data.records import DataError, SourceStats, WholeFileError

# The template writes its BOS: tokenized with special tokens there would be two
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
GENERATIONS = 3
PLAIN = [
    {"prompt": "The sky is", "answer": "blue", "level": 1},
    {"prompt": "Two and two make", "answer": "four", "level": 2, "completion": "dropped as TRL drops it"},
    {"prompt": "Name a colour:", "answer": "red", "level": 3},
]
CHATS = [
    {"prompt": [{"role": "user", "content": "What colour is the sky?"}], "answer": "blue"},
    {
        "prompt": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Two and two?"},
            {"role": "assistant", "content": "Four."},
            {"role": "user", "content": "And three and three?"},
        ],
        "answer": "six",
    },
]


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    """The tests' sentencepiece Llama tokenizer, as saved (it adds no BOS)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def chat_tok(tokenizer_dir):
    """Adding its BOS to what it tokenizes, with a template that writes its own (Llama 3's way)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, add_bos_token=True)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def trl_prompt_ids(tokenizer, prompts: list) -> list[list[int]]:
    """TRL's ``GRPOTrainer._tokenize_prompts`` itself, on a stand-in trainer (no tools, environments or images)."""
    from trl import GRPOTrainer

    trainer = SimpleNamespace(
        processing_class=tokenizer,
        _is_vlm=False,
        environment_factories=None,
        tools=None,
        chat_template=None,
        chat_template_kwargs={},
    )
    ids, images, fields = GRPOTrainer._tokenize_prompts(trainer, prompts)
    assert images is None and not fields
    return [list(i) for i in ids]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def read_all(path: str, tokenizer, skip: bool = False, stats: SourceStats | None = None) -> list:
    return list(read_prompts(path, tokenizer, skip, stats or SourceStats()))


@pytest.mark.parametrize("add_bos", [True, False], ids=["bos", "no_bos"])
def test_plain_prompts_are_trls(tmp_path, tokenizer_dir, add_bos):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, add_bos_token=add_bos)
    prompts = read_all(write_jsonl(tmp_path / "plain.jsonl", PLAIN), tok)
    assert [p.ids for p in prompts] == trl_prompt_ids(tok, [r["prompt"] for r in PLAIN])
    assert [p.text for p in prompts] == [r["prompt"] for r in PLAIN]
    assert [p.where for p in prompts] == [f"{tmp_path}/plain.jsonl:{i}" for i in (1, 2, 3)]
    if add_bos:  # without the tokenizer's special tokens (its BOS) the ids are not TRL's
        assert all(p.ids[0] == tok.bos_token_id for p in prompts)
        bare = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in PLAIN]
        assert all(b != p.ids for b, p in zip(bare, prompts, strict=True))


def test_conversational_prompts_are_trls(tmp_path, chat_tok):
    from trl import maybe_apply_chat_template

    prompts = read_all(write_jsonl(tmp_path / "chat.jsonl", CHATS), chat_tok)
    theirs = trl_prompt_ids(chat_tok, [r["prompt"] for r in CHATS])
    assert [p.ids for p in prompts] == theirs
    assert [p.text for p in prompts] == [
        maybe_apply_chat_template({"prompt": r["prompt"]}, chat_tok)["prompt"] for r in CHATS
    ]
    assert all(p.ids.count(chat_tok.bos_token_id) == 1 and p.text.endswith("<assistant>") for p in prompts)
    assert [p.prompt for p in prompts] == [r["prompt"] for r in CHATS]  # what the reward functions get as prompts

    # the wrong renderings: no generation prompt; the template's text tokenized with a BOS of the tokenizer's own
    ended = [chat_tok.apply_chat_template(r["prompt"], add_generation_prompt=False, tokenize=False) for r in CHATS]
    no_generation = [chat_tok(text, add_special_tokens=False)["input_ids"] for text in ended]
    two_bos = [chat_tok(p.text)["input_ids"] for p in prompts]
    for wrong in (no_generation, two_bos):
        assert all(w != t for w, t in zip(wrong, theirs, strict=True))


def test_a_prompt_ending_with_an_assistant_turn_gets_the_generation_prompt(chat_tok):
    """TRL's ``_tokenize_prompts`` adds the generation prompt whatever the last role; ``maybe_apply_chat_template``
    (its text for multimodal inputs only) would continue the assistant's turn instead."""
    from trl import maybe_apply_chat_template

    record = {"prompt": [*CHATS[0]["prompt"], {"role": "assistant", "content": "It is"}]}
    ours = render_prompt("f.jsonl:1", record, chat_tok)
    assert [ours.ids] == trl_prompt_ids(chat_tok, [record["prompt"]])
    assert ours.text.endswith("It is</s><assistant>")
    assert maybe_apply_chat_template(record, chat_tok)["prompt"] != ours.text


def test_reward_columns_are_trls(tmp_path, tok):
    """Our columns against what TRL's ``_calculate_rewards`` hands a reward function for inputs in ``RepeatSampler``'s
    order; ``completion`` is dropped as TRL drops it. Interleaved (each prompt once per round) they are not."""
    from transformers import TrainerState
    from trl import GRPOTrainer
    from trl.trainer.utils import RepeatSampler

    prompts = read_all(write_jsonl(tmp_path / "plain.jsonl", PLAIN), tok)
    inputs = [PLAIN[i] for i in RepeatSampler(PLAIN, mini_repeat_count=GENERATIONS, batch_size=3, shuffle=False)]
    seen = {}

    def recording(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **columns):
        seen.update(columns, prompts=prompts)
        return [0.0] * len(prompts)

    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
        reward_funcs=[recording],
        reward_processing_classes=[None],
        reward_func_names=["recording"],
        state=TrainerState(),
        _log_completion_extra=None,
        _log_metric=None,
        environments=None,
        args=SimpleNamespace(report_to=[]),
    )
    n = len(inputs)
    GRPOTrainer._calculate_rewards(trainer, inputs, [x["prompt"] for x in inputs], ["c"] * n, [[1]] * n)
    theirs = seen.pop("prompts")
    ours = reward_columns(prompts, GENERATIONS)
    assert ours == seen and list(ours) == ["answer", "level"]
    assert repeated([p.prompt for p in prompts], GENERATIONS) == theirs
    interleaved = {k: [p.columns[k] for _ in range(GENERATIONS) for p in prompts] for k in ours}
    assert interleaved != seen
    # a record without a column: None there, as a dataset loaded with `datasets` holds it
    assert reward_columns(prompts, 1, ["answer", "source"])["source"] == [None] * 3


def test_bad_records_are_named_with_their_fix(tmp_path, tok, chat_tok):
    rows = [
        {"question": "no prompt"},
        {"prompt": ""},
        {"prompt": 7},
        {"prompt": [{"role": "user"}]},
        {"prompt": ["hello"]},
        {"prompt": [{"role": "user", "content": "a conversation among plain prompts"}]},
        ["not an object"],
        {"prompt": "fine"},
    ]
    rows.insert(0, {"prompt": "first"})
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    stats = SourceStats()
    kept = read_all(path, chat_tok, skip=True, stats=stats)
    assert [p.text for p in kept] == ["first", "fine"]
    assert (stats.lines, stats.examples, stats.skipped_bad_lines) == (9, 2, 7)
    assert stats.bad_line_examples == [
        f"{path}:2: no 'prompt' (keys 'question'): each record holds a 'prompt', a string or a list of "
        "{role, content} messages (data.prompt_field names another column)",
        f"{path}:3: 'prompt' is empty: give the record a prompt to answer, or remove it",
        f"{path}:4: 'prompt' is a int: expected a string (plain text) or a list of {{role, content}} messages "
        "(a conversation)",
        f"{path}:5: 'prompt' message 1 has no 'content': expected an object with string 'role' and 'content'",
        f"{path}:6: 'prompt' message 1 is a str: expected an object with string 'role' and 'content'",
    ]
    with pytest.raises(DataError) as raised:
        read_all(path, chat_tok)
    assert str(raised.value).endswith("(set data.skip_bad_lines=true to skip and count such lines)")
    assert str(raised.value).startswith(f"{path}:2: no 'prompt'")

    mixed = write_jsonl(tmp_path / "mixed.jsonl", [rows[0], rows[6], rows[7]])
    with pytest.raises(DataError, match=r"mixed.jsonl:2: the prompt is a conversation, and the first one \(.*:1\)"):
        read_all(mixed, chat_tok)

    # no chat template: the whole source, never skipped
    chats = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    with pytest.raises(WholeFileError) as raised:
        read_all(chats, tok, skip=True)
    assert str(raised.value) == (
        f"{chats}:1: a conversation is rendered with the tokenizer's chat template, and the tokenizer in "
        f"{tok.name_or_path} has none: use a tokenizer with a chat template (e.g. the instruct model's tokenizer "
        "files), or write the prompts as plain text"
    )
    with pytest.raises(DataError, match="cannot render this prompt"):
        broken = SimpleNamespace(chat_template="x", apply_chat_template=lambda *a, **k: 1 / 0)
        render_prompt("f.jsonl:1", CHATS[0], broken)


def test_prompts_over_the_budget_are_counted_and_left_out(tmp_path, tok):
    prompts = read_all(write_jsonl(tmp_path / "plain.jsonl", PLAIN), tok)
    sizes = sorted(len(p.ids) for p in prompts)
    budget = prompt_budget(sizes[1] + 4, 4)  # the middle one fits exactly
    assert budget == sizes[1]
    lengths = PromptLengths(budget)
    kept = list(within_budget(prompts, lengths))
    assert [len(p.ids) for p in kept] == [n for n in (len(p.ids) for p in prompts) if n <= budget]
    assert (lengths.prompts, lengths.over, lengths.longest) == (3, 1, sizes[2])
    assert count_lengths(prompts, budget) == lengths
    assert length_report("plain.jsonl", lengths) == (
        "",
        f"plain.jsonl: 1 of 3 prompts are longer than {budget} tokens (max_seq_length - max_completion_length; "
        f"the longest has {sizes[2]}): they are left out (raise max_seq_length, lower max_completion_length, or "
        "shorten the prompts to keep them)",
    )
    error, warning = length_report("plain.jsonl", count_lengths(prompts, sizes[0] - 1))
    assert (
        error.endswith(
            "none is left to train on: raise max_seq_length, lower max_completion_length, or shorten the prompts"
        )
        and not warning
    )
    assert length_report("plain.jsonl", count_lengths(prompts, sizes[2])) == ("", "")
    with pytest.raises(ValueError, match="max_completion_length 64 leaves no token of max_seq_length 64"):
        prompt_budget(64, 64)


def test_txt_sources_are_refused(tmp_path, tok):
    path = tmp_path / "prompts.txt"
    path.write_text("a prompt\n")
    with pytest.raises(WholeFileError, match=r"prompts.txt: .txt files hold raw text: write the prompts as JSONL"):
        read_all(str(path), tok)
