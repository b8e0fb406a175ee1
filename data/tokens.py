"""Pre-tokenized data (``data.format=tokens``) and the pipeline's batch layout.

A batch is ``((input_ids [B,S] int64, position_ids [B,S] int64), labels [B,S] int64)``: the first
stage consumes the inputs tuple, the last stage the labels (see the stage contract in
``models/llama_pipe.py``). Every sample is padded to ``max_seq_length`` because DeepSpeed fixes the
shapes sent between stages after the first micro-batch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from models.llama_pipe import IGNORE_INDEX


class DataError(ValueError):
    """Unusable training data, naming the file and line."""


class TokensDataset(Dataset):
    """JSONL lines ``{"input_ids": [...]}``; labels are the input ids, -100 on padding.

    Samples longer than ``max_seq_length`` are truncated; shorter ones are right-padded with
    ``pad_token_id`` (causal attention means padding at the end never affects real tokens).
    """

    def __init__(self, path: str, max_seq_length: int, pad_token_id: int, vocab_size: int):
        self.max_seq_length = max_seq_length
        self.pad_token_id = pad_token_id
        self.samples: list[list[int]] = []
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    ids = json.loads(line)["input_ids"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise DataError(f"{path}:{lineno}: expected a JSON object with 'input_ids' ({e})") from None
                if not ids or not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids):
                    raise DataError(f"{path}:{lineno}: input_ids must be a non-empty list of ints in [0, {vocab_size})")
                self.samples.append(ids[:max_seq_length])
        if not self.samples:
            raise DataError(f"{path}: no samples")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.samples[index]
        pad = self.max_seq_length - len(ids)
        input_ids = torch.tensor(ids + [self.pad_token_id] * pad, dtype=torch.long)  # [S]
        labels = torch.tensor(ids + [IGNORE_INDEX] * pad, dtype=torch.long)  # [S]
        return {"input_ids": input_ids, "labels": labels}


class PlaceholderDataset(Dataset):
    """What middle pipeline stages get: the same length, no file reads, no memory per sample.

    DeepSpeed never asks a middle stage for data; indexing one is a bug and says so.
    """

    def __init__(self, length: int):
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        raise RuntimeError("a middle pipeline stage tried to read data: only the first and last stage read data")


def collate(samples: list[dict[str, torch.Tensor]]) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Samples -> ``((input_ids, position_ids), labels)``, each [B,S] int64."""
    input_ids = torch.stack([s["input_ids"] for s in samples])  # [B,S]
    labels = torch.stack([s["labels"] for s in samples])  # [B,S]
    position_ids = torch.arange(input_ids.size(1)).expand_as(input_ids).contiguous()  # [B,S]
    return (input_ids, position_ids), labels


def batch_iterator(
    dataset: Dataset, micro_batch_size: int, dp_rank: int, dp_size: int, shuffle: bool, seed: int
) -> Iterator:
    """Endless micro-batches for one data-parallel rank, reshuffled (seeded) every epoch.

    ``drop_last`` on the sampler and the loader: every rank gets the same number of full
    micro-batches, so no stage waits forever for a partial one. The first and last stage of a
    pipeline share ``dp_rank`` and ``seed``, so they see the same samples in the same order.
    """
    sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate, drop_last=True)
    if len(loader) == 0:
        raise DataError(
            f"{len(dataset)} samples give no full micro-batch per data-parallel rank "
            f"(micro_batch_size {micro_batch_size} x dp {dp_size} = {micro_batch_size * dp_size} needed): add data"
        )

    def endless() -> Iterator:
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    return endless()
