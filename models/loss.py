"""The next-token loss of the last stage, and how it is normalised over an optimizer step.

Hugging Face Trainer (``num_items_in_batch`` with ``average_tokens_across_devices``) divides the summed
token losses of one optimizer step by the number of label tokens in the whole global batch: every
micro-batch of the step on every data-parallel rank. DeepSpeed instead divides each micro-batch's loss
by ``gradient_accumulation_steps`` and averages gradients (and the reported loss) over the
data-parallel group. :class:`CausalLMLoss` bridges the two: once the step's global label count N is
known, each micro-batch returns ``sum of its token losses x (grad_acc x dp) / N``, and DeepSpeed's own
divisions turn the step into ``sum over the global batch / N``.

With ``loss_chunk_tokens`` > 0 the last stage hands the loss the hidden states and the LM head weight
instead of logits, and :class:`ChunkedLMHeadLoss` computes the same loss a chunk of tokens at a time,
never holding the [B,S,V] logits (docs/training.md#chunked-loss).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Label value that the loss ignores (prompt tokens, padding); the same value Hugging Face uses.
IGNORE_INDEX = -100


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross entropy over the labels that are not ``IGNORE_INDEX`` (mean or sum).

    Same definition as Hugging Face's ``ForCausalLMLoss``: position t predicts label t+1; computed in
    fp32 whatever the training precision.
    """
    shift_logits = logits[:, :-1, :].float()  # [B,S-1,V]
    shift_labels = labels[:, 1:]  # [B,S-1]
    return F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction=reduction,
    )


def label_tokens(labels: torch.Tensor) -> int:
    """Tokens the loss is taken over: labels after the shift that are not ``IGNORE_INDEX`` (Trainer's count)."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def shifted_targets(labels: torch.Tensor, seq_slice: tuple[int, int] | None = None) -> torch.Tensor:
    """[B,S] -> [B*S]: the label each position predicts (t -> t+1), ``IGNORE_INDEX`` at each row's end.

    Shifting the labels instead of the hidden states keeps ``hidden.reshape(B*S, H)`` a view (no copy).
    ``seq_slice`` (rank, ranks) of sequence parallelism: the whole row is shifted first, then this rank's
    slice taken ([B*S/ranks]), so the last token of slice k predicts the first of slice k+1.
    """
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # [B,S]
    if seq_slice is not None:
        rank, ranks = seq_slice
        seq = targets.shape[1]
        targets = targets[:, rank * seq // ranks : (rank + 1) * seq // ranks]  # [B,S/ranks]
    return targets.reshape(-1)


class ChunkedLMHeadLoss(torch.autograd.Function):
    """Summed cross entropy of the logits ``hidden[rows] @ weight^T`` against ``targets``, ``chunk`` rows at
    a time, so no more than [chunk,V] logits ever exist, and none are kept for backward.

    Forward runs without a graph and saves only its inputs and each row's log-sum-exp; backward recomputes
    each chunk's logits and turns them into the gradient (softmax - one-hot) x grad_output. Each chunk's
    logits are computed in the inputs' dtype and upcast to fp32, as :func:`causal_lm_loss` upcasts the
    whole [B,S,V] logits, so bf16 training sees the same numbers to fp32 rounding; the head weight's
    gradient is accumulated over chunks in its own dtype (an fp32 accumulator would be as large as the
    weight, V x H x 4 bytes, more than the logits it saves for a short sequence and a large H).

    Vocabulary-parallel (``group`` given): ``weight`` is this rank's rows ``vocab_start ..`` of the head; the
    max, the sum of exponentials and the target's logit are all-reduced over the group per chunk, so each
    rank holds [chunk, V/tp] logits and gets the same loss; the hidden states' gradient (each rank's part,
    from its vocabulary slice) is summed over the group once, at the end of backward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, rows, targets, chunk, group=None, vocab_start=0):
        # hidden [N,H], weight [V,H] (or [V/tp,H]), rows [M] int64 (the rows of hidden that have a label),
        # targets [M] int64 (global vocabulary ids)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lse = torch.empty(rows.numel(), dtype=torch.float32, device=hidden.device)  # [M]
        local, inside = _local_targets(targets, weight.shape[0], group, vocab_start)  # [M], [M] bool or None
        for start in range(0, rows.numel(), chunk):
            end = min(start + chunk, rows.numel())
            logits = F.linear(hidden[rows[start:end]], weight).float()  # [C,V] fp32, this chunk only
            target_logits = logits.gather(1, local[start:end, None]).squeeze(1)  # [C]
            # torch.logsumexp, in place: one [C,V] buffer instead of two (half the loss side's peak)
            top = logits.amax(dim=-1)  # [C]
            if group is not None:
                target_logits = target_logits.masked_fill(~inside[start:end], 0.0)
                dist.all_reduce(target_logits, group=group)  # the one rank holding each target's logit
                dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            sums = logits.sub_(top[:, None]).exp_().sum(dim=-1)  # [C]
            if group is not None:
                dist.all_reduce(sums, group=group)
            lse[start:end] = sums.log_().add_(top)  # [C]
            total += (lse[start:end] - target_logits).sum()
            del logits  # before the next chunk's logits exist, or two chunks are alive at once
        ctx.save_for_backward(hidden, weight, rows, local, lse)
        ctx.chunk, ctx.group, ctx.inside = chunk, group, inside
        return total

    @staticmethod
    def backward(ctx, grad_output):
        hidden, weight, rows, local, lse = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None  # [N,H]: unlabelled rows 0
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None  # [V,H]
        for start in range(0, rows.numel(), ctx.chunk):
            end = min(start + ctx.chunk, rows.numel())
            h = hidden[rows[start:end]]  # [C,H]
            grad = F.linear(h, weight).float().sub_(lse[start:end, None]).exp_()  # [C,V] softmax, fp32
            one_hot = -1.0 if ctx.inside is None else -ctx.inside[start:end].float()  # the target in this slice
            grad[torch.arange(end - start, device=grad.device), local[start:end]] += one_hot  # - one-hot
            grad = grad.mul_(grad_output).to(hidden.dtype)  # [C,V] d loss / d logits
            if grad_hidden is not None:
                grad_hidden[rows[start:end]] = grad @ weight  # [C,V] x [V,H] -> [C,H]
            if grad_weight is not None:
                grad_weight.addmm_(grad.t(), h)  # [V,C] x [C,H] -> [V,H]
            del grad  # as in forward: one chunk of logits alive at a time
        if grad_hidden is not None and ctx.group is not None:
            dist.all_reduce(grad_hidden, group=ctx.group)  # each rank's part comes from its vocabulary slice
        return grad_hidden, grad_weight, None, None, None, None, None


def _local_targets(targets: torch.Tensor, rows: int, group, vocab_start: int):
    """(index of each target in this rank's weight rows, whether it is there): every target is local
    without vocabulary parallelism; with it, targets outside the slice point at row 0, masked out."""
    if group is None:
        return targets, None
    local = targets - vocab_start  # [M]
    inside = (local >= 0) & (local < rows)  # [M] bool
    return local.masked_fill(~inside, 0), inside


def chunked_causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    reduction: str = "mean",
    tensor_parallel: tuple | None = None,
    seq_slice: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``causal_lm_loss(F.linear(hidden, weight), labels, reduction)`` without the [B,S,V] logits.

    ``hidden`` [B,S,H] (after the final norm), ``weight`` [V,H] (the LM head, or the tied embedding).
    Only label tokens reach the LM head, ``chunk_tokens`` of them at a time: prompt and padding
    positions cost no logits at all. ``tensor_parallel`` (group, first vocabulary id of ``weight``): the
    head is this rank's vocabulary slice (:class:`ChunkedLMHeadLoss`). ``seq_slice``: ``hidden`` is this
    rank's slice [B,S/ranks,H] of rows whose whole ``labels`` [B,S] are given (:func:`shifted_targets`).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, not {chunk_tokens}")
    targets = shifted_targets(labels, seq_slice)  # [B*S] (or this rank's [B*S/ranks])
    rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)  # [M] int64
    group, vocab_start = tensor_parallel or (None, 0)
    total = ChunkedLMHeadLoss.apply(
        hidden.reshape(-1, hidden.size(-1)), weight, rows, targets[rows], chunk_tokens, group, vocab_start
    )  # scalar fp32: the summed token losses
    if reduction == "sum":
        return total
    if reduction == "mean":
        return total / rows.numel()  # no label token: 0 / 0 = nan, as F.cross_entropy gives
    raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")


class CausalLMLoss:
    """The pipeline's ``loss_fn`` (and the data-parallel engine's loss), normalised per optimizer step.

    It takes the last stage's output: logits [B,S,V], or, with the chunked loss (``chunk_tokens`` > 0, the
    model built with the same ``loss_chunk_tokens``), the pair (hidden [B,S,H], LM head weight [V,H]),
    from which :func:`chunked_causal_lm_loss` computes the same loss without the logits.

    ``scale`` None: the mean over this micro-batch's label tokens (``loss_normalization=micro_batch``,
    DeepSpeed's convention). Otherwise the micro-batch's summed token losses times ``scale``, which
    the trainer sets before each step (or eval pass) to ``micro-batches x dp / global label tokens``.
    """

    def __init__(self, chunk_tokens: int = 0) -> None:
        self.scale: float | None = None
        self.chunk_tokens = chunk_tokens
        self.tensor_parallel: tuple | None = None  # (group, first vocabulary id of this rank's LM head slice)
        # Sequence parallelism: (rank, ranks) of the sequence group; the outputs are this rank's slice of
        # each row, the labels whole (parallel/sequence_parallel.py)
        self.seq_slice: tuple[int, int] | None = None

    def __call__(self, outputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        reduction = "mean" if self.scale is None else "sum"
        if isinstance(outputs, torch.Tensor) and self.seq_slice is not None:
            loss = F.cross_entropy(  # logits [B,S/ranks,V] against this slice's targets
                outputs.float().reshape(-1, outputs.size(-1)),
                shifted_targets(labels, self.seq_slice),
                ignore_index=IGNORE_INDEX,
                reduction=reduction,
            )
        elif isinstance(outputs, torch.Tensor):
            loss = causal_lm_loss(outputs, labels, reduction)
        elif self.chunk_tokens < 1:
            raise ValueError(
                "the LM head returned (hidden, weight) for the chunked loss, but this loss has chunk_tokens "
                f"{self.chunk_tokens}: build the loss and the model with the same loss_chunk_tokens"
            )
        else:
            hidden, weight = outputs
            loss = chunked_causal_lm_loss(
                hidden, weight, labels, self.chunk_tokens, reduction, self.tensor_parallel, self.seq_slice
            )
        return loss if self.scale is None else loss * self.scale
