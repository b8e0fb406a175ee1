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
