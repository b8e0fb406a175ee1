"""Data pipeline: formats, packing, SFT masking, cache, sharding, resume, bad input."""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from data.cache import DataSettings, TokenBlocks, build_or_reuse
from data.order_guard import fingerprint
from data.packing import pack_rows, pad_rows
from data.records import DataError, Example, SourceStats
from data.render import read_examples
from data.sampling import MicroBatchIterator, PlaceholderDataset, collate
from models.loss import IGNORE_INDEX
from training.data_setup import split_eval

I = IGNORE_INDEX  # noqa: E741


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def settings(fmt="text", seq=16, packing=True, skip=False, vocab=512) -> DataSettings:
    return DataSettings(
        format=fmt, max_seq_length=seq, packing=packing, skip_bad_lines=skip, pad_id=0, vocab_size=vocab
    )


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory, tokenizer_dir) -> str:
    """The tiny tokenizer with a Llama-3-like chat template."""
    path = str(tmp_path_factory.mktemp("chat_tok"))
    t = AutoTokenizer.from_pretrained(tokenizer_dir)
    t.chat_template = (
        "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    t.save_pretrained(path)
    return path


# ---------- packing and padding ----------


def test_packing_restarts_positions_and_masks_document_starts():
    stats = SourceStats()
    examples = [
        Example([1, 5, 6, 2], [1, 5, 6, 2]),
        Example([1, 7, 2], [1, 7, 2]),
        Example([1, 8, 9, 10, 11, 2], [1, 8, 9, 10, 11, 2]),
    ]
    rows = list(pack_rows(examples, seq_len=6, pad_id=0, split=True, stats=stats))
    assert rows[0] == ([1, 5, 6, 2, 1, 7], [I, 5, 6, 2, I, 7], [0, 1, 2, 3, 0, 1], 6)
    assert rows[1] == ([2, 1, 8, 9, 10, 11], [I, I, 8, 9, 10, 11], [0, 0, 1, 2, 3, 4], 6)  # continuation restarts
    assert rows[2] == ([2, 0, 0, 0, 0, 0], [I, I, I, I, I, I], [0, 1, 2, 3, 4, 5], 1)  # padded tail
    assert stats.tokens == 13


def test_sft_packing_never_splits_an_example():
    examples = [Example([1, 5, 6], [I, 5, 6]), Example([1, 7, 8, 9], [I, I, 8, 9])]
    rows = list(pack_rows(examples, seq_len=5, pad_id=0, split=False, stats=SourceStats()))
    assert rows == [
        ([1, 5, 6, 0, 0], [I, 5, 6, I, I], [0, 1, 2, 3, 4], 3),
        ([1, 7, 8, 9, 0], [I, I, 8, 9, I], [0, 1, 2, 3, 4], 4),
    ]


def test_no_packing_truncates_and_pads_with_ignored_labels():
    stats = SourceStats()
    rows = list(pad_rows([Example([5, 6, 7, 8, 9], [5, 6, 7, 8, 9]), Example([5, 6], [5, 6])], 4, 0, stats))
    assert rows == [([5, 6, 7, 8], [5, 6, 7, 8], [0, 1, 2, 3], 4), ([5, 6, 0, 0], [5, 6, I, I], [0, 1, 2, 3], 2)]
    assert stats.truncated == 1


def test_packed_block_loss_equals_documents_run_separately():
    """Per-document attention really isolates documents: per-token losses of a packed row equal the
    per-token losses of each document run alone (stage chain, fp32)."""
    from transformers import LlamaForCausalLM

    from models.llama_pipe import build_sequential
    from models.tiny import tiny_config
    from tests.test_stage_parity import copy_hf_weights, run_chain

    torch.manual_seed(0)
    config = tiny_config(vocab_size=300)
    hf = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    funcs = build_sequential(config)
    copy_hf_weights(funcs, config, hf.state_dict())
    docs = [torch.randint(3, 300, (n,)).tolist() for n in (9, 5, 12)]
    ids, labels, pos, _ = next(pack_rows([Example(d, d) for d in docs], 26, 0, split=True, stats=SourceStats()))
    logits = run_chain(funcs, torch.tensor([ids]), torch.tensor([pos]))[0]  # [S,V]
    packed = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(labels[1:]), ignore_index=I, reduction="none")
    separate, offset = [], 0
    for d in docs:
        doc_logits = run_chain(funcs, torch.tensor([d]), torch.arange(len(d))[None])[0]
        separate.append(torch.nn.functional.cross_entropy(doc_logits[:-1], torch.tensor(d[1:]), reduction="none"))
        # in the packed row: targets offset+1 .. offset+len-1; the target at offset (doc start) is ignored
        torch.testing.assert_close(packed[offset : offset + len(d) - 1], separate[-1], rtol=0, atol=1e-5)
        if offset > 0:
            assert packed[offset - 1] == 0  # the cross-document target is ignored (loss 0 with reduction none)
        offset += len(d)
    assert (torch.tensor(labels[1:]) != I).sum() == sum(len(d) - 1 for d in docs)  # nothing else is trained


# ---------- SFT ----------


def test_sft_labels_only_on_the_response(tmp_path, tok):
    path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "What is a list?", "response": "A mutable sequence."}])
    (ex,) = read_examples(path, "sft", tok, 64, 512, False, SourceStats())
    prompt = [tok.bos_token_id] + tok("What is a list?", add_special_tokens=False)["input_ids"]
    response = tok("A mutable sequence.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ex.input_ids == prompt + response
    assert ex.labels == [I] * len(prompt) + response


def test_sft_truncates_the_prompt_side_and_drops_examples_without_response(tmp_path, tok):
    long_prompt = "def f(x): return x + 1. " * 20
    path = write_jsonl(
        tmp_path / "sft.jsonl",
        [
            {"prompt": long_prompt, "response": "ok then"},
            {"prompt": "hello", "response": ""},
        ],
    )
    stats = SourceStats()
    examples = list(read_examples(path, "sft", tok, 16, 512, False, stats))
    assert len(examples) == 1 and stats.dropped_no_trainable == 1 and stats.truncated == 1
    ex = examples[0]
    response = tok("ok then", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert len(ex.input_ids) == 16
    assert ex.input_ids[0] == tok.bos_token_id  # BOS kept
    assert ex.input_ids[-len(response) :] == response and ex.labels[-len(response) :] == response  # response whole
    assert all(label == I for label in ex.labels[: -len(response)])


def test_sft_chat_messages_train_only_assistant_turns(tmp_path, chat_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "see you"},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    (ex,) = read_examples(path, "sft", tok, 256, 512, False, SourceStats())
    full = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(ex.input_ids) == tok.decode(tok(full, add_special_tokens=False)["input_ids"])
    trained = tok.decode([t for t, label in zip(ex.input_ids, ex.labels) if label != I])
    assert trained.replace(" ", "") == "hello</s>seeyou</s>"


def test_chat_messages_without_a_template_fail_clearly(tmp_path, tok):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DataError, match=r"chat.jsonl:1: chat rows are rendered with the tokenizer's chat template"):
        list(read_examples(path, "sft", tok, 64, 512, False, SourceStats()))


# ---------- text ----------


def test_text_documents_get_bos_and_eos_and_txt_splits_on_blank_lines(tmp_path, tok):
    (tmp_path / "c.txt").write_text("first doc\nline two\n\n\nsecond doc\n")
    docs = list(read_examples(str(tmp_path / "c.txt"), "text", tok, 64, 512, False, SourceStats()))
    assert len(docs) == 2
    assert docs[0].input_ids == [tok.bos_token_id] + tok("first doc\nline two", add_special_tokens=False)[
        "input_ids"
    ] + [tok.eos_token_id]


# ---------- bad input ----------


@pytest.mark.parametrize(
    "fmt, content, message",
    [
        ("text", b'{"text": "a"}\n{"text": "b"\n', "bad.jsonl:2: malformed JSON"),
        ("text", b'{"text": "a"}\n{"body": "b"}\n', "bad.jsonl:2: missing field 'text'"),
        ("sft", b'{"prompt": "a"}\n', "bad.jsonl:1: missing field 'response'"),
        ("text", b'{"text": 3}\n', "bad.jsonl:1: field 'text' must be a str, got int"),
        ("text", b'{"text": "a"}\n{"text": "caf\xe9"}\n', "bad.jsonl:2: not valid UTF-8 (byte 0xe9 at column 14)"),
        (
            "tokens",
            b'{"input_ids": [1, 9999]}\n',
            "bad.jsonl:1: input_ids must be a non-empty list of ints in [0, 512)",
        ),
        ("text", b"", "bad.jsonl: file is empty"),
    ],
)
def test_bad_input_names_file_and_line(tmp_path, tokenizer_dir, fmt, content, message):
    (tmp_path / "bad.jsonl").write_bytes(content)
    with pytest.raises(DataError) as err:
        build_or_reuse(str(tmp_path / "bad.jsonl"), settings(fmt), tokenizer_dir, str(tmp_path / "cache"), print)
    assert message in str(err.value)
    assert not os.listdir(tmp_path / "cache") if (tmp_path / "cache").exists() else True  # no entry left behind


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])
    with pytest.raises(DataError, match="has 512 tokens but the model's embedding has 300 rows"):
        build_or_reuse(path, settings(vocab=300), tokenizer_dir, str(tmp_path / "cache"), print)


def test_skip_bad_lines_counts_and_every_example_filtered_is_an_error(tmp_path, tokenizer_dir):
    (tmp_path / "d.jsonl").write_bytes(b'{"text": "a b c"}\nnot json\n{"x": 1}\n{"text": "d e f"}\n')
    entry, meta = build_or_reuse(
        str(tmp_path / "d.jsonl"), settings(skip=True), tokenizer_dir, str(tmp_path / "cache"), print
    )
    assert meta["stats"]["skipped_bad_lines"] == 2 and meta["stats"]["examples"] == 2

    write_jsonl(tmp_path / "empty_responses.jsonl", [{"prompt": "a", "response": ""}] * 3)
    with pytest.raises(DataError, match=r"no usable example \(3 records read, 0 bad lines skipped, 3 dropped"):
        build_or_reuse(
            str(tmp_path / "empty_responses.jsonl"),
            settings("sft", packing=False),
            tokenizer_dir,
            str(tmp_path / "cache"),
            print,
        )


# ---------- cache ----------


def test_cache_is_reused_and_rebuilt_when_the_file_or_a_setting_changes(tmp_path, tokenizer_dir, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"document number {i}"} for i in range(20)])
    cache = str(tmp_path / "cache")
    first, meta = build_or_reuse(path, settings(), tokenizer_dir, cache, print)
    assert "tokenized" in capsys.readouterr().out
    again, _ = build_or_reuse(path, settings(), tokenizer_dir, cache, print)
    assert again == first and "reusing tokenized cache" in capsys.readouterr().out
    other_setting, _ = build_or_reuse(path, settings(seq=32), tokenizer_dir, cache, print)
    write_jsonl(tmp_path / "d.jsonl", [{"text": f"document number {i}"} for i in range(21)])
    changed, _ = build_or_reuse(path, settings(), tokenizer_dir, cache, print)
    assert len({first, other_setting, changed}) == 3
    # no temp dirs
    assert sorted(os.listdir(cache)) == sorted(os.path.basename(p) for p in (first, other_setting, changed))

    ds = TokenBlocks(first)
    assert len(ds) == meta["num_samples"] and isinstance(ds.arrays["input_ids"], np.memmap)
    sample = ds[0]
    assert (
        set(sample) == {"input_ids", "labels", "position_ids", "num_tokens"}
        and sample["input_ids"].dtype == torch.int64
    )
    assert ds.total_tokens() == meta["stats"]["tokens"]  # packed text: every token read is a real token of some row


def test_rows_without_a_label_token_are_dropped_and_counted(tmp_path, tokenizer_dir, capsys):
    """A one-token document has no next token to predict: its row would put a zero label count into the
    token-normalised loss. Such rows are dropped when the cache is built, so no step divides by zero."""
    path = write_jsonl(tmp_path / "t.jsonl", [{"input_ids": [5, 6, 7]}, {"input_ids": [9]}, {"input_ids": [5, 6]}])
    entry, meta = build_or_reuse(
        path, settings("tokens", seq=4, packing=False), tokenizer_dir, str(tmp_path / "c"), print
    )
    ds = TokenBlocks(entry)
    assert len(ds) == 2 and meta["stats"]["rows_without_labels"] == 1
    assert [ds[i]["num_tokens"] for i in range(2)] == [3, 2] and ds.total_tokens() == 5
    assert "rows without a label token dropped 1" in capsys.readouterr().out
    only = write_jsonl(tmp_path / "one.jsonl", [{"input_ids": [9]}])
    with pytest.raises(DataError, match="1 rows without a label token dropped"):
        build_or_reuse(only, settings("tokens", seq=4, packing=False), tokenizer_dir, str(tmp_path / "c"), print)


def test_iterator_counts_the_real_tokens_it_hands_out(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "t.jsonl", [{"input_ids": [5] * n} for n in (2, 3, 4, 2)])
    entry, _ = build_or_reuse(path, settings("tokens", seq=4, packing=False), tokenizer_dir, str(tmp_path / "c"), print)
    it = MicroBatchIterator(TokenBlocks(entry), 2, 0, 1, shuffle=False, seed=0)
    next(it)
    assert it.tokens_read == 2 + 3
    next(it)
    assert it.tokens_read == 2 + 3 + 4 + 2


# ---------- sampling ----------


def make_blocks(tmp_path, tokenizer_dir, n: int) -> TokenBlocks:
    path = write_jsonl(tmp_path / f"tok{n}.jsonl", [{"input_ids": [i % 500 + 3] * 4} for i in range(n)])
    entry, _ = build_or_reuse(
        path, settings("tokens", seq=4, packing=False), tokenizer_dir, str(tmp_path / "cache"), print
    )
    return TokenBlocks(entry)


def first_tokens(it, n: int) -> list[int]:
    return [row[0] for (ids, _), _ in itertools.islice(it, n) for row in ids.tolist()]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_shards_are_disjoint_cover_the_data_and_reshuffle_per_epoch(tmp_path, tokenizer_dir, dp):
    ds = make_blocks(tmp_path, tokenizer_dir, 48)
    per_rank = 48 // dp // 2  # micro-batches per epoch per rank (micro 2)
    epochs = [first_tokens(MicroBatchIterator(ds, 2, r, dp, True, 7), 2 * per_rank) for r in range(dp)]
    epoch0 = [e[: 2 * per_rank] for e in epochs]
    assert sorted(sum(epoch0, [])) == sorted(i % 500 + 3 for i in range(48))  # disjoint and complete
    again = [first_tokens(MicroBatchIterator(ds, 2, r, dp, True, 7), per_rank) for r in range(dp)]
    assert again == epoch0  # same seed, same epoch: same order
    assert all(e[2 * per_rank :] != e[: 2 * per_rank] for e in epochs)  # next epoch reshuffled
    assert first_tokens(MicroBatchIterator(ds, 2, 0, dp, True, 8), per_rank) != epoch0[0]  # other seed


def test_iterator_resumes_mid_epoch(tmp_path, tokenizer_dir):
    ds = make_blocks(tmp_path, tokenizer_dir, 24)
    reference = MicroBatchIterator(ds, 2, 1, 2, True, 3)
    expected = [fingerprint(b) for b in itertools.islice(reference, 10)]  # crosses into epoch 1
    it = MicroBatchIterator(ds, 2, 1, 2, True, 3)
    seen = [fingerprint(b) for b in itertools.islice(it, 4)]
    state = json.loads(json.dumps(it.state_dict()))  # survives serialisation into a checkpoint
    resumed = MicroBatchIterator(ds, 2, 1, 2, True, 3)
    resumed.load_state_dict(state)
    assert seen + [fingerprint(b) for b in itertools.islice(resumed, 6)] == expected


def test_iterator_order_is_distributed_samplers(tmp_path, tokenizer_dir):
    """The order of the sampler the position format replaced: checkpoints and tests keep their data."""
    from torch.utils.data import DistributedSampler

    ds = make_blocks(tmp_path, tokenizer_dir, 26)
    for dp, rank in ((1, 0), (4, 1), (4, 3)):
        sampler = DistributedSampler(ds, num_replicas=dp, rank=rank, shuffle=True, seed=5, drop_last=True)
        expected = [ds[i]["input_ids"][0].item() for i in sampler]
        got = first_tokens(MicroBatchIterator(ds, 2, rank, dp, True, 5), len(expected) // 2)
        assert got == expected[: len(got)]


def step_samples(ds, micro: int, grad_acc: int, dp: int, steps: int, state: dict | None = None) -> list[list[int]]:
    """The first tokens of every sample each optimizer step takes over all data-parallel ranks (sorted),
    from ``state`` when given; the iterators' states after them go into ``state``."""
    its = [MicroBatchIterator(ds, micro, r, dp, True, 11) for r in range(dp)]
    for it in its:
        if state:
            it.load_state_dict(state)
    out = [sorted(sum((first_tokens(it, grad_acc) for it in its), [])) for _ in range(steps)]
    if state is not None:
        state.update(its[0].state_dict())
    return out


def test_a_step_takes_the_same_samples_whatever_the_data_parallel_degree(tmp_path, tokenizer_dir):
    ds = make_blocks(tmp_path, tokenizer_dir, 64)
    reference = step_samples(ds, micro=2, grad_acc=2, dp=2, steps=3)
    assert step_samples(ds, micro=2, grad_acc=4, dp=1, steps=3) == reference
    assert step_samples(ds, micro=2, grad_acc=1, dp=4, steps=3) == reference
    assert step_samples(ds, micro=1, grad_acc=2, dp=4, steps=3) == reference
    assert len({tuple(s) for s in reference}) == 3 and all(len(s) == 8 for s in reference)


def test_a_changed_global_batch_continues_at_the_next_unseen_sample(tmp_path, tokenizer_dir):
    ds = make_blocks(tmp_path, tokenizer_dir, 64)
    order = sum(step_samples(ds, micro=1, grad_acc=1, dp=1, steps=64), [])  # the epoch's samples in order
    state: dict = {}
    first = step_samples(ds, micro=2, grad_acc=2, dp=2, steps=2, state=state)  # 16 samples
    assert state == {"epoch": 0, "consumed": 16}
    after = step_samples(ds, micro=1, grad_acc=2, dp=3, steps=3, state=state)  # 6 per step
    assert sorted(sum(first, [])) == sorted(order[:16])
    assert [sorted(s) for s in after] == [sorted(order[16 + 6 * i : 22 + 6 * i]) for i in range(3)]


def test_too_little_data_fails_instead_of_spinning(tmp_path, tokenizer_dir):
    ds = make_blocks(tmp_path, tokenizer_dir, 3)
    with pytest.raises(DataError, match="3 samples give no full micro-batch .* = 4 needed"):
        MicroBatchIterator(ds, 2, 0, 2, False, 0)


def test_placeholder_has_length_and_refuses_reads():
    ph = PlaceholderDataset(10)
    assert len(ph) == 10
    with pytest.raises(RuntimeError, match="middle pipeline stage"):
        ph[0]


def test_collate_gives_the_stage_contract_layout(tmp_path, tokenizer_dir):
    ds = make_blocks(tmp_path, tokenizer_dir, 4)
    (input_ids, position_ids), labels = collate([ds[0], ds[1]])
    assert input_ids.shape == position_ids.shape == labels.shape == (2, 4)
    assert input_ids.dtype == position_ids.dtype == labels.dtype == torch.long  # no float crosses stages


def varied_blocks(tmp_path, tokenizer_dir, lengths: list[int], seq: int = 64) -> TokenBlocks:
    rows = [{"input_ids": [(i + j) % 500 + 3 for j in range(n)]} for i, n in enumerate(lengths)]
    path = write_jsonl(tmp_path / "varied.jsonl", rows)
    entry, _ = build_or_reuse(
        path, settings("tokens", seq=seq, packing=False), tokenizer_dir, str(tmp_path / "c"), print
    )
    return TokenBlocks(entry)


def test_a_micro_batch_is_padded_to_its_longest_row_rounded_up(tmp_path, tokenizer_dir):
    ds = varied_blocks(tmp_path, tokenizer_dir, [5, 17, 64, 3])
    (ids, pos), labels = collate([ds[0], ds[1]], pad_multiple=8)
    assert ids.shape == pos.shape == labels.shape == (2, 24)  # 17 real tokens -> 24
    (whole, whole_pos), whole_labels = collate([ds[0], ds[1]])  # 0: every row as long as the rows (64)
    assert whole.shape == (2, 64) and torch.equal(whole[:, :24], ids) and torch.equal(whole_labels[:, :24], labels)
    assert (whole_labels[:, 24:] == -100).all()  # only padding was cut: no label lost
    assert collate([ds[2], ds[3]], pad_multiple=8)[1].shape == (2, 64)  # a full row: never beyond the rows
    assert collate([ds[3]], pad_multiple=64)[1].shape == (1, 64)
    it = MicroBatchIterator(ds, 2, 0, 1, shuffle=False, seed=0, pad_multiple=8)
    next(it), next(it)
    assert (it.tokens_read, it.rows_read) == (5 + 17 + 64 + 3, 2 * 24 + 2 * 64)


def test_group_by_length_gives_micro_batches_of_similar_rows_and_resumes(tmp_path, tokenizer_dir):
    import random

    lengths = [random.Random(i).randint(2, 64) for i in range(96)]
    ds = varied_blocks(tmp_path, tokenizer_dir, lengths)
    assert ds.lengths().tolist() == lengths

    def padded(it, n):  # the tokens the model computes on for n micro-batches
        return sum(b[1].numel() for b in itertools.islice(it, n))

    plain = padded(MicroBatchIterator(ds, 4, 0, 1, True, 3, pad_multiple=8), 24)
    grouped_it = MicroBatchIterator(ds, 4, 0, 1, True, 3, pad_multiple=8, by_length=True)
    grouped = padded(grouped_it, 24)
    print(f"one epoch of 96 rows, micro-batches of 4: {plain} tokens computed unsorted, {grouped} grouped")
    assert grouped < 0.8 * plain and grouped_it.tokens_read == sum(lengths)  # every sample once, less padding
    # Deterministic, the samples of a plain epoch, and resumable mid-epoch (a function of seed and epoch only).
    first = [fingerprint(b) for b in itertools.islice(MicroBatchIterator(ds, 4, 1, 2, True, 3, 8, True), 15)]
    it = MicroBatchIterator(ds, 4, 1, 2, True, 3, 8, True)
    seen = [fingerprint(b) for b in itertools.islice(it, 5)]
    resumed = MicroBatchIterator(ds, 4, 1, 2, True, 3, 8, True)
    resumed.load_state_dict(json.loads(json.dumps(it.state_dict())))
    assert seen + [fingerprint(b) for b in itertools.islice(resumed, 10)] == first


def test_eval_split_is_deterministic_and_disjoint():
    train, evaluation = split_eval(100, 0.1)
    assert len(evaluation) == 10 and len(train) == 90 and not set(train) & set(evaluation)
    assert (split_eval(100, 0.1)[1] == evaluation).all()
