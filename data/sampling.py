"""Micro-batches for one data-parallel rank, resumable mid-epoch, and the middle stages' placeholder.

A batch is ``((input_ids [B,S] int64, position_ids [B,S] int64), labels [B,S] int64)``: the first
stage consumes the inputs tuple, the last stage the labels (see the stage contract in
``models/llama_pipe.py``); a micro-batch of preference pairs has 2B rows and a labels tuple
(``data/preference_pairs.py``). S is the rows' length (max_seq_length), or with ``pad_multiple`` the
micro-batch's longest row rounded up to that multiple: rows are right-padded, so cutting the common
padding off the end changes no real token (the pipeline then sends shapes with every micro-batch,
``PipelineModule(dynamic_shape=True)``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from data.sources import DataError

Batch = tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]
GROUP_WINDOW = 4096  # data.group_by_length: samples of the shuffled order sorted by length together


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


def collate(samples: list[dict[str, torch.Tensor]], pad_multiple: int = 0) -> Batch:
    """Samples -> ``((input_ids, position_ids), labels)``, each [B,S] int64; with ``pad_multiple`` > 0, S is
    the longest row's real tokens rounded up to a multiple of it (at most the rows' length)."""
    length = samples[0]["input_ids"].shape[0]
    if pad_multiple:
        longest = max(s["num_tokens"] for s in samples)
        length = min(length, -(-longest // pad_multiple) * pad_multiple)
    stack = lambda name: torch.stack([s[name][:length] for s in samples])  # noqa: E731  [B,S]
    return (stack("input_ids"), stack("position_ids")), stack("labels")


def collate_pairs(samples: list[dict], pad_multiple: int = 0):
    """Pairs (data/preference_pairs.py) -> ``((input_ids [2B,S], position_ids [2B,S]), (labels [2B,S], pair ids [B],
    reference [2B]))``: the B chosen rows, then the B rejected ones, cut as :func:`collate` cuts rows (each pair's
    longer row counts); the reference NaN where none is attached yet."""
    rows = [
        {**{n: s[n][k] for n in ("input_ids", "labels", "position_ids")}, "num_tokens": s["longest"]}
        for k in (0, 1)
        for s in samples
    ]
    inputs, labels = collate(rows, pad_multiple)
    pairs = torch.tensor([s["pair"] for s in samples], dtype=torch.int64)  # [B]
    if "reference" in samples[0]:
        reference = torch.cat([torch.stack([s["reference"][k] for s in samples]) for k in (0, 1)])  # [2B]
    else:
        reference = torch.full((2 * len(samples),), float("nan"), dtype=torch.float64)  # [2B]
    return inputs, (labels, pairs, reference)


def group_by_length(order: np.ndarray, lengths: np.ndarray, window: int = GROUP_WINDOW) -> np.ndarray:
    """``order`` with each run of ``window`` samples sorted by length, longest first (stable: ties keep
    their shuffled order), as Hugging Face's ``LengthGroupedSampler`` sorts its mega-batches: consecutive
    samples, hence every micro-batch and the data-parallel ranks' micro-batches of one step, are of similar
    length. A function of the order alone, so a resumed or re-laid-out run draws the same samples."""
    out = np.empty_like(order)
    for start in range(0, len(order), window):
        run = order[start : start + window]
        out[start : start + len(run)] = run[np.argsort(-lengths[run], kind="stable")]
    return out


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
    ``tokens_read`` counts the real (non-padding) tokens of every micro-batch taken so far, ``rows_read``
    the tokens of the rows as they were fed, padding included. ``pad_multiple``: see :func:`collate`;
    ``by_length``: each epoch's order grouped by :func:`group_by_length` (the dataset's ``lengths()``). A
    dataset with an ``epoch_order`` (a mixture, data/mixture.py) gives each epoch's order itself.
    """

    def __init__(
        self,
        dataset: Dataset,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        shuffle: bool,
        seed: int,
        pad_multiple: int = 0,
        by_length: bool = False,
    ):
        self.dataset, self.micro, self.dp_rank, self.dp = dataset, micro_batch_size, dp_rank, dp_size
        self.shuffle, self.seed, self.pad_multiple, self.by_length = shuffle, seed, pad_multiple, by_length
        self.per_epoch = len(dataset) // dp_size // micro_batch_size  # micro-batches per epoch on this rank
        if self.per_epoch == 0:
            raise DataError(
                f"{len(dataset)} samples give no full micro-batch per data-parallel rank "
                f"(micro_batch_size {micro_batch_size} x dp {dp_size} = {micro_batch_size * dp_size} needed): add data"
            )
        self.stride = micro_batch_size * dp_size  # samples all data-parallel ranks take per micro-batch
        self.epoch, self.consumed = 0, 0  # consumed: samples of this epoch taken by all ranks together
        self.tokens_read = self.rows_read = 0
        self.tokens_by_source: dict[int, int] = {}  # real tokens read per source of a mixture
        self._order: np.ndarray | None = None

    def __iter__(self) -> MicroBatchIterator:
        return self

    def _epoch_order(self) -> np.ndarray:
        """This epoch's sample order, int64 [N]: 8 bytes a sample, however many tokens each holds."""
        if hasattr(self.dataset, "epoch_order"):  # a mixture draws its sources by weight (data/mixture.py)
            order = self.dataset.epoch_order(self.epoch, self.seed, self.shuffle)
        elif self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)  # DistributedSampler's permutation, the same on every rank
            order = torch.randperm(len(self.dataset), generator=g).numpy()
        else:
            order = np.arange(len(self.dataset))
        return group_by_length(order, self.dataset.lengths()) if self.by_length else order

    def __next__(self) -> Batch:
        if self.consumed + self.stride > self.per_epoch * self.stride:
            self.epoch, self.consumed, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self._order = self._epoch_order()
        indices = [int(self._order[self.consumed + self.dp * j + self.dp_rank]) for j in range(self.micro)]
        self.consumed += self.stride
        samples = [self.dataset[i] for i in indices]
        self.tokens_read += sum(s["num_tokens"] for s in samples)
        for s in samples:  # a mixture's samples name their source
            if "source" in s:
                self.tokens_by_source[s["source"]] = self.tokens_by_source.get(s["source"], 0) + s["num_tokens"]
        batch = (collate_pairs if "pair" in samples[0] else collate)(samples, self.pad_multiple)
        self.rows_read += batch[0][0].numel()
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        # A checkpoint of an earlier version counted this rank's micro-batches (the same layout resumes it).
        consumed = state["consumed"] if "consumed" in state else state["position"] * self.stride
        self.epoch, self.consumed, self._order = state["epoch"], consumed, None
