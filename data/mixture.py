"""A weighted mixture of sources (data.sources): one dataset whose epoch order draws each source by its weight.

An epoch of the mixture has as many samples as all sources together (L). Source i gets exactly n_i of them, its
weight's share of L (largest remainders), spread evenly over the epoch: its k-th sample sits at (k + 1/2) / n_i
of the way through, so any window of the order holds each source in proportion, give or take one sample (with
shuffle: each run of 64 samples, shuffled within). Each
source's samples come from its own endless stream: its rows in a seeded permutation, a new one each time the
source is used up (a small source with a large weight repeats; a large one with a small weight is read in
part, continuing next epoch where it stopped). Everything is a function of the seed and the epoch, so the
sampler's position alone (data/sampling.py) resumes every source exactly where it was, on any layout.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

MIX_WINDOW = 64  # with shuffle, positions are shuffled within runs of this many samples


def shares(total: int, weights: list[float]) -> np.ndarray:
    """``total`` split in proportion to ``weights``, by largest remainders (ties to the earlier source): int64 [S]."""
    exact = np.asarray(weights, dtype=np.float64) / sum(weights) * total
    counts = np.floor(exact).astype(np.int64)
    for i in np.argsort(-(exact - counts), kind="stable")[: total - counts.sum()]:
        counts[i] += 1
    return counts


def interleave(counts: np.ndarray) -> np.ndarray:
    """Source index of each position of an epoch: source i's k-th sample at (k + 1/2) / counts[i], int64 [sum]."""
    sources = np.repeat(np.arange(len(counts)), counts)
    times = np.concatenate([(np.arange(n) + 0.5) / n for n in counts if n])
    return sources[np.argsort(times, kind="stable")]


class MixtureDataset(Dataset):
    """The sources' rows as one dataset (row ids: source i's rows after those of sources 0..i-1), drawn by
    :meth:`epoch_order`; each sample carries its ``source`` index."""

    def __init__(self, sources: list[Dataset], weights: list[float], names: list[str]):
        self.sources, self.weights, self.names = sources, list(weights), list(names)
        self.sizes = np.asarray([len(s) for s in sources], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)])
        self.counts = shares(int(self.sizes.sum()), self.weights)  # samples of each source per epoch

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, row: int) -> dict:
        source = int(np.searchsorted(self.offsets, row, side="right")) - 1
        return {**self.sources[source][row - int(self.offsets[source])], "source": source}

    def lengths(self) -> np.ndarray:
        return np.concatenate([s.lengths() for s in self.sources])

    def total_tokens(self) -> int:
        return sum(s.total_tokens() for s in self.sources)

    def epoch_order(self, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
        """Row ids of ``epoch``, int64 [len(self)]: each source its share, in proportion throughout. With
        ``shuffle`` the positions are also shuffled within each run of ``MIX_WINDOW`` (the proportions hold per
        run): the even spread alone would give data-parallel rank r every dp-th sample, e.g. one source each."""
        order = np.empty(len(self), dtype=np.int64)
        where = interleave(self.counts)
        if shuffle:
            keys = np.arange(len(where)) // MIX_WINDOW + np.random.default_rng([seed, epoch]).random(len(where))
            where = where[np.argsort(keys, kind="stable")]
        for i, n in enumerate(self.counts):
            start = epoch * int(n)  # where this epoch starts in source i's stream
            order[where == i] = self.offsets[i] + self._stream(i, start, start + int(n), seed, shuffle)
        return order

    def _stream(self, i: int, start: int, stop: int, seed: int, shuffle: bool) -> np.ndarray:
        """Positions ``start``..``stop`` of source i's stream: its rows, permuted anew on every pass over them."""
        size, out = int(self.sizes[i]), []
        for rep in range(start // size, -(-stop // size)):
            rows = np.arange(size)
            if shuffle:
                g = torch.Generator()
                # one permutation per source and pass; mod 2**64: torch's seed range (any seed up to 2**63 - 1)
                g.manual_seed((seed * 1_000_003 + i * 10_007 + rep) % 2**64)
                rows = torch.randperm(size, generator=g).numpy()
            lo, hi = max(start - rep * size, 0), min(stop - rep * size, size)
            out.append(rows[lo:hi])
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)
