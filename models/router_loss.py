"""Hugging Face's load-balancing loss of Mixture-of-Experts models when their MoE layers sit on several pipeline
stages (``load_balancing_loss_func`` of Mixtral and Qwen3-MoE; Llama 4's ``ForCausalLM`` adds none).

Hugging Face sums three statistics over **all** MoE layers of one forward: the top-k assignments per expert T [E],
the router probabilities per expert R [E] and the routed rows N, and returns E * sum_e (T_e / N) * (R_e / N).
Computed per stage, each over its own layers, it is another number with another gradient. The statistics are sums,
so they travel with the activations (:class:`RouterStats`): each stage adds its layers' parts to the sums it
received, in layer order (the order Hugging Face adds them in, so the result is bit-identical), and hands them on;
the last stage computes the loss from the totals. T and N carry no gradient (top-k counts); R's gradient,
E * T / N^2, flows back through the pipeline to every stage's routers as an activation's gradient does.

Between stages the sums travel as two tensors (:meth:`RouterStats.to_wire`): the counts as int64 (no float tensor may
travel without a gradient between DeepSpeed's stages) and the probabilities as fp32. :class:`RouterLoss` is what the
last stage's loss adds: ``router_aux_loss_coef`` x the loss of each micro-batch, as ``<Family>ForCausalLM`` adds it to
its cross entropy per forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RouterStats:
    """Running sums over the MoE layers seen so far in one forward."""

    tokens: torch.Tensor  # [E] float32: top-k assignments per expert (no gradient)
    probs: torch.Tensor  # [E] float32: router probabilities summed per expert
    rows: torch.Tensor  # [] float32: rows routed, summed over layers

    @staticmethod
    def zeros(num_experts: int, device: torch.device | str = "cpu") -> RouterStats:
        zero = torch.zeros(num_experts, dtype=torch.float32, device=device)
        return RouterStats(zero, zero.clone(), torch.zeros((), dtype=torch.float32, device=device))

    @staticmethod
    def initial_wire(hidden: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sums before the first layer, as the first spec sends them: counts int64 [E+1] (per expert, then the
        rows) and probabilities fp32 [E]. The probabilities are joined to ``hidden``'s graph (x 0): DeepSpeed
        requires every float tensor a stage sends to require a gradient, and a first stage without a MoE layer
        would otherwise send a constant."""
        counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=hidden.device)
        probs = hidden.new_zeros(num_experts, dtype=torch.float32) + hidden.reshape(-1)[:1].float().sum() * 0.0
        return counts, probs

    @classmethod
    def from_wire(cls, counts: torch.Tensor, probs: torch.Tensor) -> RouterStats:
        """The sums from what a stage received: counts int64 [E+1], probabilities fp32 [E]."""
        return cls(counts[:-1].float(), probs, counts[-1].float())

    def to_wire(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts int64 [E+1], probabilities fp32 [E]): the counts are whole numbers, exact in both types."""
        return torch.cat([self.tokens, self.rows.reshape(1)]).round().long(), self.probs

    def add_layer(self, gate_logits: torch.Tensor, top_k: int) -> RouterStats:
        """These sums with one MoE layer's router logits [rows, E] added, as Hugging Face adds them."""
        num_experts = self.tokens.shape[0]
        routing_weights = torch.nn.functional.softmax(gate_logits, dim=-1)  # [rows, E]
        _, selected = torch.topk(routing_weights, top_k, dim=-1)  # [rows, top_k]
        # histc as transformers counts (float bins on the CPU, int32 on a GPU: each exact)
        histc_dtype = torch.float32 if gate_logits.device.type in ("cpu", "mps") else torch.int32
        counts = torch.histc(selected.reshape(-1).to(histc_dtype), bins=num_experts, min=0, max=num_experts)
        return RouterStats(
            self.tokens + counts,
            self.probs + routing_weights.float().sum(dim=0),
            self.rows + routing_weights.shape[0],
        )


def load_balancing_loss(stats: RouterStats) -> torch.Tensor:
    """E * sum_e (T_e / N) * (R_e / N) from the totals over every MoE layer of the model (a scalar)."""
    num_experts = stats.tokens.shape[0]
    tokens_per_expert = stats.tokens / stats.rows  # [E]
    router_prob_per_expert = stats.probs / stats.rows  # [E]
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * num_experts


class RouterLoss:
    """The router loss of the last stage's ``loss_fn``: the norm spec hands it each micro-batch's totals
    (:meth:`receive`), the loss takes ``coef x load_balancing_loss`` of them (:meth:`take`), and the sums of a step's
    router losses and tokens per expert wait for :meth:`take_metrics` (the progress line). A subclass carries other
    sums on the same wire (``stats``) and makes another loss of them (:meth:`loss_of`, logged as ``metric``):
    DeepSeek-V3's sequence-wise balance loss (models/family_deepseek_v3.py)."""

    metric = "router_loss"  # the loss's name in the metrics
    stats = RouterStats  # what the wire's two tensors hold

    def __init__(self, num_experts: int, top_k: int, coef: float):
        self.num_experts, self.top_k, self.coef = num_experts, top_k, coef
        self.pending: RouterStats | None = None
        self.training = True
        self._reset()

    def _reset(self) -> None:
        self.loss_sum, self.micro_batches = 0.0, 0
        self.tokens = torch.zeros(self.num_experts, dtype=torch.float64)  # top-k assignments per expert, all layers

    def receive(self, counts: torch.Tensor, probs: torch.Tensor, training: bool) -> None:
        self.pending, self.training = self.stats.from_wire(counts, probs), training

    def take(self) -> torch.Tensor:
        """This micro-batch's load-balancing loss (a scalar with the routers' gradient), recorded for the metrics."""
        if self.pending is None:
            raise RuntimeError("the router loss found no routing statistics: the norm spec did not hand them over")
        stats, self.pending = self.pending, None
        loss = self.loss_of(stats)
        self.loss_sum += float(loss.detach())
        self.micro_batches += 1
        self.tokens += stats.tokens.detach().double().cpu()
        return loss

    @staticmethod
    def loss_of(stats: RouterStats) -> torch.Tensor:
        return load_balancing_loss(stats)

    def take_metrics(self) -> tuple[float, int, torch.Tensor]:
        """(sum of router losses, micro-batches, tokens per expert [E]) since the last call."""
        out = (self.loss_sum, self.micro_batches, self.tokens)
        self._reset()
        return out
