"""Micro-batches for one data-parallel rank, resumable mid-epoch, and the middle stages' placeholder.

A batch is ``((input_ids [B,S] int64, position_ids [B,S] int64), labels [B,S] int64)``: the first
stage consumes the inputs tuple, the last stage the labels (see the stage contract in
``models/llama_pipe.py``).
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, DistributedSampler

from data.sources import DataError

Batch = tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]


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


def collate(samples: list[dict[str, torch.Tensor]]) -> Batch:
    """Samples -> ``((input_ids, position_ids), labels)``, each [B,S] int64."""
    stack = lambda name: torch.stack([s[name] for s in samples])  # noqa: E731  [B,S]
    return (stack("input_ids"), stack("position_ids")), stack("labels")


class MicroBatchIterator:
    """Endless micro-batches for one data-parallel rank, reshuffled (seeded) every epoch.

    The order comes from a ``DistributedSampler`` over the data-parallel rank with ``drop_last``, so
    every rank gets the same number of full micro-batches and no stage waits for a partial one. The
    first and last stage of a pipeline build this with the same rank and seed: the same order.
    ``state_dict()`` / ``load_state_dict()`` save and restore the position mid-epoch.
    ``tokens_read`` counts the real (non-padding) tokens of every micro-batch taken so far.
    """

    def __init__(self, dataset: Dataset, micro_batch_size: int, dp_rank: int, dp_size: int, shuffle: bool, seed: int):
        self.dataset, self.micro = dataset, micro_batch_size
        self.sampler = DistributedSampler(
            dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=True
        )
        self.per_epoch = len(self.sampler) // micro_batch_size  # micro-batches per epoch on this rank
        if self.per_epoch == 0:
            raise DataError(
                f"{len(dataset)} samples give no full micro-batch per data-parallel rank "
                f"(micro_batch_size {micro_batch_size} x dp {dp_size} = {micro_batch_size * dp_size} needed): add data"
            )
        self.epoch, self.position = 0, 0  # position: micro-batches already taken in this epoch
        self.tokens_read = 0
        self._order: list[int] | None = None

    def __iter__(self) -> MicroBatchIterator:
        return self

    def __next__(self) -> Batch:
        if self.position == self.per_epoch:
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self.sampler.set_epoch(self.epoch)
            self._order = list(self.sampler)
        start = self.position * self.micro
        self.position += 1
        samples = [self.dataset[i] for i in self._order[start : start + self.micro]]
        self.tokens_read += sum(s["num_tokens"] for s in samples)
        return collate(samples)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position, self._order = state["epoch"], state["position"], None
