"""Expert parallelism (``expert_parallel=N``): each MoE layer's experts divided over N data-parallel ranks of its stage.

The N consecutive coordinates ``data = g * N + j`` of DeepSpeed's data axis form expert group g; rank j of every group
holds experts ``j * E/N .. (j + 1) * E/N - 1`` of every MoE layer of the stage (the rows of every parameter of
Hugging Face's fused experts module: ``gate_up_proj [E,2I,H]`` and ``down_proj [E,H,I]``; gpt-oss's ``[E,H,2I]``,
``[E,I,H]`` and their biases), and nothing else changes: the router (DeepSeek-V3's with its bias), shared experts,
attention and every other weight stay whole on every rank. In each MoE layer the router runs where the tokens are;
each (token, expert) pair then goes to its expert's rank, which runs Hugging Face's own experts module on what it
received, and the results come back the same way (two all-to-alls with the pairs' counts, :class:`_AllToAll`, written
here because the collective with split sizes and a gradient is not in DeepSpeed and torch's is private); the rank
weights and sums each token's k results in the router's order of the k slots, as the experts' kernel the stages run
(``grouped_mm``, models/llama_pipe.py's ``prepare_config``) sums them. No pair is dropped (no capacity factor).

Gradients: rank j's experts get the gradient of its group's N ranks' tokens; the ranks holding the same experts (one
per group: the expert-data-parallel group) sum theirs and divide by the data axis, so the result is the gradient of
the global batch, as DeepSpeed's average over the data axis is for every other weight. The global gradient norm counts
every expert once (its squares summed over the expert group). Both are DeepSpeed's own MoE paths, for every optimizer
it runs here (fp32 at ZeRO-0, its bf16 optimizer, ZeRO-1): the expert parameters carry its MoE flags and the groups
are in its registry (:func:`register_expert_groups`), the engine is built with its MoE paths on
(:meth:`ExpertParallelPlan.building_engine`), and the optimizer partitions the experts' states over the
expert-data-parallel group only (DeepSpeed's ``moe`` parameter groups). Only fp32 at ZeRO-0's clipping is ours
(:func:`clip_with_experts_`): DeepSpeed's there averages the ranks' norms.

Building: the stage is built on the meta device and only this rank's experts get memory (``ep_split``, read by
models/files/pipeline_dir.py like tensor parallelism's ``tp_split``): layer files keep every expert, and a rank reads
its own rows of the memory-mapped file. Saving gathers the experts of each layer over the expert group and data-parallel
rank 0 writes them whole, so a layer file is the same for any ``expert_parallel``. The optimizer states: ZeRO-1 and bf16
write every data-parallel rank's partitions (the experts' over their expert-data-parallel group); in fp32 at ZeRO-0
each expert rank writes its own experts' Adam moments (:func:`expert_moments_file`). training/checkpoints/reshard.py
joins both.
"""

from __future__ import annotations

import contextlib
import math
import os
import re

import deepspeed.runtime.engine
import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.utils import groups
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from models.families import moe_spec
from models.files.pipeline_dir import local_modules
from models.llama_pipe import LlamaPipelineModule, materialize_
from parallel.axis import AxisPlan, ModelFacts, RuleSettings
from parallel.layout import Layout
from parallel.split_layer_files import load_pieces, save_whole


def expert_moments_file(stage: int, rank: int) -> str:
    """The file of stage ``stage``'s expert-parallel rank ``rank`` (> 0) holding its experts' Adam moments, by the
    positions of the optimizer's parameters, as DeepSpeed's ``mp_rank_<stage>_model_states.pt`` holds rank 0's."""
    return f"expert_moments_mp_rank_{stage:02d}_ep_{rank:02d}.pt"


EXPERT_MOMENTS_FILE = re.compile(r"^expert_moments_mp_rank_(\d+)_ep_(\d+)\.pt$")


def expert_group_name(ep: int) -> str:
    """The name DeepSpeed's registry and its MoE parameters know the groups by (its own ``ep_size_<N>``)."""
    return f"ep_size_{ep}"


def expert_groups(topology, ep: int):
    """This rank's (expert group, its rank in it, expert-data-parallel group, the two groups' global ranks).
    Collective: every rank creates every group in the same order (torch's rule for ``new_group``)."""
    axes = [a for a in topology.get_axis_names() if a != "data"]
    data = topology.get_dim("data")
    mine: dict[str, object] = {}
    for fixed in sorted(
        {tuple(getattr(c, a) for a in axes) for c in map(topology.get_coord, range(topology.world_size()))}
    ):
        coords = dict(zip(axes, fixed))
        for first in range(0, data, ep):  # expert groups: consecutive data coordinates
            ranks = [topology.get_rank(**coords, data=first + j) for j in range(ep)]
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine["ep"], mine["rank"], mine["ep_ranks"] = group, ranks.index(dist.get_rank()), ranks
        for j in range(ep):  # expert-data-parallel groups: the same slot of every expert group
            ranks = [topology.get_rank(**coords, data=first + j) for first in range(0, data, ep)]
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine["edp"], mine["edp_ranks"] = group, ranks
    return mine["ep"], mine["rank"], mine["edp"], mine["ep_ranks"], mine["edp_ranks"]


def register_expert_groups(ep: int, ep_group, edp_group, ep_ranks: list[int], edp_ranks: list[int]) -> None:
    """This rank's groups in DeepSpeed's registry (``deepspeed.utils.groups``), under :func:`expert_group_name`, where
    its engine, bf16 optimizer and ZeRO optimizer look them up by the parameters' ``group_name``; what
    ``deepspeed.moe``'s own layer does with the groups DeepSpeed lays out, here with ours (data-parallel ranks of
    one stage)."""
    name = expert_group_name(ep)
    groups._EXPERT_PARALLEL_GROUP[name], groups._EXPERT_PARALLEL_GROUP_RANKS[name] = ep_group, ep_ranks
    groups._EXPERT_DATA_PARALLEL_GROUP[name], groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = edp_group, edp_ranks


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with split sizes; its gradient is the all-to-all back."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


def _exchange_counts(send: torch.Tensor, group) -> list[int]:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist()


class ExpertParallelExperts:
    """Mixed before a Hugging Face experts class (:data:`EXPERT_PARALLEL_CLASSES`) whose instance holds this rank's
    ``num_experts`` = E/N experts: its forward takes the layer's tokens and their routing over all E experts."""

    ep_group = None
    ep_rank = 0
    ep_size = 1

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = top_k_index.shape  # hidden [T,H], top_k_index [T,k] global expert ids, top_k_weights [T,k]
        local = self.num_experts
        pair_expert = top_k_index.reshape(-1)  # [T*k]
        order = torch.argsort(pair_expert // local, stable=True)  # [T*k]: the pairs grouped by destination rank
        send = torch.bincount(pair_expert // local, minlength=self.ep_size)  # [N] pairs per rank
        recv = _exchange_counts(send, self.ep_group)
        send = send.tolist()
        rows = _AllToAll.apply(hidden[order // k], send, recv, self.ep_group)  # [R,H] tokens for my experts
        ids = torch.empty(sum(recv), dtype=torch.int64, device=hidden.device)
        dist.all_to_all_single(ids, (pair_expert[order] % local).contiguous(), recv, send, group=self.ep_group)
        ones = torch.ones(len(ids), 1, dtype=hidden.dtype, device=hidden.device)
        out = super().forward(rows, ids[:, None], ones)  # [R,H]: Hugging Face's experts on what this rank received
        returned = _AllToAll.apply(out, recv, send, self.ep_group)  # [T*k,H] in the order sent
        unsort = torch.empty_like(order)
        unsort[order] = torch.arange(len(order), device=order.device)
        weighted = returned[unsort].view(tokens, k, -1) * top_k_weights[..., None].to(returned.dtype)  # [T,k,H]
        return weighted.sum(dim=1)  # [T,H]: the k slots summed in the router's order, as grouped_mm sums them


class ExpertParallelQwen3MoeExperts(ExpertParallelExperts, Qwen3MoeExperts):
    """Qwen3-MoE's experts, this rank's share."""


class ExpertParallelMixtralExperts(ExpertParallelExperts, MixtralExperts):
    """Mixtral's experts, this rank's share."""


class ExpertParallelQwen3_5MoeExperts(ExpertParallelExperts, Qwen3_5MoeExperts):
    """Qwen3.5-MoE's routed experts, this rank's share (its shared expert stays whole on every rank)."""


class ExpertParallelDeepseekV3Experts(ExpertParallelExperts, DeepseekV3Experts):
    """DeepSeek-V3's routed experts, this rank's share (its shared experts stay whole; the router, with its
    ``e_score_correction_bias``, runs where the tokens are)."""


class ExpertParallelGptOssExperts(ExpertParallelExperts, GptOssExperts):
    """gpt-oss's experts, this rank's share: ``gate_up_proj [E,H,2I]``, ``down_proj [E,I,H]`` and their biases
    ``[E,2I]``, ``[E,H]``, all split on the expert dimension."""


# The class each Hugging Face experts class becomes on a rank holding some of its experts (llama4_text has none:
# its experts run every token, expert_parallel's rules refuse it). Each one's forward takes (hidden [T,H], expert ids
# [T,k], weights [T,k]): the mixin calls it with k=1 (weight 1) on the pairs its rank received.
EXPERT_PARALLEL_CLASSES: dict[type, type] = {
    Qwen3MoeExperts: ExpertParallelQwen3MoeExperts,
    MixtralExperts: ExpertParallelMixtralExperts,
    Qwen3_5MoeExperts: ExpertParallelQwen3_5MoeExperts,
    DeepseekV3Experts: ExpertParallelDeepseekV3Experts,
    GptOssExperts: ExpertParallelGptOssExperts,
}


def expert_parallel_class(cls: type) -> type:
    """:data:`EXPERT_PARALLEL_CLASSES`' class for the Hugging Face experts class ``cls``."""
    if cls not in EXPERT_PARALLEL_CLASSES:
        raise TypeError(f"expert_parallel has no class for {cls.__name__}: add one to EXPERT_PARALLEL_CLASSES")
    return EXPERT_PARALLEL_CLASSES[cls]


def split_experts_(model, group, rank: int, size: int) -> int:
    """Keep this rank's experts of every MoE layer of the stage, while its parameters are on the meta device; returns
    how many experts modules were split."""
    moe = moe_spec(model._llama_config)
    split = 0
    for _, module in local_modules(model):
        for name, experts in list(module.named_modules()):
            if not name.endswith(moe.experts.rsplit(".", 1)[-1]) or not hasattr(experts, "gate_up_proj"):
                continue
            for pname, p in list(experts.named_parameters(recurse=False)):
                local = nn.Parameter(torch.empty((p.shape[0] // size, *p.shape[1:]), dtype=p.dtype, device="meta"))
                local.__dict__.update(p.__dict__)  # DeepSpeed's flags (ds_pipe_replicated)
                local.ep_split = (0, rank, size)
                # DeepSpeed's MoE flags: reduced over the expert-data-parallel group, in the optimizer's moe groups
                local.allreduce, local.group_name = False, expert_group_name(size)
                # deepspeed.initialize broadcasts the experts within that group from a rank its registry computes
                # for its own layout; each rank reads its experts from the layer files instead (OptimizedLinear's
                # flag: a parameter unique per rank)
                local.ds_optim_param = True
                setattr(experts, pname, local)
            experts.num_experts = moe.num_experts // size
            experts.__class__ = expert_parallel_class(type(experts))
            experts.ep_group, experts.ep_rank, experts.ep_size = group, rank, size
            split += 1
    return split


class ExpertParallelStage(LlamaPipelineModule):
    """The stage's class with expert parallelism (``ExpertParallelPlan.stage_class``): built with only this rank's
    experts, saved with every expert (gathered over the expert group), loaded with its own."""

    # (expert group, rank in it, size): set by ExpertParallelPlan.before_build, the one way into
    # PipelineModule.__init__'s build (one model per process); the engine reads it from the stage. The
    # expert-data-parallel group is in DeepSpeed's registry (register_expert_groups), where its reduction finds it.
    _ep = None

    def _build(self) -> None:
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            super()._build()
        split_experts_(self, *self._ep)
        materialize_(self)

    def save_state_dict(self, save_dir, checkpoint_engine, exclude_frozen_params=False):
        group, _, size = self._ep
        if self._grid.data_parallel_id < size:  # expert group 0 (data-parallel ranks 0..size-1) writes the files
            save_whole(self, save_dir, checkpoint_engine, group, "ep_split")
        return None

    def load_state_dir(self, load_dir, checkpoint_engine, strict=True):
        load_pieces(self, load_dir)
        return None


class ExpertParallelEngine(PipelineEngine):
    """DeepSpeed's pipeline engine, built with its MoE paths on (gradient reduction, bf16 and ZeRO-1 optimizers),
    whose fp32 ZeRO-0 clipping counts each expert once and whose checkpoint is the pipeline's layer files and engine
    file rather than DeepSpeed's MoE checkpoint (per-expert files of its own MoE layer)."""

    def _save_moe_checkpoint(self, save_dir, tag, client_state={}, exclude_frozen_parameters=False):
        self.save_non_zero_checkpoint = self._save_engine_file  # DeepSpeed's MoE branch turned it off
        self._save_checkpoint(save_dir, tag, client_state, exclude_frozen_parameters)

    def _save_checkpoint(self, save_dir, tag, client_state={}, exclude_frozen_parameters=False):
        """DeepSpeed's engine file (data-parallel rank 0), and in fp32 at ZeRO-0, where that file holds rank 0's Adam
        moments, the moments of each other rank of expert group 0's experts (:func:`expert_moments_file`), so no rank
        ever holds more than its own; training/checkpoints/reshard.py joins them, and a run with expert_parallel always
        resumes through it. ZeRO-1 and bf16 write every rank's partitions in DeepSpeed's own files."""
        super()._save_checkpoint(save_dir, tag, client_state, exclude_frozen_parameters)
        _, rank, size = self.module._ep
        if self.optimizer is None or self.save_zero_checkpoint or self._grid.data_parallel_id >= size or rank == 0:
            return
        order = [p for g in self.optimizer.param_groups for p in g["params"]]
        moments = {
            index: {name: self.optimizer.state[p][name] for name in ("exp_avg", "exp_avg_sq")}
            for index, p in enumerate(order)
            if hasattr(p, "ep_split") and p in self.optimizer.state
        }
        path = os.path.join(save_dir, str(tag), expert_moments_file(self._grid.get_pipe_parallel_rank(), rank))
        self.checkpoint_engine.save(state_dict={"optimizer": {"state": moments}}, path=path)

    def clip_fp32_gradients(self):
        self._global_grad_norm = clip_with_experts_(self.module.parameters(), self.gradient_clipping(), self)


@torch.no_grad()
def clip_with_experts_(parameters, max_norm: float, engine) -> float:
    """Clip every gradient by the global norm of the model's: each stage's weights counted once (the model-parallel
    flags of ``LlamaPipelineModule``), each expert once (summed over its expert group)."""
    dense = torch.zeros((), dtype=torch.float32)
    experts = torch.zeros((), dtype=torch.float32)
    grads, first_stage = [], engine.mpu.get_model_parallel_rank() == 0
    for p in parameters:
        if p.grad is None:
            continue
        grads.append(p.grad)
        if hasattr(p, "ep_split"):
            experts += p.grad.float().pow(2).sum()
        elif getattr(p, "model_parallel", False) or first_stage:  # DeepSpeed's rule: a tied copy on stage 0 only
            dense += p.grad.float().pow(2).sum()
    dist.all_reduce(experts, group=engine.expert_group)
    total = dense + experts
    dist.all_reduce(total, group=engine.mpu.get_model_parallel_group())
    norm = math.sqrt(total.item())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


class ExpertParallelPlan(AxisPlan):
    """A Mixture-of-Experts model's rules and ``expert_parallel``'s (parallel/axis.py's rules), and the steps of
    ``expert_parallel`` > 1: the expert and expert-data-parallel groups before the stage, the stage built with this
    rank's experts (:class:`ExpertParallelStage`), and the engine's gradient reduction and clipping made the experts'
    (:class:`ExpertParallelEngine`). Checkpoint pieces: the layer files with every expert, gathered by ``ep_split``
    (the stage's save and load), and in fp32 at ZeRO-0 each expert rank's Adam moments (the engine's save,
    :func:`expert_moments_file`; training/checkpoints/reshard.py joins them)."""

    stage_class = ExpertParallelStage
    checkpoint_pieces = (
        ExpertParallelStage.save_state_dict,
        ExpertParallelStage.load_state_dir,
        ExpertParallelEngine._save_checkpoint,
    )

    @staticmethod
    def used(layout: Layout) -> bool:
        return layout.ep > 1

    @staticmethod
    def objective_problems(layout: Layout, train_objective: str) -> list[str]:
        """train_objective=grpo: generation on the stages is built for ranks that hold every expert."""
        if layout.ep <= 1 or train_objective != "grpo":
            return []
        return [
            f"expert_parallel {layout.ep} with train_objective=grpo is not supported yet: generation on the pipeline's "
            "stages (parallel/pipeline_generation.py) is built for ranks that hold every expert; set expert_parallel=1"
        ]

    @staticmethod
    def layout_problems(
        layout: Layout, model: ModelFacts = ModelFacts(), settings: RuleSettings = RuleSettings()
    ) -> list[str]:
        """With the numbers and what to use instead: the pipeline engine; no tensor or sequence parallelism,
        DualPipeV, PEFT or DPO with experts; ep dividing the data-parallel degree and each MoE layer's experts, not
        in fp16, no optimizer offload, and not with llama4_text (whose experts run every token). ``model``'s
        ``num_experts``: 0 for a dense model, None for a model not known (only ep >= 1 is checked); its
        ``model_type`` names the model in the lines."""
        ep, model_type, num_experts = layout.ep, model.model_type, model.num_experts
        if ep < 1:
            return [f"expert_parallel {ep} must be >= 1 (1: every rank holds every expert)"]
        if num_experts is None:
            return []
        if not num_experts:
            if ep == 1:
                return []
            dense = (
                f"model_type {model_type}, which has no experts"
                if model_type
                else "a dense model (no experts to split)"
            )
            return [f"expert_parallel {ep} with {dense}: use expert_parallel=1"]
        peft_method, ds_config = settings.peft(layout), settings.ds(layout)
        kind = f"a Mixture-of-Experts model ({model_type})" if model_type else "a Mixture-of-Experts model"
        problems = layout.engine.needs_pipeline(kind, ds_config)
        for what, value, instead in (
            ("tensor_parallel", layout.tp > 1, "expert_parallel to divide the experts, and stages"),
            ("sequence_parallel", layout.sp > 1, "shorter rows or more stages"),
            ("pipeline_schedule=dualpipev", layout.schedule == "dualpipev", "pipeline_schedule=1f1b"),
            (f"peft.method={peft_method}", peft_method != "none", "full training (peft.method=none)"),
            ("train_objective=dpo", settings.train_objective == "dpo", "train_objective=sft"),
        ):
            if value:
                problems.append(f"{what} with {kind} is not supported yet: use {instead}")
        if ep == 1:
            return problems
        if layout.dp and layout.data_axis % ep:
            problems.append(
                f"expert_parallel {ep} must divide the data-parallel degree {layout.data_axis} (world size / "
                "num_stages): the experts are split over data-parallel ranks of each stage"
            )
        if model_type == "llama4_text":
            problems.append(
                f"expert_parallel {ep} with llama4_text: Hugging Face's Llama 4 experts run every token through every "
                "expert (scaled by its router score), not a dispatch to k experts; use expert_parallel=1"
            )
        elif model_type == "gemma4_text":
            problems.append(
                f"expert_parallel {ep} with gemma4_text's MoE block is not supported yet: its experts are checked in "
                "one process only (tests/test_family_gemma4.py), and its router's weights are fp32 where the "
                "expert-parallel sum casts them to the activations' dtype; use expert_parallel=1"
            )
        elif num_experts % ep:
            works = [n for n in range(1, num_experts + 1) if num_experts % n == 0]
            problems.append(
                f"expert_parallel {ep} must divide the {num_experts} experts of each MoE layer: use one of {works}"
            )
        if layout.dtype == "fp16":
            problems.append(
                f"expert_parallel {ep} with precision=fp16: not supported yet (the experts' gradient reduction, "
                "their share of the gradient norm and their optimizer groups are built and tested in fp32 and bf16 "
                "only, not with fp16's loss scaling); set precision=bf16 (or fp32), or expert_parallel=1"
            )
        if layout.offload_optimizer:
            problems.append(
                f"expert_parallel {ep} with the optimizer offloaded (ds={ds_config}): not supported yet (DeepSpeed's "
                "CPU Adam is not run with its MoE parameter groups here); keep the optimizer states on the GPU "
                "(ds=zero1 shards them over the data axis, without offloading) or use expert_parallel=1"
            )
        return problems

    @classmethod
    def problems(cls, cfg, model_config, layout: Layout, ds_json: dict | None = None) -> list[str]:
        """The layout's rules with the config's settings (without a model config, whose own problem is said, only
        ep >= 1), after the DeepSpeed JSON's ZeRO-1 reduce-scatter."""
        problems = []
        if layout.ep > 1 and (ds_json or {}).get("zero_optimization", {}).get("reduce_scatter") is False:
            problems.append(
                f"expert_parallel {layout.ep} with zero_optimization.reduce_scatter=false in {cfg.ds_config}: "
                "DeepSpeed reduces the experts' gradients over their group in its reduce-scatter path only; remove "
                "the key"
            )
        return problems + super().problems(cfg, model_config, layout, ds_json)

    def before_build(self, config, topology, attention: str) -> str:
        group, rank, edp, ep_ranks, edp_ranks = expert_groups(topology, self.layout.ep)
        register_expert_groups(self.layout.ep, group, edp, ep_ranks, edp_ranks)
        ExpertParallelStage._ep = (group, rank, self.layout.ep)
        return attention

    def ds_config_(self, ds: dict) -> None:
        # DeepSpeed's ZeRO-1 reduces the experts' gradients over their group in its reduce-scatter path only
        # (stage_1_and_2.py asserts it with MoE); train.py's CPU default turns that path off (training/optim.py)
        zero = ds.setdefault("zero_optimization", {})
        if zero.get("stage", 0) == 1:
            zero.setdefault("reduce_scatter", True)
            zero.setdefault("contiguous_gradients", True)

    @contextlib.contextmanager
    def building_engine(self):
        """DeepSpeed's engine turns its MoE paths on when it finds its own MoE layer among the modules
        (``_configure_distributed_model``): while it is built, the experts modules of this plan count as one."""
        found = deepspeed.runtime.engine.MoE
        deepspeed.runtime.engine.MoE = (MoE, ExpertParallelExperts)
        try:
            yield
        finally:
            deepspeed.runtime.engine.MoE = found

    def adopt_engine(self, engine) -> None:
        if type(engine) is not PipelineEngine:
            raise RuntimeError(f"expert_parallel runs on DeepSpeed's pipeline engine, not {type(engine).__name__}")
        if not engine.has_moe_layers:
            raise RuntimeError("DeepSpeed's engine was built without its MoE paths: the experts would be reduced wrong")
        engine.__class__ = ExpertParallelEngine
        engine.expert_group = engine.module._ep[0]  # the clipping's sum over the experts
        engine._save_engine_file = engine.save_non_zero_checkpoint

    def announce(self, engine, gather) -> list[str]:
        held = sum(p.numel() for p in engine.module.parameters() if hasattr(p, "ep_split"))
        counts = gather("counting this rank's experts", lambda: held)
        moe = moe_spec(engine.module._llama_config)
        return [
            f"experts: {moe.num_experts} per MoE layer over expert_parallel {self.layout.ep} ranks of each stage "
            f"({moe.num_experts // self.layout.ep} per rank; expert parameters per rank "
            f"{', '.join(f'{c / 1e6:.2f} M' for c in counts)})"
        ]
