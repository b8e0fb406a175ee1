"""Micro-batches for one data-parallel rank, resumable mid-epoch, and the middle stages' placeholder.

A batch is ``((input_ids [B,S] int64, position_ids [B,S] int64), labels [B,S] int64)``: the first
stage consumes the inputs tuple, the last stage the labels (see the stage contract in
``models/llama_pipe.py``).
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

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

    Every epoch has one order of all samples (a seeded permutation, ``DistributedSampler``'s), read by
    all data-parallel ranks together: each micro-batch takes the next ``micro x dp`` samples of it,
    rank r every dp-th from the r-th (``DistributedSampler``'s interleaving, with ``drop_last``), so every
    rank gets the same number of full micro-batches and no stage waits for a partial one. The first and
    last stage of a pipeline build this with the same rank and seed: the same order.

    The position is global, the samples of the epoch that all ranks together have consumed: a step takes
    the same samples whatever dp (micro x grad_acc x dp kept equal), and a run resumed on another layout
    continues at the next unseen sample. ``state_dict()`` / ``load_state_dict()`` save and restore it.
    ``tokens_read`` counts the real (non-padding) tokens of every micro-batch taken so far.
    """

    def __init__(self, dataset: Dataset, micro_batch_size: int, dp_rank: int, dp_size: int, shuffle: bool, seed: int):
        self.dataset, self.micro, self.dp_rank, self.dp = dataset, micro_batch_size, dp_rank, dp_size
        self.shuffle, self.seed = shuffle, seed
        self.per_epoch = len(dataset) // dp_size // micro_batch_size  # micro-batches per epoch on this rank
        if self.per_epoch == 0:
            raise DataError(
                f"{len(dataset)} samples give no full micro-batch per data-parallel rank "
                f"(micro_batch_size {micro_batch_size} x dp {dp_size} = {micro_batch_size * dp_size} needed): add data"
            )
        self.stride = micro_batch_size * dp_size  # samples all data-parallel ranks take per micro-batch
        self.epoch, self.consumed = 0, 0  # consumed: samples of this epoch taken by all ranks together
        self.tokens_read = 0
        self._order: list[int] | None = None

    def __iter__(self) -> MicroBatchIterator:
        return self

    def _epoch_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)  # DistributedSampler's permutation, the same on every rank
        return torch.randperm(len(self.dataset), generator=g).tolist()

    def __next__(self) -> Batch:
        if self.consumed + self.stride > self.per_epoch * self.stride:
            self.epoch, self.consumed, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self._order = self._epoch_order()
        indices = [self._order[self.consumed + self.dp * j + self.dp_rank] for j in range(self.micro)]
        self.consumed += self.stride
        samples = [self.dataset[i] for i in indices]
        self.tokens_read += sum(s["num_tokens"] for s in samples)
        return collate(samples)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        # A checkpoint of an earlier version counted this rank's micro-batches (the same layout resumes it).
        consumed = state["consumed"] if "consumed" in state else state["position"] * self.stride
        self.epoch, self.consumed, self._order = state["epoch"], consumed, None
