"""GRPO's update math on plain tensors, as TRL 1.16.0's ``GRPOTrainer`` computes it (fp32 parity in
tests/test_grpo_loss.py). Nothing here knows ranks: the counts TRL takes across processes are arguments.

- ``token_logps_and_entropy``: the fused LM head of ``_get_per_token_logps_and_entropies``
  (``add_fused_lm_head(temperature=...)``): ``log_softmax(logits / temperature)`` at the sampled token, and the
  entropy of that same tempered distribution (TRL logs it as ``entropy``).
- ``rewards_total``: the ``sum_then_normalize`` reward of ``_generate_and_score_completions``: a ``None``
  reward is NaN, the weighted sum skips NaNs (``nansum``), a completion every function left unscored is NaN.
- ``group_advantages``: ``(r - group mean) / (std + 1e-4)``; groups are ``num_generations`` consecutive
  completions, means and the unbiased std ignore NaNs. ``scale_rewards``: ``group`` divides by each group's std,
  ``batch`` by the std of the whole batch (the mean stays per group), ``none`` not at all. NaN advantages
  become 0. ``frac_reward_zero_std`` is the share of completions whose divisor std is (close to) 0.
- ``grpo_loss``: ``_compute_loss`` for ``importance_sampling_level="token"``. With r = exp(logp - old_logp)
  (old = detached logp when ``num_iterations == 1``) the per-token loss is
  -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) (``delta``: r capped at delta in the first term); beta > 0
  adds beta k3, k3 = exp(ref - logp) - (ref - logp) - 1, times r under ``use_bias_correction_kl`` (TRL's default:
  r is 1 on-policy, its gradient is not, so the KL gradient changes; the logged ``kl`` is k3 x r). Over the
  completion mask: ``grpo`` averages per-sequence token means; ``bnpo`` divides the sum by the micro-batch's own
  active tokens; ``dr_grpo`` by rows x ``max_completion_length``; these three then divide by the accumulation
  steps. ``dapo`` divides the sum by ``dapo_normalizer``: the active tokens of the whole generation batch over all
  processes, per process and per accumulation window.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from models.loss import IGNORE_INDEX, LossSplit, head_impl, head_losses, shifted_targets, soft_capped

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4  # TRL's advantage divisor: std + 1e-4


def token_logps_and_entropy(
    logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities of ``token_ids`` [B, T] and entropies [B, T] under ``logits`` [B, T, V] divided by
    ``temperature`` (``logits[:, t]`` predicts ``token_ids[:, t]``: the caller shifts)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    logp_all = F.log_softmax(logits.float() / temperature, dim=-1)
    logps = logp_all.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logps, entropy


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """TRL's ``nanstd``: the unbiased (Bessel) standard deviation ignoring NaNs; NaN with fewer than two values."""
    keep = dim is not None
    mean = torch.nanmean(x, dim=dim, keepdim=True) if keep else torch.nanmean(x)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=keep) if keep else torch.nanmean((x - mean) ** 2)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=keep) if keep else (~torch.isnan(x)).sum()
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    std = torch.sqrt(var * correction)
    return std.squeeze(dim) if keep else std


def rewards_total(per_function: torch.Tensor | Sequence[Sequence[float | None]], weights=None) -> torch.Tensor:
    """The weighted reward [N] of rewards [N, F] (a tensor, or rows of floats where ``None`` = not scored);
    ``weights`` [F] default to ones. NaNs are skipped; a row with no score at all is NaN."""
    if not isinstance(per_function, torch.Tensor):
        per_function = torch.tensor(
            [[math.nan if v is None else v for v in row] for row in per_function], dtype=torch.float32
        )
    w = torch.ones(per_function.shape[1]) if weights is None else torch.as_tensor(weights, dtype=torch.float32)
    total = (per_function * w.to(per_function.device).unsqueeze(0)).nansum(dim=1)
    return total.masked_fill(torch.isnan(per_function).all(dim=1), math.nan)


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(advantages [N], std [N], frac_reward_zero_std)`` of the whole generation batch's rewards [N] (all
    processes: TRL gathers them first), groups of ``num_generations`` consecutive completions."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r} is not one of {', '.join(SCALE_REWARDS)}")
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of num_generations={num_generations}")
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:  # "group", and "none" for the zero-std figure only
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPS)
    frac_zero_std = torch.isclose(std, torch.zeros_like(std)).float().mean()
    return torch.nan_to_num(advantages, nan=0.0), std, frac_zero_std


def dapo_normalizer(
    num_items_in_batch, num_processes: int = 1, gradient_accumulation_steps: int = 1, steps_per_generation: int = 1
) -> torch.Tensor:
    """TRL's ``dapo`` divisor: ``num_items_in_batch`` (active completion tokens of the generation batch summed over all
    processes) / processes x accumulation steps / steps per generation (TRL's default: the accumulation steps)."""
    items = torch.as_tensor(num_items_in_batch, dtype=torch.float32).clamp(min=1.0)
    return items / num_processes * gradient_accumulation_steps / steps_per_generation


def _check(loss_type, importance_sampling_level, beta, ref_per_token_logps, max_completion_length, normalizer):
    problems = []
    if loss_type not in LOSS_TYPES:
        problems.append(f"loss_type={loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
    if importance_sampling_level != "token":
        problems.append(f"importance_sampling_level={importance_sampling_level!r}: only 'token' is implemented")
    if beta != 0.0 and ref_per_token_logps is None:
        problems.append(f"beta={beta} needs ref_per_token_logps (or set beta=0)")
    if loss_type == "dr_grpo" and max_completion_length is None:
        problems.append("loss_type='dr_grpo' needs max_completion_length")
    if loss_type == "dapo" and normalizer is None:
        problems.append("loss_type='dapo' needs normalizer (see dapo_normalizer)")
    if problems:
        raise ValueError("; ".join(problems))


def grpo_loss(
    per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    old_per_token_logps: torch.Tensor | None = None,
    ref_per_token_logps: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    use_bias_correction_kl: bool = True,
    delta: float | None = None,
    loss_type: str = "dapo",
    max_completion_length: int | None = None,
    normalizer=None,
    gradient_accumulation_steps: int = 1,
    importance_sampling_level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch loss TRL back-propagates and the metrics it logs from it (one process's figures).

    ``per_token_logps`` [B, T] of the policy (with grad); ``old_per_token_logps`` None = its detached self;
    ``advantages`` [B]; ``completion_mask`` [B, T]; ``normalizer``: ``dapo``'s divisor (``dapo_normalizer``);
    ``gradient_accumulation_steps`` divides the other loss types (``dapo``'s is inside its normaliser).
    Across processes TRL pools the ``*_mean``, ``kl`` and ``entropy`` figures as token-weighted means and
    ``clip_ratio/low_min`` / ``high_max`` over every sequence's clipped share."""
    _check(loss_type, importance_sampling_level, beta, ref_per_token_logps, max_completion_length, normalizer)
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    mask = completion_mask.to(per_token_logps.dtype)
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    ratio = torch.exp(per_token_logps - old)
    per_token_kl = None
    if beta != 0.0:
        diff = ref_per_token_logps - per_token_logps
        per_token_kl = torch.exp(diff) - diff - 1
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * ratio
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    if delta is not None:  # TRL's clip metrics below see this capped ratio too
        ratio = torch.clamp(ratio, max=delta)
    per_token_loss = -torch.min(ratio * adv, clipped * adv)
    if per_token_kl is not None:
        per_token_loss = per_token_loss + beta * per_token_kl
    loss = _normalise(per_token_loss * mask, mask, loss_type, max_completion_length, normalizer)
    if loss_type != "dapo":
        loss = loss / gradient_accumulation_steps
    return loss, _metrics(ratio, adv, mask, epsilon, epsilon_high, per_token_kl, entropies)


def _normalise(masked_loss, mask, loss_type, max_completion_length, normalizer) -> torch.Tensor:
    if loss_type == "grpo":
        return (masked_loss.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked_loss.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return masked_loss.sum() / (masked_loss.size(0) * max_completion_length)
    return masked_loss.sum() / normalizer


def _metrics(ratio, adv, mask, epsilon, epsilon_high, per_token_kl, entropies) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        tokens = mask.sum().clamp(min=1.0)

        def masked_mean(x):
            return (x * mask).sum() / tokens

        low = ((ratio < 1 - epsilon) & (adv < 0)).float()
        high = ((ratio > 1 + epsilon_high) & (adv > 0)).float()
        out = {}
        if per_token_kl is not None:
            out["kl"] = masked_mean(per_token_kl)
        if entropies is not None:
            out["entropy"] = masked_mean(entropies)
        out["clip_ratio/low_mean"] = masked_mean(low)
        out["clip_ratio/high_mean"] = masked_mean(high)
        out["clip_ratio/region_mean"] = masked_mean(torch.maximum(low, high))
        out["clip_ratio/low_min"] = _nan_extreme((low * mask).sum(-1) / mask.sum(-1), torch.min)
        out["clip_ratio/high_max"] = _nan_extreme((high * mask).sum(-1) / mask.sum(-1), torch.max)
        return out


def _nan_extreme(x: torch.Tensor, reduce) -> torch.Tensor:
    """TRL's ``nanmin`` / ``nanmax``: NaN rows (no active token) are skipped; all NaN gives NaN."""
    kept = x[~torch.isnan(x)]
    return reduce(kept) if kept.numel() else torch.tensor(math.nan, dtype=x.dtype)


# The per-micro-batch sums GRPOLoss.stats holds, in this order (kl is 0 with beta 0; the last two are the micro-batch's
# extremes over its sequences, NaN when none has a completion token)
GRPO_METRICS = (
    "tokens",
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
)
_SUMMED = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@torch.no_grad()
def head_entropies(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    chunk_tokens: int,
    tensor_parallel=None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The entropy [M] fp32 of softmax(hidden[rows] @ weight^T) (TRL's logged ``entropy``; ``hidden`` already
    divided by the temperature), ``chunk_tokens`` rows at a time: log Z - E[logit]. ``tensor_parallel`` (group,
    first vocabulary id): ``weight`` is this rank's vocabulary slice; the max, Z and sum p x logit are all-reduced.
    ``softcap``: of the capped logits (models.loss.soft_capped; elementwise, so per slice too)."""
    group = tensor_parallel[0] if tensor_parallel else None
    out = []
    for start in range(0, rows.numel(), chunk_tokens):
        logits = (hidden[rows[start : start + chunk_tokens]] @ weight.t()).float()  # [c,V] (or this rank's slice)
        logits = soft_capped(logits, softcap)
        top = logits.max(dim=-1).values  # [c]
        if group is not None:
            torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
        e = (logits - top.unsqueeze(1)).exp()  # [c,V]
        z, s = e.sum(-1), (e * logits).sum(-1)  # [c] each
        if group is not None:
            torch.distributed.all_reduce(z, group=group)
            torch.distributed.all_reduce(s, group=group)
        out.append(top + z.log() - s / z)
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


class GRPOLoss:
    """The pipeline's ``loss_fn`` for GRPO on the last stage: :func:`grpo_loss` of a micro-batch of completions.

    ``outputs``: the chunked head's (hidden [B,S,H], weight [V,H]) (``chunk_tokens`` = loss_chunk_tokens > 0; logits
    are refused). ``labels``: ``(labels [B,S] int64, advantages [B], old [B,S], reference [B,S])``: ``labels`` holds
    each row's prompt + completion token ids with ``IGNORE_INDEX`` on the prompt and the padding (position t predicts
    labels[t + 1], as :func:`models.loss.shifted_targets`); ``old`` and ``reference`` are per-token log-probabilities
    in the same layout (the value at a completion token's own position; the rest is ignored), each an empty tensor
    when unused: ``old`` with num_iterations 1 (the detached policy's), ``reference`` with beta 0.

    Log-probabilities are taken at ``temperature``: logits / T = (hidden / T) @ weight^T, so the hidden states are
    divided before the head (no [V,H] copy), through :func:`models.loss.head_losses` (chunked or Liger,
    vocabulary-parallel under :class:`models.loss.LossSplit`'s ``tensor_parallel``). Each row's completion tokens are
    packed left into [B,T] (T the longest completion of the micro-batch) with their mask. ``softcap`` (the model's
    final_logit_softcapping, None: off): TRL tempers the capped logits, cap x tanh(z / cap) / T, which is
    (cap / T) x tanh((z / T) / (cap / T)): the hidden states divided by T as without it, capped at cap / T.

    Normalisation over a step: TRL divides grpo / bnpo / dr_grpo by the accumulation steps itself and dapo by its
    per-window normaliser, and DDP averages gradients over processes. DeepSpeed divides every micro-batch's loss by
    its ``gradient_accumulation_steps`` and averages over the data-parallel ranks, the same mean over ranks. So this
    loss is TRL's micro-batch loss times ``micro_batches`` (DeepSpeed's division undoes the factor): grpo_loss with
    ``gradient_accumulation_steps=1``, and dapo's normaliser divided by ``micro_batches``.
    :meth:`set_step_normalizer` takes TRL's figures before each step: dapo's divisor of this rank's window
    (:func:`dapo_normalizer` of the generation batch's active tokens over all ranks) and DeepSpeed's micro-batches.

    ``stats``: one row per micro-batch since :meth:`take_stats`, :data:`GRPO_METRICS`: its completion tokens, the
    token sums of kl and the clip indicators, and its per-sequence clip extremes. TRL logs each micro-batch's figure
    over all ranks (sums and tokens summed, extremes min / max over ranks), averaged over the micro-batches. With
    ``recording`` a list, the loss records each micro-batch's per-token log-probabilities [B,S] (the labels' layout,
    0 off the completion) instead: the old and reference passes.
    """

    def __init__(
        self,
        chunk_tokens: int,
        *,
        temperature: float = 1.0,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
        loss_type: str = "dapo",
        max_completion_length: int | None = None,
        impl: str = "chunked",
        softcap: float | None = None,
    ) -> None:
        if chunk_tokens < 1:
            raise ValueError(
                f"GRPOLoss takes (hidden, weight) from the chunked head: build the model and the loss with "
                f"loss_chunk_tokens > 0, not {chunk_tokens}"
            )
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        _check(loss_type, "token", 0.0, None, max_completion_length, 1.0)
        self.chunk_tokens, self.temperature, self.softcap = chunk_tokens, temperature, softcap
        self.epsilon, self.epsilon_high, self.beta = epsilon, epsilon_high, beta
        self.loss_type, self.max_completion_length = loss_type, max_completion_length
        self.impl = head_impl(impl, chunk_tokens)
        self.split_over(LossSplit())  # its seq_slice unused: sequence parallelism is not supported here
        self.normalizer, self.micro_batches = None, 1
        self.recording: list | None = None
        self.stats: list[torch.Tensor] = []
        self.router = None  # parallel/stage.py's attach_router_loss (a RouterLoss)

    def compute_head_with(self, impl: str) -> None:
        """Per-token log-probabilities by the chunked loss or Liger's (``loss_impl``), as the other losses."""
        self.impl = head_impl(impl, self.chunk_tokens)

    def split_over(self, split: LossSplit) -> None:
        """Compute this rank's share of the loss (``LossSplit``), as ``CausalLMLoss.split_over``."""
        self.tensor_parallel, self.seq_slice = split.tensor_parallel, split.seq_slice

    def set_step_normalizer(self, normalizer, micro_batches: int) -> None:
        """Before a step: TRL's dapo divisor of this rank's accumulation window (unused by the other loss types) and
        the micro-batches DeepSpeed divides each loss by (its gradient_accumulation_steps)."""
        self.normalizer = None if normalizer is None else torch.as_tensor(normalizer, dtype=torch.float32)
        self.micro_batches = micro_batches

    def take_stats(self) -> torch.Tensor:
        """[micro-batches, len(GRPO_METRICS)] fp64 of the micro-batches since the last call."""
        stats, self.stats = self.stats, []
        return torch.stack(stats) if stats else torch.zeros(0, len(GRPO_METRICS), dtype=torch.float64)

    def token_logps(self, outputs, labels: torch.Tensor, entropy: bool = False):
        """(per-token log-probabilities [M] fp32, their rows [M], their label positions [M], entropies [M] fp32 of
        the tempered distributions or None) of the completion tokens at ``temperature``, in row order."""
        if isinstance(outputs, torch.Tensor):
            raise ValueError("GRPOLoss takes the chunked head's (hidden, weight): build with loss_chunk_tokens > 0")
        hidden, weight = outputs
        seq = labels.shape[1]
        hidden = hidden.reshape(-1, hidden.size(-1))  # [B*S,H]
        if self.temperature != 1.0:
            hidden = hidden / self.temperature  # logits / T, without a copy of the [V,H] head
        cap = None if self.softcap is None else self.softcap / self.temperature  # see the class docstring
        targets = shifted_targets(labels)  # [B*S]
        flat = (targets != IGNORE_INDEX).nonzero().squeeze(1)  # [M]
        losses = head_losses(
            hidden, weight, flat, targets[flat], self.chunk_tokens, self.tensor_parallel, self.impl, "none", cap
        )  # [M] fp32 cross entropy = -logp
        entropies = (
            head_entropies(hidden, weight, flat, self.chunk_tokens, self.tensor_parallel, cap) if entropy else None
        )
        return -losses, flat // seq, flat % seq + 1, entropies

    def __call__(self, outputs, labels: tuple) -> torch.Tensor:
        labels, advantages, old, reference = labels
        # a MoE model with output_router_logits: its load-balancing loss over the rows, as CausalLMLoss adds it
        router_loss = self.router.take() if self.router is not None else None
        logps, row, pos, entropies = self.token_logps(outputs, labels, self.recording is None)  # [M] each
        if self.recording is not None:
            full = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)  # [B,S]
            self.recording.append(full.index_put((row, pos), logps.detach()).cpu())
            return logps.detach().sum() * 0.0
        batch = labels.shape[0]
        counts = torch.bincount(row, minlength=batch)  # [B] completion tokens per row
        col = torch.arange(row.numel(), device=row.device) - (counts.cumsum(0) - counts)[row]  # [M] index in its row
        width = int(counts.max()) if batch else 0

        def packed(values: torch.Tensor) -> torch.Tensor:  # [M] -> [B,T], 0 off the completion
            return torch.zeros(batch, width, dtype=values.dtype, device=values.device).index_put((row, col), values)

        mask = packed(torch.ones_like(logps))
        old_logps = packed(old[row, pos].float()) if old.numel() else None
        ref_logps = packed(reference[row, pos].float()) if reference.numel() else None
        if self.loss_type == "dapo" and self.normalizer is None:
            raise RuntimeError("GRPOLoss with loss_type=dapo needs set_step_normalizer before the step")
        normalizer = None if self.normalizer is None else self.normalizer.to(logps.device) / self.micro_batches
        loss, metrics = grpo_loss(
            packed(logps),
            advantages.to(logps.device, torch.float32),
            mask,
            entropies=packed(entropies),
            old_per_token_logps=old_logps,
            ref_per_token_logps=ref_logps,
            epsilon=self.epsilon,
            epsilon_high=self.epsilon_high,
            beta=self.beta,
            loss_type=self.loss_type,
            max_completion_length=self.max_completion_length,
            normalizer=normalizer,
            gradient_accumulation_steps=1,  # DeepSpeed divides by the micro-batches (see the class docstring)
        )
        self._record_stats(metrics, mask)
        if router_loss is not None and self.router.training:
            loss = loss + self.router.coef * router_loss
        return loss

    def _record_stats(self, metrics: dict[str, torch.Tensor], mask: torch.Tensor) -> None:
        tokens = mask.sum()
        zero = torch.zeros((), device=mask.device)
        row = [tokens] + [metrics.get(name, zero) * tokens for name in _SUMMED]
        row += [metrics["clip_ratio/low_min"].to(mask.device), metrics["clip_ratio/high_max"].to(mask.device)]
        self.stats.append(torch.stack(row).double().cpu())  # one transfer off the device
