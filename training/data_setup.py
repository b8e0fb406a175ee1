"""Data for each rank of a pipe x data job: who tokenizes, who reads, what middle stages get.

- On every node, the lowest rank that reads data (a first or last stage) builds or reuses the
  tokenized cache; every other rank waits in the same collective, which is the barrier.
- First and last stages memory-map the cache; middle stages get a placeholder of the same length and
  touch neither the tokenizer nor the files.
- The eval split (``data.eval_fraction``) is a seeded permutation, identical on every rank.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist
from torch.utils.data import Dataset

from data.cache import TokenBlocks, build_or_reuse
from data.mixture import MixtureDataset
from data.order_guard import FingerprintingIterator, OrderGuard
from data.preference_pairs import PairBlocks, identical_pairs_report
from data.sampling import MicroBatchIterator, PlaceholderDataset
from data.sources import DataError
from data.tokenize_settings import data_settings, tokenizer_dir
from parallel.dualpipev import short_eval_problem
from parallel.layout import Layout
from training.configuration.schema import TrainConfig
from training.resilience.all_ranks import on_all_ranks

EVAL_SPLIT_SEED = 1234  # fixed, so the eval split does not move when the training seed changes


@dataclass
class EvalSet:
    """One eval set: data.eval_file or the data.eval_fraction split (name ""), or one of data.eval_sources."""

    name: str
    dataset: Dataset | None  # None on middle stages
    samples: int  # known on every rank
    batches: int  # eval micro-batches per data-parallel rank (one pass, drop_last)


@dataclass
class RankData:
    """This rank's view of the data."""

    train: Dataset  # TokenBlocks (a MixtureDataset for data.sources) on end stages, PlaceholderDataset in the middle
    evals: list[EvalSet]  # empty without eval data
    iterator: FingerprintingIterator | None  # None on middle stages: DeepSpeed never asks them
    guard: OrderGuard
    role: str  # "builds + reads", "reads" or "placeholder"
    micro_batch_size: int
    dp_rank: int
    dp_size: int
    pad_multiple: int  # data.pad_to_multiple_of
    sources: list[str]  # data.sources' names (empty for data.train_file), known on every rank

    def eval_iterator(self, evaluation: EvalSet) -> MicroBatchIterator | None:
        """A fresh, unshuffled pass over this rank's shard of ``evaluation`` (None on middle stages)."""
        return self.pass_iterator(evaluation.dataset)

    def pass_iterator(self, dataset: Dataset | None) -> MicroBatchIterator | None:
        """A fresh, unshuffled pass over this rank's shard of ``dataset`` (None on middle stages)."""
        if dataset is None:
            return None
        return MicroBatchIterator(
            dataset,
            self.micro_batch_size,
            self.dp_rank,
            self.dp_size,
            False,
            0,
            pad_multiple=self.pad_multiple,
        )


def cache_dir(cfg: TrainConfig) -> str:
    if cfg.data.cache_dir:
        return cfg.data.cache_dir
    base = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    return os.path.join(base, "llama-pipe", "tokenized")


def split_eval(num_samples: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, eval rows): a fixed-seed permutation, the first ``fraction`` of it for eval."""
    perm = np.random.default_rng(EVAL_SPLIT_SEED).permutation(num_samples)
    n_eval = max(1, round(fraction * num_samples))
    return np.sort(perm[n_eval:]), np.sort(perm[:n_eval])


def source_name(source) -> str:
    """A mixture source's name in logs and metrics: its own, or its path's last part."""
    return source.name or os.path.basename(source.path.rstrip("/")) or source.path


def training_sources(cfg: TrainConfig) -> list[tuple[str, str, float, str | None]]:
    """(name, path, weight, format) of each training source: data.sources, or data.train_file alone."""
    if not cfg.data.sources:
        return [("", cfg.data.train_file, 1.0, None)]
    return [(source_name(s), s.path, s.weight, s.format) for s in cfg.data.sources]


def eval_sources(cfg: TrainConfig) -> list[tuple[str, str, str | None]]:
    """(name, path, format) of each eval file: data.eval_sources, or data.eval_file (the fraction is a split)."""
    if cfg.data.eval_sources:
        return [(source_name(s), s.path, s.format) for s in cfg.data.eval_sources]
    return [("", cfg.data.eval_file, None)] if cfg.data.eval_file else []


def open_blocks(cfg: TrainConfig, entry: str) -> Dataset:
    """A cache entry's samples: its rows, or with train_objective=dpo its pairs of rows (data/preference_pairs.py)."""
    rows = TokenBlocks(entry)
    return PairBlocks(rows) if cfg.data.format == "dpo" else rows


def prepare_rank_data(cfg: TrainConfig, model_config, layout: Layout, coord) -> RankData:
    """Collective: every rank calls it. ``coord`` is this rank's topology coordinate, its data axis counted in
    groups that read different samples (``Layout.data_coord``); the stages that read are ``Layout.reading_stages``."""
    rank = dist.get_rank()
    reads = coord.pipe in layout.reading_stages
    host = socket.gethostname()
    peers: list = [None] * dist.get_world_size()
    dist.all_gather_object(peers, (host, rank, reads))
    builder = min(r for h, r, rd in peers if h == host and rd) if reads else None

    def build() -> dict | None:
        if rank != builder:
            return None
        log = lambda msg: print(f"[data] rank {rank}: {msg}", flush=True)  # noqa: E731

        warnings: list[str] = []

        def entry(path: str, fmt: str | None) -> tuple[str, int]:
            settings = data_settings(cfg, model_config, fmt)
            built, meta = build_or_reuse(path, settings, tokenizer_dir(cfg), cache_dir(cfg), log)
            samples = meta["num_samples"] // (2 if settings.format == "dpo" else 1)  # samples: pairs for DPO
            if settings.format == "dpo":
                error, warning = identical_pairs_report(path, meta.get("stats", {}).get("identical_pairs", 0), samples)
                if error:
                    raise DataError(error)
                warnings.extend([warning] if warning else [])
            return built, samples

        train = [entry(path, fmt) for _, path, _, fmt in training_sources(cfg)]
        evals = [(name, *entry(path, fmt)) for name, path, fmt in eval_sources(cfg)]
        n = sum(count for _, count in train)
        if cfg.data.eval_fraction > 0:  # a split of data.train_file
            n_eval = len(split_eval(n, cfg.data.eval_fraction)[1])
            n, evals = n - n_eval, [("", None, n_eval)]
        return {"host": host, "train": train, "evals": evals, "num_train": n, "warnings": warnings}

    results = on_all_ranks("preparing data", build)
    built = [r for r in results if r is not None]
    if rank == 0:  # once per job: every node's builder found the same
        for warning in built[0]["warnings"]:
            print(f"[data] warning: {warning}", flush=True)
    local: dict[str, RankData] = {}

    def open_data() -> None:  # collective too: a reader failing here must not leave the others waiting
        local["data"] = _open_rank_data(cfg, coord, layout, reads, rank == builder, host, built)

    on_all_ranks("opening data", open_data)
    return local["data"]


def _open_rank_data(
    cfg: TrainConfig, coord, layout: Layout, reads: bool, is_builder: bool, host: str, built: list
) -> RankData:
    micro, dp_size = cfg.micro_batch_size, layout.dp
    names, _, weights, _ = zip(*training_sources(cfg))
    for name, _, count in built[0]["evals"]:
        short = short_eval_problem(layout, name, count)  # DualPipeV: 2 x num_stages micro-batches per pass
        if short:
            raise DataError(short)
        if count < dp_size * micro:
            raise DataError(
                f"the eval set{f' {name}' if name else ''} has {count} samples, fewer than one micro-batch per "
                f"data-parallel rank (micro_batch_size {micro} x dp {dp_size}): add eval data or raise "
                "data.eval_fraction"
            )
    shape = dict(
        micro_batch_size=micro,
        dp_rank=coord.data,
        dp_size=dp_size,
        pad_multiple=cfg.data.pad_to_multiple_of,
        sources=list(names) if cfg.data.sources else [],
    )
    # the guard compares the stages that read (DualPipeV: one, reading inputs and labels together), and the ranks
    # of a stage that read the same micro-batches
    ends, peers = layout.reading_stages[-1] + 1, layout.batch_peers
    guard = lambda it: OrderGuard(it, cfg.data.order_check_steps, ends, coord.data, coord.pipe, peers)  # noqa: E731
    if not reads:
        evals = [EvalSet(name, None, count, count // dp_size // micro) for name, _, count in built[0]["evals"]]
        return RankData(PlaceholderDataset(built[0]["num_train"]), evals, None, guard(None), "placeholder", **shape)
    mine = next(r for r in built if r["host"] == host)
    parts = [open_blocks(cfg, entry) for entry, _ in mine["train"]]
    if cfg.data.sources:
        train = MixtureDataset(parts, list(weights), list(names))
    else:
        train = parts[0]
    evals = [
        EvalSet(name, open_blocks(cfg, entry), count, count // dp_size // micro)
        for name, entry, count in mine["evals"]
        if entry is not None
    ]
    if cfg.data.eval_fraction > 0:
        train_rows, eval_rows = split_eval(len(train), cfg.data.eval_fraction)
        train, held_out = train.subset(train_rows), train.subset(eval_rows)
        evals = [EvalSet("", held_out, len(eval_rows), len(eval_rows) // dp_size // micro)]
    iterator = FingerprintingIterator(
        MicroBatchIterator(
            train,
            micro,
            coord.data,
            dp_size,
            cfg.data.shuffle,
            cfg.seed,
            pad_multiple=cfg.data.pad_to_multiple_of,
            by_length=cfg.data.group_by_length,
        )
    )
    return RankData(train, evals, iterator, guard(iterator), "builds + reads" if is_builder else "reads", **shape)
