"""One optimizer step and one eval pass, with their arithmetic: the global batch's token counts (each rank the run's
engine says counts, parallel/engines.py) and the loss normalisation they give; the engine runs the passes
(training/loop.py calls these)."""

from __future__ import annotations

import itertools
import time

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from models.loss import CausalLMLoss, label_tokens
from training.configuration.schema import Resolved
from training.data_setup import EvalSet, RankData
from training.dpo import step_metrics
from training.observation.metrics import StepLogger
from training.resilience.all_ranks import TrainingStopped, counted_sum


def global_sum(*values: int) -> list[int]:
    """Every rank's values summed over all ranks (a collective: every rank calls it)."""
    total = torch.tensor(values, dtype=torch.int64, device=get_accelerator().current_device_name())  # NCCL: on the GPU
    dist.all_reduce(total)
    return total.tolist()


def normalise_loss(resolved: Resolved, loss_fn: CausalLMLoss, micro_batches: int, label_count: int) -> None:
    """Set the loss scale for the next step or eval pass: ``micro_batches`` per data-parallel rank
    whose ``label_count`` label tokens (all ranks) make the denominator. DeepSpeed divides each
    micro-batch's loss by ``micro_batches`` and averages over its data axis (dp x sequence_parallel: each
    rank of a sequence group sums its slice's token losses), so scaling by their product over the count gives
    the token mean of the whole global batch."""
    if resolved.cfg.train_objective == "dpo":
        return  # DPO's loss is a mean over each micro-batch's pairs: DeepSpeed's own divisions make the global mean
    if resolved.cfg.loss_normalization == "micro_batch":
        loss_fn.scale = None
    elif label_count == 0:  # the data cache drops rows without a label token: a bug if ever seen
        raise TrainingStopped("a global batch without a label token reached the loss: nothing to normalise by")
    else:
        loss_fn.scale = micro_batches * resolved.layout.data_axis / label_count


def train_step(resolved: Resolved, engine, data: RankData, loss_fn: CausalLMLoss) -> tuple[float, list[int]]:
    """One optimizer step: the loss and the global batch's counts, identical on every rank: real tokens, label
    tokens, tokens computed on (the micro-batches' rows with their padding), then real tokens per source of a
    mixture (data.sources).

    The ranks that count tokens take the step's micro-batches from their iterator first, so the global
    label count is known before the first micro-batch's loss is computed; the engine then reads them
    from that list (the first stage of a longer pipeline reads its own iterator as before).
    """
    gas = resolved.cfg.gradient_accumulation_steps
    batches, counts = None, [0] * (3 + len(data.sources))
    if resolved.layout.engine.counts_labels(engine):
        before, by_source = data.iterator.tokens_read, dict(data.iterator.tokens_by_source)
        batches = [next(data.iterator) for _ in range(gas)]
        counts[:3] = (
            data.iterator.tokens_read - before,
            sum(label_tokens(labels) for _, labels in batches),
            sum(input_ids.numel() for (input_ids, _), _ in batches),
        )
        for i in range(len(data.sources)):
            counts[3 + i] = data.iterator.tokens_by_source.get(i, 0) - by_source.get(i, 0)
    counts = global_sum(*counts)
    normalise_loss(resolved, loss_fn, gas, counts[1])
    micro_batches = iter(batches) if batches is not None else data.iterator
    return resolved.layout.engine.train_batch(engine, micro_batches, loss_fn), counts


def eval_label_count(resolved: Resolved, engine, data: RankData, evaluation: EvalSet) -> int:
    """Label tokens of the whole eval set (every rank's shard): the eval loss's denominator."""
    local = 0
    if resolved.layout.engine.counts_labels(engine):
        batches = itertools.islice(data.eval_iterator(evaluation), evaluation.batches)
        local = sum(label_tokens(labels) for _, labels in batches)
    return global_sum(local)[0]


def evaluate(
    resolved: Resolved,
    engine,
    data: RankData,
    evaluation: EvalSet,
    step: int,
    logger: StepLogger,
    loss_fn: CausalLMLoss,
    label_count: int,
) -> None:
    """One pass over an eval set (every rank's shard), without gradients; with loss_normalization=tokens
    the loss is the mean over every label token of the set."""
    start, n = time.time(), evaluation.batches
    normalise_loss(resolved, loss_fn, n, label_count)
    loss = resolved.layout.engine.eval_batch(engine, data.eval_iterator(evaluation), n, loss_fn)
    logger.log_eval(
        step, loss, time.time() - start, evaluation.name, objective_metrics(resolved, engine, loss_fn, "eval_")
    )


def objective_metrics(resolved: Resolved, engine, loss_fn, prefix: str = "") -> dict[str, float] | None:
    """The objective's own figures since the last call, for the progress line and metrics.jsonl (a collective on every
    rank when there are any): DPO's rewards and log-probabilities, or a MoE model's router loss and expert load."""
    if resolved.cfg.train_objective == "dpo":
        return step_metrics(loss_fn, resolved.layout.engine.counts_labels(engine), prefix=prefix)
    if getattr(loss_fn, "router", None) is not None:  # every rank's loss has it (parallel.stage.attach_router_loss)
        return router_metrics(loss_fn, resolved.layout.engine.counts_labels(engine), prefix)
    return None


def router_metrics(loss_fn: CausalLMLoss, counts: bool, prefix: str = "") -> dict[str, float]:
    """A MoE model's routing since the last call, every last-stage rank's summed (``counts``: one rank per micro-batch):
    ``router_loss`` (``sequence_balance_loss`` with moe.sequence_balance_coef), the mean over micro-batches of the
    load-balancing loss (without its coefficient), and ``expert_load_max``: the most tokens any expert got (over every
    MoE layer) / the mean per expert, 1.0 for a balanced router, num_experts / top_k when every token goes to the same
    top_k experts. A collective."""
    loss_sum, micro_batches, tokens = loss_fn.router.take_metrics()
    stats = counted_sum(torch.cat([torch.tensor([loss_sum, micro_batches], dtype=torch.float64), tokens]), counts)
    tokens = stats[2:]
    return {
        f"{prefix}{loss_fn.router.metric}": stats[0].item() / stats[1].item() if stats[1] else float("nan"),
        f"{prefix}expert_load_max": (tokens.max() / tokens.mean()).item() if tokens.sum() else float("nan"),
    }
