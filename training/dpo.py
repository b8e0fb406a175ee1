"""train_objective=dpo: the reference log-probabilities of every pair, and the step's DPO metrics.

The reference is the starting model, as in TRL: one forward-only pass through the same pipeline (the same
stages, layout and precision as training; with fp8 the same torchao Float8Linears, what DPOTrainer's
precompute_ref_log_probs gives on a converted model, so every margin starts at 0) before the first step computes each
pair's summed log-probability of its chosen and rejected completion; the DPO loss then reads them with the pair's
labels, and no second model is kept. For LoRA the starting model is the base with its starting adapters: PEFT's
fresh ones change nothing (B = 0: the base, what TRL's disabled adapters give), a peft.init_from adapter is part of it
(what TRL's "ref" copy of a pretrained adapter gives). The table, float64 [pairs, 2] per cache entry, is stored inside
the entry of the tokenized cache under a key of the starting model (data/preference_pairs.py), and a copy in
``output_dir/reference/``: a second run on the same model and data reuses it, and a resumed run (whose
weights are no longer the starting ones) reads it and never recomputes it.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np
import torch.distributed as dist

from data.preference_pairs import PairBlocks, load_reference, model_key, reference_path, save_reference
from models.loss import PREFERENCE_METRICS, PreferenceLoss
from training.resilience.all_ranks import StartupError, counted_sum, on_all_ranks

PROGRESS_EVERY_S = 30.0  # seconds between progress lines of a long reference pass
PASS_MICRO_BATCHES = 32  # micro-batches per data-parallel rank in one forward-only pipeline pass


def reference_key(cfg, model_config) -> str:
    """What fixes the reference: the starting weights (the files of model_name_or_path and of a peft.init_from
    adapter by name, size and modification time, or the from-scratch seed and config) and how they run
    (precision, NF4 quantisation, fp8)."""
    lora = cfg.peft.method != "none"
    parts = [f"precision={cfg.precision}", f"quantize={cfg.peft.quantize if lora else ''}"]
    parts += [f"fp8={cfg.fp8}"] if cfg.fp8 else []  # fp8=null: the keys of the tables stored before fp8 existed
    roots = [cfg.model_name_or_path] if cfg.model_name_or_path else []
    roots += [cfg.peft.init_from] if lora and cfg.peft.init_from else []
    for root in map(os.path.abspath, roots):
        parts.append(root)
        for dirpath, _, names in sorted(os.walk(root)):
            for name in sorted(names):
                st = os.stat(os.path.join(dirpath, name))
                parts.append(f"{os.path.relpath(os.path.join(dirpath, name), root)}:{st.st_size}:{st.st_mtime_ns}")
    if not cfg.model_name_or_path:
        parts += [f"seed={cfg.seed}", model_config.to_json_string()]
    return model_key(parts)


def pair_sets(data) -> list[PairBlocks]:
    """This reading rank's pair datasets, one per cache entry (an eval split shares the training entry)."""
    sets, seen = [], set()
    for dataset in [data.train, *(e.dataset for e in data.evals)]:
        if dataset is not None and dataset.entry not in seen:
            seen.add(dataset.entry)
            sets.append(dataset)
    return sets


def prepare_reference(resolved, engine, data, loss_fn: PreferenceLoss, log) -> None:
    """Attach every pair's reference log-probabilities to this rank's datasets: read from the cache (or the run's
    copy), or computed by a forward-only pass of the starting model. A collective: every rank calls it."""
    cfg = resolved.cfg
    key = reference_key(cfg, resolved.model_config)
    copies = os.path.join(cfg.output_dir, "reference")
    reads = data.iterator is not None

    def copy_path(entry: str) -> str:
        return os.path.join(copies, f"{os.path.basename(os.path.normpath(entry))}-{key}.npy")

    def find() -> list[bool]:
        found = []
        for pairs in pair_sets(data) if reads else []:
            table = load_reference(reference_path(pairs.entry, key))
            if table is None:
                table = load_reference(copy_path(pairs.entry))
            if table is not None:
                pairs.attach_reference(table)
            found.append(table is not None)
        return found

    found = on_all_ranks("reading the reference log-probabilities", find)
    if all(all(f) for f in found):
        log(f"reference: log-probabilities of every pair read from the cache (model key {key})")
        return
    if resolved.resume_tag:
        raise StartupError(
            f"resuming {resolved.resume_tag} needs the reference log-probabilities computed at the run's start "
            f"(model key {key}), and neither the tokenized cache nor {copies} holds them; the resumed weights are "
            "no longer the reference. Restore that directory, resume with the precision and fp8 the run started "
            "with, or start the run again from model_name_or_path"
        )
    start = time.time()
    count = compute_reference(resolved, engine, data, loss_fn, log)

    def store() -> str:
        if not reads:
            return ""
        if dist.get_rank() == 0:
            os.makedirs(copies, exist_ok=True)
        unwritable = ""
        for pairs in pair_sets(data):
            if dist.get_rank() == 0:
                save_reference(copy_path(pairs.entry), pairs.reference)
            if data.role.startswith("builds"):  # one writer per node, as for the cache itself
                try:
                    save_reference(reference_path(pairs.entry, key), pairs.reference)
                except OSError as e:  # a read-only prepared directory: the run's copy serves it
                    unwritable = f" (not in {pairs.entry}: {e.strerror})"
        return unwritable

    unwritable = "".join(dict.fromkeys(on_all_ranks("storing the reference log-probabilities", store)))
    seconds = time.time() - start
    log(
        f"reference: forward-only pass of the starting model over {count} pairs in {seconds:.1f} s "
        f"({count / max(seconds, 1e-9):.1f} pairs/s); stored in the tokenized cache{unwritable} (model key {key}) "
        f"and {copies}"
    )


def compute_reference(resolved, engine, data, loss_fn: PreferenceLoss, log) -> int:
    """The forward-only pass over every pair of every entry (each data-parallel rank a share, wrapped round to
    whole passes); the label-holding ranks record each pair's log-probabilities, which all ranks then gather."""
    cfg, layout = resolved.cfg, resolved.layout
    micro, dp = cfg.micro_batch_size, layout.dp
    counts = on_all_ranks("counting pairs", lambda: [p.num_pairs for p in pair_sets(data)] if data.iterator else None)
    sizes = next(c for c in counts if c is not None)
    least = layout.least_micro_batches
    total = 0
    for index, num_pairs in enumerate(sizes):
        per_rank = math.ceil(num_pairs / (dp * micro))
        chunk = max(least, min(per_rank, PASS_MICRO_BATCHES))
        passes = math.ceil(per_rank / chunk)
        loss_fn.recording = []
        try:
            iterator = None
            if data.iterator is not None:
                pairs = pair_sets(data)[index]
                everything = PairBlocks(pairs.rows)  # no reference yet: NaN in the labels
                wrapped = everything.subset(np.arange(passes * chunk * dp * micro) % num_pairs)
                iterator = data.pass_iterator(wrapped)
            last = time.time()
            for done in range(passes):
                layout.engine.eval_batch(engine, iterator, chunk, loss_fn)  # its loss is not used
                if time.time() - last > PROGRESS_EVERY_S:
                    last = time.time()
                    log(f"reference pass: {(done + 1) * chunk * dp * micro} of {num_pairs} pairs (entry {index + 1})")
        finally:
            recorded, loss_fn.recording = loss_fn.recording, None
        gathered = [None] * dist.get_world_size()
        local = [(p.numpy(), v.view(2, -1).t().numpy()) for p, v in recorded]  # pair ids [B], (chosen, rejected) [B,2]
        dist.all_gather_object(gathered, local)
        table = np.full((num_pairs, 2), np.nan, dtype=np.float64)
        for rank_records in gathered:
            for pair_ids, values in rank_records:
                table[pair_ids] = values
        missing = int(np.isnan(table).any(axis=1).sum())
        if missing:
            raise StartupError(f"the reference pass left {missing} of {num_pairs} pairs without log-probabilities")
        if data.iterator is not None:
            pair_sets(data)[index].attach_reference(table)
        total += num_pairs
    return total


def step_metrics(loss_fn: PreferenceLoss, counts: bool, prefix: str = "") -> dict[str, float]:
    """TRL's metrics over the pairs since the last call, every rank's summed (``counts``: whether this rank's
    pairs count, one rank per micro-batch). A collective."""
    stats = counted_sum(loss_fn.take_stats(), counts)
    pairs = stats[0].item()
    return {
        f"{prefix}{name}": (stats[1 + i].item() / pairs if pairs else math.nan)
        for i, name in enumerate(PREFERENCE_METRICS)
    }
