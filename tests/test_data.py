"""Token data: padding and labels, batch layout, data-parallel sharding, placeholder, clear errors."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from data.tokens import DataError, PlaceholderDataset, TokensDataset, batch_iterator, collate
from models.llama_pipe import IGNORE_INDEX


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_truncate_pad_and_mask_padding(tmp_path):
    ds = TokensDataset(write(tmp_path / "d.jsonl", [{"input_ids": [5, 6, 7, 8, 9, 10]}, {"input_ids": [5, 6]}]),
                       max_seq_length=4, pad_token_id=0, vocab_size=16)
    assert ds[0]["input_ids"].tolist() == [5, 6, 7, 8] and ds[0]["labels"].tolist() == [5, 6, 7, 8]
    assert ds[1]["input_ids"].tolist() == [5, 6, 0, 0]
    assert ds[1]["labels"].tolist() == [5, 6, IGNORE_INDEX, IGNORE_INDEX]


def test_collate_gives_the_stage_contract_layout(tmp_path):
    ds = TokensDataset(write(tmp_path / "d.jsonl", [{"input_ids": [1, 2, 3]}] * 2), 3, 0, 16)
    (input_ids, position_ids), labels = collate([ds[0], ds[1]])
    assert input_ids.shape == position_ids.shape == labels.shape == (2, 3)
    assert input_ids.dtype == position_ids.dtype == labels.dtype == torch.long  # no float crosses stages
    assert position_ids.tolist() == [[0, 1, 2], [0, 1, 2]]


@pytest.mark.parametrize(
    "line, fragment",
    [("not json", "d.jsonl:2: expected a JSON object"), ('{"ids": [1]}', "d.jsonl:2"), ('{"input_ids": [1, 99]}', "[0, 16)")],
)
def test_bad_lines_name_file_and_line(tmp_path, line, fragment):
    path = tmp_path / "d.jsonl"
    path.write_text('{"input_ids": [1]}\n' + line + "\n")
    with pytest.raises(DataError, match=fragment.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        TokensDataset(str(path), 4, 0, 16)


def take_ids(it, n):
    return [row[0] for (ids, _), _ in itertools.islice(it, n) for row in ids.tolist()]


def test_data_parallel_ranks_get_disjoint_shards_and_stages_agree(tmp_path):
    ds = TokensDataset(write(tmp_path / "d.jsonl", [{"input_ids": [i, 1]} for i in range(2, 14)]), 2, 0, 16)
    rank0 = take_ids(batch_iterator(ds, 2, dp_rank=0, dp_size=2, shuffle=True, seed=3), 3)
    rank1 = take_ids(batch_iterator(ds, 2, dp_rank=1, dp_size=2, shuffle=True, seed=3), 3)
    assert sorted(rank0 + rank1) == list(range(2, 14))  # one epoch, each sample once
    # The last stage builds its own iterator with the same dp rank and seed: same order.
    assert take_ids(batch_iterator(ds, 2, dp_rank=0, dp_size=2, shuffle=True, seed=3), 3) == rank0
    two_epochs = take_ids(batch_iterator(ds, 2, dp_rank=0, dp_size=2, shuffle=True, seed=3), 6)
    assert two_epochs[:6] == rank0 and two_epochs[6:] != rank0  # the next epoch is reshuffled


def test_too_little_data_fails_instead_of_spinning(tmp_path):
    ds = TokensDataset(write(tmp_path / "d.jsonl", [{"input_ids": [2, 3]}] * 3), 2, 0, 16)
    with pytest.raises(DataError, match="3 samples give no full micro-batch .* = 4 needed"):
        batch_iterator(ds, 2, dp_rank=0, dp_size=2, shuffle=False, seed=0)


def test_placeholder_has_length_and_refuses_reads():
    ph = PlaceholderDataset(10)
    assert len(ph) == 10
    with pytest.raises(RuntimeError, match="middle pipeline stage"):
        ph[0]
