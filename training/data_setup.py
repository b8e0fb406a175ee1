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

from data.cache import DataSettings, TokenBlocks, build_or_reuse
from data.checks import default_packing, field_names
from data.guard import FingerprintingIterator, OrderGuard
from data.sampling import MicroBatchIterator, PlaceholderDataset
from data.sources import DataError
from training.config import TrainConfig, tokenizer_dir
from training.distributed import on_all_ranks

EVAL_SPLIT_SEED = 1234  # fixed, so the eval split does not move when the training seed changes


@dataclass
class RankData:
    """This rank's view of the data."""

    train: Dataset  # TokenBlocks on end stages, PlaceholderDataset in the middle
    eval: Dataset | None  # None on middle stages and without eval data
    iterator: FingerprintingIterator | None  # None on middle stages: DeepSpeed never asks them
    guard: OrderGuard
    role: str  # "builds + reads", "reads" or "placeholder"
    eval_samples: int  # known on every rank
    eval_batches: int  # eval micro-batches per data-parallel rank (one pass, drop_last); 0 = no eval
    micro_batch_size: int
    dp_rank: int
    dp_size: int
    pad_multiple: int  # data.pad_to_multiple_of

    def eval_iterator(self) -> MicroBatchIterator | None:
        """A fresh, unshuffled pass over this rank's eval shard (None on middle stages)."""
        if self.eval is None:
            return None
        return MicroBatchIterator(
            self.eval, self.micro_batch_size, self.dp_rank, self.dp_size, False, 0, pad_multiple=self.pad_multiple
        )


def data_settings(cfg: TrainConfig, model_config) -> DataSettings:
    pad = model_config.pad_token_id
    return DataSettings(
        format=cfg.data.format,
        max_seq_length=cfg.data.max_seq_length,
        packing=default_packing(cfg.data),
        skip_bad_lines=cfg.data.skip_bad_lines,
        pad_id=pad if pad is not None else 0,  # any id works: padding has label -100 and sits at the row's end
        vocab_size=model_config.vocab_size,
        fields=tuple(sorted((k, v) for k, v in field_names(cfg.data).items() if k != v)),
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


def prepare_rank_data(cfg: TrainConfig, model_config, coord, dp_size: int) -> RankData:
    """Collective: every rank calls it. ``coord`` is this rank's (pipe, data) topology coordinate."""
    rank, k = dist.get_rank(), cfg.num_stages
    reads = coord.pipe in (0, k - 1)
    host = socket.gethostname()
    peers: list = [None] * dist.get_world_size()
    dist.all_gather_object(peers, (host, rank, reads))
    builder = min(r for h, r, rd in peers if h == host and rd) if reads else None
    settings = data_settings(cfg, model_config)

    def build() -> dict | None:
        if rank != builder:
            return None
        log = lambda msg: print(f"[data] rank {rank}: {msg}", flush=True)  # noqa: E731
        train_entry, meta = build_or_reuse(cfg.data.train_file, settings, tokenizer_dir(cfg), cache_dir(cfg), log)
        eval_entry, n_eval = None, 0
        if cfg.data.eval_file:
            eval_entry, eval_meta = build_or_reuse(
                cfg.data.eval_file, settings, tokenizer_dir(cfg), cache_dir(cfg), log
            )
            n_eval = eval_meta["num_samples"]
        n = meta["num_samples"]
        n_train = len(split_eval(n, cfg.data.eval_fraction)[0]) if cfg.data.eval_fraction > 0 else n
        if cfg.data.eval_fraction > 0:
            n_eval = n - n_train
        return {"host": host, "train": train_entry, "eval": eval_entry, "num_train": n_train, "num_eval": n_eval}

    results = on_all_ranks("preparing data", build)
    built = [r for r in results if r is not None]
    local: dict[str, RankData] = {}

    def open_data() -> None:  # collective too: a reader failing here must not leave the others waiting
        local["data"] = _open_rank_data(cfg, coord, dp_size, reads, rank == builder, host, built)

    on_all_ranks("opening data", open_data)
    return local["data"]


def _open_rank_data(
    cfg: TrainConfig, coord, dp_size: int, reads: bool, is_builder: bool, host: str, built: list
) -> RankData:
    k = cfg.num_stages
    n_eval = built[0]["num_eval"]
    if n_eval and n_eval < dp_size * cfg.micro_batch_size:
        raise DataError(
            f"the eval set has {n_eval} samples, fewer than one micro-batch per data-parallel rank "
            f"(micro_batch_size {cfg.micro_batch_size} x dp {dp_size}): add eval data or raise data.eval_fraction"
        )
    shape = dict(
        eval_samples=n_eval,
        eval_batches=n_eval // dp_size // cfg.micro_batch_size,
        micro_batch_size=cfg.micro_batch_size,
        dp_rank=coord.data,
        dp_size=dp_size,
        pad_multiple=cfg.data.pad_to_multiple_of,
    )
    if not reads:
        return RankData(
            PlaceholderDataset(built[0]["num_train"]),
            None,
            None,
            OrderGuard(None, cfg.data.order_check_steps, k, coord.data, coord.pipe, cfg.tensor_parallel),
            "placeholder",
            **shape,
        )
    mine = next(r for r in built if r["host"] == host)
    train = TokenBlocks(mine["train"])
    evaluation = TokenBlocks(mine["eval"]) if mine["eval"] else None
    if cfg.data.eval_fraction > 0:
        train_rows, eval_rows = split_eval(len(train), cfg.data.eval_fraction)
        train, evaluation = train.subset(train_rows), train.subset(eval_rows)
    iterator = FingerprintingIterator(
        MicroBatchIterator(
            train,
            cfg.micro_batch_size,
            coord.data,
            dp_size,
            cfg.data.shuffle,
            cfg.seed,
            pad_multiple=cfg.data.pad_to_multiple_of,
            by_length=cfg.data.group_by_length,
        )
    )
    guard = OrderGuard(iterator, cfg.data.order_check_steps, k, coord.data, coord.pipe, cfg.tensor_parallel)
    return RankData(train, evaluation, iterator, guard, "builds + reads" if is_builder else "reads", **shape)
