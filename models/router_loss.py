"""Hugging Face's load-balancing loss of Mixture-of-Experts models when their MoE layers sit on several pipeline
stages (``load_balancing_loss_func`` of Mixtral and Qwen3-MoE; Llama 4's ``ForCausalLM`` adds none).

Hugging Face sums three statistics over **all** MoE layers of one forward: the top-k assignments per expert T [E],
the router probabilities per expert R [E] and the routed rows N, and returns E * sum_e (T_e / N) * (R_e / N).
Computed per stage, each over its own layers, it is another number with another gradient. The statistics are sums,
so they travel with the activations (:class:`RouterStats`): each stage adds its layers' parts to the sums it
received, in layer order (the order Hugging Face adds them in, so the result is bit-identical), and hands them on;
the last stage computes the loss from the totals. T and N carry no gradient (top-k counts); R's gradient,
E * T / N^2, flows back through the pipeline to every stage's routers as an activation's gradient does.

Not used by training yet: issue 44 wires it into the MoE stages.
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
