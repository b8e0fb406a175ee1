"""Chat data for SFT: the layouts users bring are read (ShareGPT like messages) or refused by name, never
silently dropped; a tokenizer problem is reported as one, without the per-row skip_bad_lines hint."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from data.cache import DataSettings, build_or_reuse
from data.records import DataError, SourceStats
from data.render import read_examples
from models.loss import IGNORE_INDEX

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
# As Llama 2's and Mistral's templates do: a role order the template rejects raises.
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
LAYOUTS = (
    "expected 'messages' entries with string 'role' and 'content' (role one of system, user, assistant, tool, "
    "ipython), or ShareGPT 'conversations' entries with string 'from' and 'value' (from one of system, human, "
    "user, gpt, assistant)"
)
SKIP_HINT = "skip_bad_lines"
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def sft(skip=False) -> DataSettings:
    return DataSettings(format="sft", max_seq_length=64, packing=False, skip_bad_lines=skip, pad_id=0, vocab_size=512)


def with_template(tmp_path_factory, tokenizer_dir, template: str, name: str) -> str:
    path = str(tmp_path_factory.mktemp(name))
    t = AutoTokenizer.from_pretrained(tokenizer_dir)
    t.chat_template = template
    t.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, tokenizer_dir) -> str:
    return with_template(tmp_path_factory, tokenizer_dir, TEMPLATE, "chat_tok")


@pytest.fixture(scope="module")
def chat_tok(chat_dir):
    return AutoTokenizer.from_pretrained(chat_dir)


def read(path, tok, skip=False) -> list:
    return list(read_examples(path, "sft", tok, 64, 512, skip, SourceStats()))


# ---------- ShareGPT is read as messages ----------


def test_sharegpt_conversations_give_the_same_examples_as_messages(tmp_path, chat_tok):
    chats = [
        [("system", "be brief"), ("user", "hi"), ("assistant", "hello")],
        [("user", "a b"), ("assistant", "c d"), ("user", "e"), ("assistant", "f g h")],
    ]
    sharegpt_names = [
        {"system": "system", "user": "human", "assistant": "gpt"},
        {"user": "user", "assistant": "assistant"},  # the role names themselves are seen too
    ]
    messages = [{"messages": [{"role": r, "content": c} for r, c in chat]} for chat in chats]
    conversations = [
        {"id": i, "conversations": [{"from": names[r], "value": c} for r, c in chat]}
        for i, (chat, names) in enumerate(zip(chats, sharegpt_names))
    ]
    want = read(write_jsonl(tmp_path / "messages.jsonl", messages), chat_tok)
    got = read(write_jsonl(tmp_path / "sharegpt.jsonl", conversations), chat_tok)
    assert [(e.input_ids, e.labels) for e in got] == [(e.input_ids, e.labels) for e in want]
    trained = chat_tok.decode([t for t, label in zip(got[1].input_ids, got[1].labels) if label != IGNORE_INDEX])
    assert trained.replace(" ", "") == "cd</s>fgh</s>"  # assistant turns only


# ---------- other layouts are refused, by file:line, with what was found ----------

REFUSED = [
    (  # ShareGPT's keys under 'messages'
        {"messages": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        "bad.jsonl:2: 'messages' entry 1 has keys 'from', 'value': ",
    ),
    (  # a role the labels do not know: it used to train nothing and be counted as "dropped"
        {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]},
        "bad.jsonl:2: 'messages' entry 2 has keys 'role', 'content', role 'bot': ",
    ),
    (  # messages' keys under 'conversations'
        {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        "bad.jsonl:2: 'conversations' entry 1 has keys 'role', 'content': ",
    ),
    (
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "bing", "value": "hello"}]},
        "bad.jsonl:2: 'conversations' entry 2 has keys 'from', 'value', from 'bing': ",
    ),
    (  # OpenAI's multi-part content
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        "bad.jsonl:2: 'messages' entry 1 has keys 'role', 'content', role 'user', 'content' a list: ",
    ),
    ({"messages": []}, "bad.jsonl:2: 'messages' is an empty list: "),
    ({"conversations": ["hi", "hello"]}, "bad.jsonl:2: 'conversations' entry 1 is a str: "),
]


@pytest.mark.parametrize("row, message", REFUSED)
def test_other_chat_layouts_are_refused_with_the_expected_layout(tmp_path, chat_tok, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, row])
    with pytest.raises(DataError) as err:
        read(path, chat_tok)
    assert message + LAYOUTS in str(err.value)


@pytest.mark.parametrize("row, message", REFUSED[:3])
def test_a_file_of_refused_rows_says_why_even_when_skipping(tmp_path, chat_dir, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [row, row])
    with pytest.raises(DataError) as err:
        build_or_reuse(path, sft(skip=True), chat_dir, str(tmp_path / "cache"), print)
    assert "no usable example (2 records read, 2 bad lines skipped" in str(err.value)
    assert f"; first skipped: {tmp_path / message.replace(':2:', ':1:')}{LAYOUTS}" in str(err.value)


def test_an_sft_row_in_no_known_layout_lists_the_layouts(tmp_path, chat_tok):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "hello"}])
    with pytest.raises(DataError) as err:
        read(path, chat_tok)
    assert "bad.jsonl:1: no SFT fields (found keys 'text'): expected 'prompt' and 'response', or a chat: " in str(
        err.value
    )
    assert "ShareGPT 'conversations'" in str(err.value)


# ---------- whole-file problems: a whole-file message ----------


@pytest.mark.parametrize("skip", [False, True])
def test_chat_rows_without_a_chat_template_name_the_tokenizer_and_not_skipping(tmp_path, tokenizer_dir, skip):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "a", "response": "b"}, GOOD])
    with pytest.raises(DataError) as err:
        build_or_reuse(path, sft(skip), tokenizer_dir, str(tmp_path / "cache"), print)
    message = str(err.value)
    assert "chat.jsonl:2: chat rows are rendered with the tokenizer's chat template, and the tokenizer in " in message
    assert f"{tokenizer_dir} has none" in message and "the instruct model's tokenizer" in message
    assert SKIP_HINT not in message and "no usable example" not in message


def test_chat_rows_with_a_slow_tokenizer_name_it_and_not_skipping(tmp_path, chat_dir):
    class Slow:  # transformers 5 loads every tokenizer here as a fast one; older ones load slow ones too
        is_fast = False

        def __getattr__(self, name):
            return getattr(fast, name)

    fast = AutoTokenizer.from_pretrained(chat_dir)
    slow = Slow()
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD])
    for skip in (False, True):
        with pytest.raises(DataError) as err:
            read(path, slow, skip)
        assert "chat.jsonl:1: chat rows need a fast tokenizer (for character offsets), and the tokenizer in " in str(
            err.value
        )
        assert SKIP_HINT not in str(err.value)


# ---------- rows the template cannot render ----------


def test_a_row_the_template_rejects_names_file_line_and_the_templates_error(tmp_path_factory, tmp_path, tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(with_template(tmp_path_factory, tokenizer_dir, STRICT_TEMPLATE, "strict"))
    double_user = {"messages": [{"role": "user", "content": "a"}, *GOOD["messages"]]}
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD, double_user])
    with pytest.raises(DataError) as err:
        read(path, tok)
    assert (
        "chat.jsonl:2: the chat template cannot render this chat (roles user, user, assistant): TemplateError: "
        "Conversation roles must alternate user/assistant/user/assistant/..." in str(err.value)
    )
    stats = SourceStats()
    assert len(list(read_examples(path, "sft", tok, 64, 512, True, stats))) == 1 and stats.skipped_bad_lines == 1


def test_a_chat_opening_with_an_assistant_turn_is_refused_by_file_line(tmp_path, chat_tok):
    row = {"conversations": [{"from": "gpt", "value": "hello"}, {"from": "human", "value": "hi"}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [row])
    with pytest.raises(DataError, match=r"chat.jsonl:1: the chat opens with an assistant turn, which has no prompt"):
        read(path, chat_tok)
