"""DeepSeek-V3's auxiliary-loss-free balancing in training (``moe.bias_update_speed``, docs/moe.md): after each
optimizer step every router's ``e_score_correction_bias`` moves by models.family_deepseek_v3's ``update_bias_`` from
the loads of the step.

Each rank counts what its routers pick in the step's training forwards (``ExpertLoads``: not the eval, generation or
recording passes, which run in eval mode, nor activation checkpointing's recomputation). A layer's loads are summed
over the ranks that hold it, its stage's data-parallel ranks, by one all-reduce over every rank of a [specs, experts]
table in which each rank fills its own layers' rows. Tensor- and sequence-parallel peers see the same tokens and would
add them twice: both are refused for MoE models (parallel/expert_parallel.py). Expert parallelism changes nothing
here: each rank's router still runs on that rank's own tokens (only the experts' work is sent away), so its counts are
its tokens' and the sum over the stage's data-parallel ranks is the step's. Every rank then applies the rule to the
same sums, so the replicas' biases stay equal.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from models.families import moe_spec
from models.family_deepseek_v3 import ExpertLoads, update_bias_
from models.files.pipeline_dir import local_modules

BIASED_FAMILIES = ("deepseek_v3",)  # the families whose routers have an e_score_correction_bias


def bias_update_problems(speed: float, model_config) -> list[str]:
    """moe.bias_update_speed's range, and a speed > 0 for a model without a router bias (the rule would move
    nothing): one line each."""
    if speed < 0:
        return [f"moe.bias_update_speed {speed:g} < 0: set it >= 0 (0 = off; the DeepSeek-V3 report's 0.001)"]
    model_type = getattr(model_config, "model_type", None)
    if speed > 0 and model_config is not None and model_type not in BIASED_FAMILIES:
        return [
            f"moe.bias_update_speed {speed:g}: {model_type} has no router bias to move (e_score_correction_bias: "
            f"{', '.join(BIASED_FAMILIES)} only): set moe.bias_update_speed=0"
        ]
    return []


def balance_loss_problems(moe, model_config, engine=None, train_objective="sft") -> list[str]:
    """``moe`` (the run's MoEConfig): moe.sequence_balance_coef's range, and a coef > 0 where no loss would add it:
    another family, the data-parallel engine (``engine``, the layout's: its stack carries no routing on the wire),
    DPO's loss. One line each."""
    coef = moe.sequence_balance_coef
    knob = f"moe.sequence_balance_coef {coef:g}"
    if coef < 0:
        return [f"{knob} < 0: set it >= 0 (0 = off; the DeepSeek-V3 report's alpha 0.0001)"]
    if coef == 0:
        return []
    problems = []
    model_type = getattr(model_config, "model_type", None)
    if model_config is not None and model_type not in BIASED_FAMILIES:
        problems.append(
            f"{knob}: {model_type} has no DeepSeek-V3 sigmoid router for the sequence-wise balance loss "
            f"({', '.join(BIASED_FAMILIES)} only; other families' router loss: output_router_logits and "
            "router_aux_loss_coef in the model config): set moe.sequence_balance_coef=0"
        )
    if train_objective == "dpo":
        problems.append(f"{knob} with train_objective=dpo: the preference loss adds no balance loss; set it to 0")
    if engine is not None:
        problems += engine.needs_pipeline(knob)
    return problems


class BiasBalancer:
    """The routers of this rank's layers, their loads counted from construction on; :meth:`after_step` (a collective:
    every rank calls it, with or without MoE layers) updates their biases."""

    def __init__(self, model: torch.nn.Module, speed: float, num_specs: int, num_experts: int):
        self.speed, self.num_specs, self.num_experts = speed, num_specs, num_experts
        counters = {index: ExpertLoads(module) for index, module in local_modules(model)}
        self.counters = {index: c for index, c in counters.items() if c.routers}
        for index, counter in counters.items():
            if not counter.routers:
                counter.remove()
            elif len(counter.routers) != 1:
                raise ValueError(f"spec {index} holds {len(counter.routers)} routers, one expected")

    @staticmethod
    def of(model: torch.nn.Module, config, speed: float) -> BiasBalancer | None:
        """The balancer of ``model`` (a ``PipelineModule`` or the data-parallel engine's stack) of ``config``, None at
        speed 0."""
        if not speed:
            return None
        return BiasBalancer(model, speed, len(model._layer_specs), moe_spec(config).num_experts)

    def after_step(self, applied: bool = True) -> dict[int, torch.Tensor]:
        """The step's loads [E] int64 per spec index of a MoE layer (every rank's, summed over the ranks holding it);
        with ``applied`` (the optimizer took the step, the same on every rank) each local router's bias moved by them.
        """
        taken = {index: next(iter(c.take().values())) for index, c in self.counters.items()}
        table = torch.zeros(self.num_specs, self.num_experts, dtype=torch.int64)
        for index, loads in taken.items():
            table[index] = loads
        table = table.to(get_accelerator().current_device_name())  # NCCL: on the GPU
        dist.all_reduce(table)
        table = table.cpu()
        if applied:
            for index, counter in self.counters.items():
                (router,) = counter.routers.values()
                update_bias_(router.e_score_correction_bias, table[index], self.speed)
        return {index: table[index] for index in range(self.num_specs) if table[index].any()}

    def remove(self) -> None:
        for counter in self.counters.values():
            counter.remove()


def load_imbalance(loads: dict[int, torch.Tensor]) -> float:
    """The most tokens any expert got, over every MoE layer, / that layer's mean per expert (1.0: balanced)."""
    return max(((t.max() / t.float().mean()).item() for t in loads.values() if t.any()), default=float("nan"))
