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
never holding the [B,S,V] logits (docs/training.md#chunked-loss). ``loss_impl=liger`` computes it from the same
pair with Liger-Kernel's fused linear cross entropy instead (:func:`liger_head_losses`, CUDA only): the same label
rows, targets and sums, so every normalisation below holds as it is
(docs/speed.md#fused-linear-cross-entropy-loss_implliger).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from models.router_loss import RouterLoss

# Label value that the loss ignores (prompt tokens, padding); the same value Hugging Face uses.
IGNORE_INDEX = -100

# loss_impl: what computes the LM head's cross entropy from (hidden states, head weight): ChunkedLMHeadLoss, or
# Liger-Kernel's fused linear cross entropy (liger_head_losses)
LOSS_IMPLS = ("chunked", "liger")

# Whose <Family>ForCausalLM caps its logits at final_logit_softcapping (cap x tanh(logits / cap)) before any loss or
# sample; other families' configs may carry the key unused.
SOFTCAP_MODEL_TYPES = ("gemma3_text", "gemma4_text")


def logit_softcap(config) -> float | None:
    """The cap the model applies to its logits (``final_logit_softcapping``), None where it applies none."""
    if getattr(config, "model_type", None) not in SOFTCAP_MODEL_TYPES:
        return None
    cap = getattr(config, "final_logit_softcapping", None)
    return None if cap is None else float(cap)


def soft_capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(logits / softcap)``, as Gemma's ForCausalLM caps its logits (None: ``logits`` as they are)."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def causal_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean", softcap: float | None = None
) -> torch.Tensor:
    """Next-token cross entropy over the labels that are not ``IGNORE_INDEX`` (mean or sum).

    Same definition as Hugging Face's ``ForCausalLMLoss``: position t predicts label t+1; computed in
    fp32 whatever the training precision; ``softcap``: of the capped logits (:func:`soft_capped`).
    """
    shift_logits = soft_capped(logits[:, :-1, :].float(), softcap)  # [B,S-1,V]
    shift_labels = labels[:, 1:]  # [B,S-1]
    return F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction=reduction,
    )


def label_tokens(labels: torch.Tensor | tuple) -> int:
    """Tokens the loss is taken over: labels after the shift that are not ``IGNORE_INDEX`` (Trainer's count).
    Preference pairs' labels are a tuple whose first tensor holds them (data/preference_pairs.py)."""
    labels = labels[0] if isinstance(labels, tuple) else labels
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
    """Per-token cross entropy [M] of the logits ``hidden[rows] @ weight^T`` against ``targets``, ``chunk`` rows
    at a time, so no more than [chunk,V] logits ever exist, and none are kept for backward.

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

    ``softcap``: of the capped logits c = cap x tanh(z / cap) (:func:`soft_capped`), capped per chunk (elementwise,
    so per vocabulary slice too); backward multiplies (softmax - one-hot) by dc/dz = 1 - tanh(z / cap)^2, a second
    buffer, so it takes half a chunk of rows at a time (the same peak).
    """

    @staticmethod
    def forward(ctx, hidden, weight, rows, targets, chunk, group=None, vocab_start=0, softcap=None):
        # hidden [N,H], weight [V,H] (or [V/tp,H]), rows [M] int64 (the rows of hidden that have a label),
        # targets [M] int64 (global vocabulary ids)
        losses = torch.empty(rows.numel(), dtype=torch.float32, device=hidden.device)  # [M]
        lse = torch.empty(rows.numel(), dtype=torch.float32, device=hidden.device)  # [M]
        local, inside = _local_targets(targets, weight.shape[0], group, vocab_start)  # [M], [M] bool or None
        for start in range(0, rows.numel(), chunk):
            end = min(start + chunk, rows.numel())
            logits = F.linear(hidden[rows[start:end]], weight).float()  # [C,V] fp32, this chunk only
            if softcap is not None:
                logits = logits.div_(softcap).tanh_().mul_(softcap)  # in place: still one [C,V] buffer
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
            losses[start:end] = lse[start:end] - target_logits
            del logits  # before the next chunk's logits exist, or two chunks are alive at once
        ctx.save_for_backward(hidden, weight, rows, local, lse)
        ctx.chunk, ctx.group, ctx.inside, ctx.softcap = chunk, group, inside, softcap
        return losses

    @staticmethod
    def backward(ctx, grad_output):
        hidden, weight, rows, local, lse = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None  # [N,H]: unlabelled rows 0
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None  # [V,H]
        # with the cap, its slope is a second [C,V] buffer: half the rows at once keep one chunk's peak
        step = ctx.chunk if ctx.softcap is None else max(1, ctx.chunk // 2)
        for start in range(0, rows.numel(), step):
            end = min(start + step, rows.numel())
            h = hidden[rows[start:end]]  # [C,H]
            grad = F.linear(h, weight).float()  # [C,V] fp32 logits, made the gradient in place (one name: del frees it)
            slope = None
            if ctx.softcap is not None:
                slope = grad.div_(ctx.softcap).tanh_()  # [C,V] tanh(z / cap)
                grad = slope * ctx.softcap  # [C,V] the capped logits
                slope = slope.square_().neg_().add_(1.0)  # [C,V] dc/dz = 1 - tanh^2
            grad = grad.sub_(lse[start:end, None]).exp_()  # [C,V] softmax, fp32
            one_hot = -1.0 if ctx.inside is None else -ctx.inside[start:end].float()  # the target in this slice
            grad[torch.arange(end - start, device=grad.device), local[start:end]] += one_hot  # - one-hot
            if slope is not None:
                grad = grad.mul_(slope)  # through the cap
                del slope
            grad = grad.mul_(grad_output[start:end, None]).to(hidden.dtype)  # [C,V] d loss / d logits
            if grad_hidden is not None:
                grad_hidden[rows[start:end]] = grad @ weight  # [C,V] x [V,H] -> [C,H]
            if grad_weight is not None:
                grad_weight.addmm_(grad.t(), h)  # [V,C] x [C,H] -> [V,H]
            del grad  # as in forward: one chunk of logits alive at a time
        if grad_hidden is not None and ctx.group is not None:
            dist.all_reduce(grad_hidden, group=ctx.group)  # each rank's part comes from its vocabulary slice
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _local_targets(targets: torch.Tensor, rows: int, group, vocab_start: int):
    """(index of each target in this rank's weight rows, whether it is there): every target is local
    without vocabulary parallelism; with it, targets outside the slice point at row 0, masked out."""
    if group is None:
        return targets, None
    local = targets - vocab_start  # [M]
    inside = (local >= 0) & (local < rows)  # [M] bool
    return local.masked_fill(~inside, 0), inside


def liger_head_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    reduction: str,
    softcap: float | None = None,
):
    """Liger-Kernel's fused linear cross entropy (``liger_fused_linear_cross_entropy``, Triton, CUDA only) of the
    logits ``hidden[rows] @ weight^T`` against ``targets``: their sum (``reduction="sum"``), or each token's loss
    [M] (``"none"``, DPO's per-sequence sums), fp32, as :class:`ChunkedLMHeadLoss` gives them.

    ``hidden`` [N,H], ``weight`` [V,H] (never vocabulary-split: loss_impl=liger is refused with tensor parallelism),
    ``rows`` [M] (the rows with a label, M > 0), ``targets`` [M]. Only the label rows are handed over, so prompt and
    padding positions cost no logits here either, and no target is ``IGNORE_INDEX``; a mean is taken by the caller
    (Liger's own would divide by the same count). With a sum Liger computes both gradients inside the forward, a
    chunk of rows at a time, and its backward scales them by the incoming gradient (the normalisation ``scale``,
    DeepSpeed's division by the micro-batches); with ``"none"`` it recomputes them in backward, as the chunked loss
    does. Its logits and their gradient are in the inputs' dtype, its loss in fp32. A ``softcap`` is refused (before
    start by models/kernels.py's loss_impl_problems): Liger's own cap is not checked against Hugging Face here."""
    if softcap is not None:
        raise ValueError(liger_softcap_problem(softcap))
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    picked = hidden[rows]  # [M,H]: a contiguous copy, its gradient scattered back to hidden's rows
    if torch.is_grad_enabled() and weight.requires_grad and not picked.requires_grad:
        picked.requires_grad_()  # Liger computes the weight's gradient only where its input asks for one
    return liger_fused_linear_cross_entropy(picked, weight, targets, ignore_index=IGNORE_INDEX, reduction=reduction)


def liger_softcap_problem(softcap: float) -> str:
    """The line refusing ``loss_impl=liger`` with a logit cap."""
    return (
        f"loss_impl=liger with final_logit_softcapping {softcap:g} (gemma3_text/gemma4_text): the cap of Liger's fused "
        "linear cross entropy is not checked against Hugging Face's here: set loss_impl=chunked (the chunked loss "
        "caps the logits chunk by chunk)"
    )


def head_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    tensor_parallel: tuple | None = None,
    impl: str = "chunked",
    reduction: str = "sum",
    softcap: float | None = None,
) -> torch.Tensor:
    """The token losses of the label rows ``rows`` [M] of ``hidden`` [N,H] against ``targets`` [M] through the head
    ``weight``: summed (fp32 scalar) or per token ([M] fp32, ``reduction="none"``), by ``impl`` (``loss_impl``):
    :class:`ChunkedLMHeadLoss` ``chunk_tokens`` rows at a time, or :func:`liger_head_losses`. A micro-batch without
    a label token (M = 0) takes the chunked path whatever ``impl``: an exact 0 with zero gradients. ``softcap``: of
    the capped logits (:func:`soft_capped`)."""
    if impl not in LOSS_IMPLS:
        raise ValueError(f"loss impl {impl!r}: choose from {LOSS_IMPLS}")
    if impl == "liger" and rows.numel():
        return liger_head_losses(hidden, weight, rows, targets, reduction, softcap)
    group, vocab_start = tensor_parallel or (None, 0)
    # [M] fp32
    losses = ChunkedLMHeadLoss.apply(hidden, weight, rows, targets, chunk_tokens, group, vocab_start, softcap)
    return losses.sum() if reduction == "sum" else losses


def chunked_causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    reduction: str = "mean",
    tensor_parallel: tuple | None = None,
    seq_slice: tuple[int, int] | None = None,
    impl: str = "chunked",
    softcap: float | None = None,
) -> torch.Tensor:
    """``causal_lm_loss(F.linear(hidden, weight), labels, reduction, softcap)`` without the [B,S,V] logits.

    ``hidden`` [B,S,H] (after the final norm), ``weight`` [V,H] (the LM head, or the tied embedding).
    Only label tokens reach the LM head, ``chunk_tokens`` of them at a time: prompt and padding
    positions cost no logits at all. ``tensor_parallel`` (group, first vocabulary id of ``weight``): the
    head is this rank's vocabulary slice (:class:`ChunkedLMHeadLoss`). ``seq_slice``: ``hidden`` is this
    rank's slice [B,S/ranks,H] of rows whose whole ``labels`` [B,S] are given (:func:`shifted_targets`).
    ``impl`` ``liger``: the same label tokens' losses from Liger's fused linear cross entropy (:func:`head_losses`).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, not {chunk_tokens}")
    targets = shifted_targets(labels, seq_slice)  # [B*S] (or this rank's [B*S/ranks])
    rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)  # [M] int64
    # scalar fp32: the summed token losses
    hidden = hidden.reshape(-1, hidden.size(-1))  # [B*S,H]
    total = head_losses(hidden, weight, rows, targets[rows], chunk_tokens, tensor_parallel, impl, "sum", softcap)
    if reduction == "sum":
        return total
    if reduction == "mean":
        return total / rows.numel()  # no label token: 0 / 0 = nan, as F.cross_entropy gives
    raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")


@dataclass(frozen=True)
class LossSplit:
    """This rank's share of the loss, as the parallel plans of its stage return it (parallel/stage.py's
    ``build_pipeline_model`` hands it to the loss's ``split_over``); the defaults: the whole loss on one rank.

    ``tensor_parallel``: (process group, first vocabulary id of this rank's LM head slice): the head is split over
    the group's vocabulary (parallel/tensor_parallel.py). ``seq_slice``: (rank, ranks) of the sequence group: the
    outputs are this rank's slice of each row, the labels whole (parallel/sequence_parallel.py)."""

    tensor_parallel: tuple | None = None
    seq_slice: tuple[int, int] | None = None


class CausalLMLoss:
    """The pipeline's ``loss_fn`` (and the data-parallel engine's loss), normalised per optimizer step.

    It takes the last stage's output: logits [B,S,V], or, with the chunked loss (``chunk_tokens`` > 0, the
    model built with the same ``loss_chunk_tokens``), the pair (hidden [B,S,H], LM head weight [V,H]),
    from which :func:`chunked_causal_lm_loss` computes the same loss without the logits.

    ``impl`` (``loss_impl``, :meth:`compute_head_with`): what computes the loss from (hidden, weight), the chunked
    loss or Liger's fused linear cross entropy (:func:`head_losses`); the same tokens and sums either way.

    ``scale`` None: the mean over this micro-batch's label tokens (``loss_normalization=micro_batch``,
    DeepSpeed's convention). Otherwise the micro-batch's summed token losses times ``scale``, which
    the trainer sets before each step (or eval pass) to ``micro-batches x dp / global label tokens``.

    ``router`` (a MoE model with ``output_router_logits``, set by parallel/stage.py): each training micro-batch adds
    ``router_aux_loss_coef`` x its load-balancing loss, unscaled, as ``<Family>ForCausalLM`` adds it per forward;
    DeepSpeed's division by the micro-batches and mean over data-parallel ranks make it their mean. An eval pass
    returns the cross entropy alone (the router loss is recorded apart).

    ``softcap`` (:func:`logit_softcap` of the model config; None: off): the cross entropy of the logits capped as the
    model's ForCausalLM caps them, on whole logits and chunk by chunk alike.
    """

    def __init__(self, chunk_tokens: int = 0, impl: str = "chunked", softcap: float | None = None) -> None:
        self.scale: float | None = None
        self.chunk_tokens, self.softcap = chunk_tokens, softcap
        self.router: RouterLoss | None = None
        self.split_over(LossSplit())
        self.compute_head_with(impl)

    def split_over(self, split: LossSplit) -> None:
        """Compute this rank's share of the loss (:class:`LossSplit`)."""
        self.tensor_parallel, self.seq_slice = split.tensor_parallel, split.seq_slice

    def compute_head_with(self, impl: str) -> None:
        """Compute the loss from the head's (hidden, weight) with ``impl`` (``loss_impl``; parallel/stage.py's build
        sets the layout's)."""
        self.impl = head_impl(impl, self.chunk_tokens)

    def __call__(self, outputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        reduction = "mean" if self.scale is None else "sum"
        if isinstance(outputs, torch.Tensor) and self.seq_slice is not None:
            loss = F.cross_entropy(  # logits [B,S/ranks,V] against this slice's targets
                soft_capped(outputs.float(), self.softcap).reshape(-1, outputs.size(-1)),
                shifted_targets(labels, self.seq_slice),
                ignore_index=IGNORE_INDEX,
                reduction=reduction,
            )
        elif isinstance(outputs, torch.Tensor):
            loss = causal_lm_loss(outputs, labels, reduction, self.softcap)
        elif self.chunk_tokens < 1:
            raise ValueError(
                "the LM head returned (hidden, weight) for the chunked loss, but this loss has chunk_tokens "
                f"{self.chunk_tokens}: build the loss and the model with the same loss_chunk_tokens"
            )
        else:
            hidden, weight = outputs
            loss = chunked_causal_lm_loss(
                hidden,
                weight,
                labels,
                self.chunk_tokens,
                reduction,
                self.tensor_parallel,
                self.seq_slice,
                self.impl,
                self.softcap,
            )
        loss = loss if self.scale is None else loss * self.scale
        if self.router is not None:
            router_loss = self.router.take()
            if self.router.training:
                loss = loss + self.router.coef * router_loss
        return loss


def head_impl(impl: str, chunk_tokens: int) -> str:
    """``impl`` checked against the loss's ``chunk_tokens``: Liger's loss takes (hidden, weight) from the head, which
    hands them over only with loss_chunk_tokens > 0 (the stage contract above models.llama_pipe.build_specs)."""
    if impl not in LOSS_IMPLS:
        raise ValueError(f"loss impl {impl!r}: choose from {LOSS_IMPLS}")
    if impl == "liger" and chunk_tokens < 1:
        raise ValueError("loss_impl=liger takes (hidden, weight) from the LM head: build with loss_chunk_tokens > 0")
    return impl


def sequence_logps(
    outputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    labels: torch.Tensor,
    chunk_tokens: int = 0,
    tensor_parallel: tuple | None = None,
    impl: str = "chunked",
    softcap: float | None = None,
) -> torch.Tensor:
    """Each row's summed log-probability of its label tokens, fp64 [R]: TRL's per-sequence log-probability, a sum
    over the completion, not a mean (summed in fp64, as the DPO loss takes differences of such sums). ``outputs``:
    logits [R,S,V], or (hidden [R,S,H], LM head weight [V,H]) for the chunked head, whose per-token losses are
    summed per row without the [R,S,V] logits (``impl``: by the chunked loss or Liger's, :func:`head_losses`).
    ``softcap``: of the capped logits (:func:`soft_capped`)."""
    rows_, seq = labels.shape
    if isinstance(outputs, torch.Tensor):
        token_losses = F.cross_entropy(
            soft_capped(outputs[:, :-1, :].float(), softcap).reshape(-1, outputs.size(-1)),  # [R*(S-1),V]
            labels[:, 1:].reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="none",
        )  # [R*(S-1)], 0 where ignored
        return -token_losses.view(rows_, seq - 1).double().sum(dim=1)
    if chunk_tokens < 1:
        raise ValueError("the LM head returned (hidden, weight) for the chunked loss, but chunk_tokens < 1")
    hidden, weight = outputs
    targets = shifted_targets(labels)  # [R*S]
    rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)  # [M]
    # [M] fp32
    token_losses = head_losses(
        hidden.reshape(-1, hidden.size(-1)),
        weight,
        rows,
        targets[rows],
        chunk_tokens,
        tensor_parallel,
        impl,
        "none",
        softcap,
    )
    sums = torch.zeros(rows_, dtype=torch.float64, device=hidden.device)  # [R]
    return -sums.index_add(0, rows // seq, token_losses.double())


# rewards/chosen, ...: the sums over a step's pairs that PreferenceLoss.stats holds, in this order
PREFERENCE_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


class PreferenceLoss:
    """The pipeline's ``loss_fn`` for train_objective=dpo: TRL DPOTrainer's DPO loss of a micro-batch of pairs.

    Labels are ``(labels [2B,S], pair ids [B], reference log-probabilities [2B])`` (data/preference_pairs.py), the B
    chosen rows first. Each row's log-probability is summed over its completion tokens (:func:`sequence_logps`,
    chunk by chunk with the chunked head); the loss is the mean over the micro-batch's pairs, which DeepSpeed's
    division by the micro-batches and mean over data-parallel ranks turn into the mean over the global batch's
    pairs, TRL's loss. ``stats`` sums, over the pairs seen since :meth:`take_stats`, the pair count and then
    :data:`PREFERENCE_METRICS`. With ``recording`` a list, the loss records (pair ids, log-probabilities) instead:
    the reference pass (training/dpo.py). ``softcap``: as :class:`CausalLMLoss`'s.
    """

    def __init__(
        self,
        chunk_tokens: int,
        beta: float,
        loss_type: str,
        label_smoothing: float = 0.0,
        impl: str = "chunked",
        softcap: float | None = None,
    ) -> None:
        self.chunk_tokens, self.beta, self.loss_type, self.softcap = chunk_tokens, beta, loss_type, softcap
        self.label_smoothing = label_smoothing
        self.split_over(LossSplit())  # its seq_slice unused: sequence parallelism is refused with DPO
        self.compute_head_with(impl)
        self.recording: list | None = None
        self.stats = torch.zeros(1 + len(PREFERENCE_METRICS), dtype=torch.float64)

    def split_over(self, split: LossSplit) -> None:
        """Compute this rank's share of the loss (:class:`LossSplit`), as :meth:`CausalLMLoss.split_over`."""
        self.tensor_parallel, self.seq_slice = split.tensor_parallel, split.seq_slice

    def compute_head_with(self, impl: str) -> None:
        """Per-token losses by the chunked loss or Liger's (``loss_impl``): :meth:`CausalLMLoss.compute_head_with`."""
        self.impl = head_impl(impl, self.chunk_tokens)

    def take_stats(self) -> torch.Tensor:
        stats, self.stats = self.stats, torch.zeros_like(self.stats)
        return stats

    def __call__(self, outputs, labels: tuple) -> torch.Tensor:
        labels, pairs, reference = labels
        # [2B]
        logps = sequence_logps(outputs, labels, self.chunk_tokens, self.tensor_parallel, self.impl, self.softcap)
        if self.recording is not None:
            self.recording.append((pairs.cpu(), logps.detach().cpu()))
            return logps.detach().sum() * 0.0
        if torch.isnan(reference).any():
            raise RuntimeError("a micro-batch of pairs reached the DPO loss without its reference log-probabilities")
        chosen, rejected = logps.chunk(2)  # [B] each
        chosen_ratio = chosen - reference[: len(chosen)]
        rejected_ratio = rejected - reference[len(chosen) :]
        if self.loss_type == "ipo":  # TRL's: each log-ratio per completion token (IPO's authors' normalisation)
            counts = (labels != IGNORE_INDEX).sum(dim=1).clamp(min=1)  # [2B]
            delta = chosen_ratio / counts[: len(chosen)] - rejected_ratio / counts[len(chosen) :]
            losses = (delta - 1 / (2 * self.beta)) ** 2
        else:  # sigmoid; label smoothing: conservative DPO, the flipped pair's loss weighted by it
            delta = chosen_ratio - rejected_ratio
            losses = -F.logsigmoid(self.beta * delta) * (1 - self.label_smoothing)
            if self.label_smoothing:
                losses = losses - F.logsigmoid(-self.beta * delta) * self.label_smoothing
        with torch.no_grad():
            chosen_rewards, rejected_rewards = self.beta * chosen_ratio, self.beta * rejected_ratio
            sums = torch.stack(
                [
                    chosen_rewards.sum(),
                    rejected_rewards.sum(),
                    (chosen_rewards > rejected_rewards).double().sum(),
                    (chosen_rewards - rejected_rewards).sum(),
                    chosen.sum(),
                    rejected.sum(),
                ]
            )  # [6] fp64, one transfer off the device
            self.stats[0] += len(chosen)
            self.stats[1:] += sums.cpu()
        return losses.mean().float()
