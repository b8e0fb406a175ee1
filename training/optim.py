"""DeepSpeed JSON filling, AdamW parameter groups and the learning-rate schedule."""

from __future__ import annotations

import contextlib
import copy
import math
import os
import re

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.git_version_info import installed_ops
from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
from torch import nn

from models.files.pipeline_dir import full_shape
from models.llama_pipe import model_parameters
from parallel.memory_plan import reduce_bucket_elements
from parallel.stage import axis_plans
from training.configuration.ds_json import accelerator_name
from training.configuration.schema import Resolved, TrainConfig
from training.observation.logs import log0

# DeepSpeed prints its own step line every steps_per_print steps; train.py logs its own line instead.
DS_STEPS_PER_PRINT = 2**31 - 1


def fill_ds_config(resolved: Resolved) -> dict:
    """The user's DeepSpeed JSON with every key the Hydra config owns filled in from it.

    Batch sizes, clipping, precision and the optimizer come from Hydra, never from the JSON
    (validation already refused JSON values that contradict it).
    """
    cfg = resolved.cfg
    ds = copy.deepcopy(resolved.ds_json)
    ds["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size
    ds["gradient_accumulation_steps"] = cfg.gradient_accumulation_steps
    ds["train_batch_size"] = resolved.layout.ds_train_batch  # the global batch x sequence_parallel
    # Written even when 0: DeepSpeed 0.19.8 clips at 1.0 when the key is absent.
    ds["gradient_clipping"] = cfg.optim.max_grad_norm
    for plan in axis_plans(resolved.layout):
        plan.ds_config_(ds)  # tensor parallelism: the stages' tensors sent whole (its "pipeline" keys)
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": cfg.precision == "bf16"}
    ds["fp16"] = {**ds.get("fp16", {}), "enabled": cfg.precision == "fp16"}
    offload = resolved.layout.offload_optimizer
    torch_fused = cfg.adamw_impl == "torch_fused" and not offload
    ds["optimizer"] = {
        "type": "AdamW",
        "params": {
            "lr": cfg.optim.lr,
            "betas": list(cfg.optim.betas),
            "eps": cfg.optim.eps,
            "weight_decay": cfg.optim.weight_decay,
            # adamw_impl=torch_fused: torch.optim.AdamW, no JIT-compiled fused_adam op to build. Otherwise
            # DeepSpeed picks: its FusedAdam (adamw_impl=deepspeed), or with optimizer offload its CPU Adam,
            # the one that works there.
            "torch_adam": torch_fused,
            # torch's fused kernel (CPU and GPU): 10x faster than its default per-tensor loop on
            # ZeRO's flat fp32 partition (0.19 -> 0.018 s per step, 34 M parameters, one CPU thread).
            **({"fused": True} if torch_fused else {}),
        },
    }
    monitor_dir = os.path.join(os.path.abspath(cfg.output_dir), "monitor")
    if cfg.monitor.tensorboard:
        ds["tensorboard"] = {"enabled": True, "output_path": monitor_dir, "job_name": "tensorboard"}
    if cfg.monitor.csv:
        ds["csv_monitor"] = {"enabled": True, "output_path": monitor_dir, "job_name": "csv"}
    size_zero_buckets(ds, resolved.model_config)
    zero1_settings(ds, accelerator_name(), resolved.layout.data_axis)
    ds.setdefault("steps_per_print", DS_STEPS_PER_PRINT)
    ds.setdefault("wall_clock_breakdown", False)
    return ds


def adamw_problems(adamw_impl: str, accelerator: str | None = None) -> list[str]:
    """Why ``adamw_impl=deepspeed`` (DeepSpeed's FusedAdam) cannot run here, before any process group: on a CUDA
    machine its op is JIT-built at start unless DeepSpeed was installed with it, which needs the CUDA toolkit
    (torch finds no CUDA_HOME: no nvcc). On CPU DeepSpeed builds its C++ FusedAdam (about a minute on 2 cores,
    once per virtualenv), which matched torch's fused AdamW to 7e-7 over 5 fp32 steps. ``accelerator``: DeepSpeed's
    (training.configuration.ds_json.accelerator_name) unless given."""
    if adamw_impl != "deepspeed" or (accelerator or accelerator_name()) != "cuda":
        return []
    from torch.utils.cpp_extension import CUDA_HOME  # imports setuptools: only where it is asked

    if installed_ops.get("fused_adam") or CUDA_HOME is not None:
        return []
    return [
        "adamw_impl=deepspeed JIT-builds DeepSpeed's fused_adam CUDA op at start, which needs the CUDA toolkit (nvcc), "
        "and torch finds none (CUDA_HOME unset, no nvcc on PATH): install it and set CUDA_HOME, install DeepSpeed "
        "with DS_BUILD_FUSED_ADAM=1, or set adamw_impl=torch_fused (torch's fused AdamW)"
    ]


def deepspeed_arch_list(value: str | None) -> str | None:
    """``TORCH_CUDA_ARCH_LIST`` as DeepSpeed 0.19.8's JIT builder can read it, or None where it reads it as it is.
    Its builder parses each architecture as integers (``int('0a')`` raises): an arch-specific suffix (``9.0a``,
    ``10.0f``, which GPU images set for Hopper and Blackwell kernels) is dropped, as FusedAdam uses none of
    those instructions; ``+PTX`` stays."""
    if not value:
        return None
    parts = [p for p in value.replace(" ", ";").split(";") if p]
    plain = [re.sub(r"^(\d+)\.(\d+)[a-z]+", r"\1.\2", p) for p in parts]
    return ";".join(dict.fromkeys(plain)) if plain != parts else None


@contextlib.contextmanager
def readable_arch_list(adamw_impl: str):
    """While the engine is built: with adamw_impl=deepspeed, TORCH_CUDA_ARCH_LIST without the suffixes DeepSpeed's
    JIT build of fused_adam cannot read (:func:`deepspeed_arch_list`), said once; restored afterwards."""
    value = os.environ.get("TORCH_CUDA_ARCH_LIST")
    readable = deepspeed_arch_list(value) if adamw_impl == "deepspeed" and accelerator_name() == "cuda" else None
    if readable is None:
        yield
        return
    log0(
        f"adamw_impl=deepspeed: TORCH_CUDA_ARCH_LIST={value!r} read as {readable!r} while DeepSpeed builds its "
        "fused_adam op (its JIT builder reads no architecture suffix)"
    )
    os.environ["TORCH_CUDA_ARCH_LIST"] = readable
    try:
        yield
    finally:
        os.environ["TORCH_CUDA_ARCH_LIST"] = value


def size_zero_buckets(ds: dict, model_config) -> None:
    """ZeRO-2/3's gradient reduce bucket capped at the model's size, where the JSON leaves it out or
    says "auto".

    DeepSpeed allocates the whole bucket (default 5e8 elements: 954 MiB per rank in bf16, measured by
    the model-state census on a 3.5 M-parameter model). A bucket larger than the model holds nothing
    more; a smaller one means more collectives (hidden^2, Hugging Face's "auto", made ZeRO-2 steps of
    that model 4x slower on CPU gloo).
    """
    zero = ds.get("zero_optimization", {})
    if zero.get("stage", 0) >= 2 and zero.get("reduce_bucket_size", "auto") == "auto":
        zero["reduce_bucket_size"] = reduce_bucket_elements(model_parameters(model_config))


def zero1_settings(ds: dict, accelerator: str, data_axis: int) -> None:
    """ZeRO-1 without reduce-scatter and without the contiguous gradient buffer, where the JSON does not set them, on
    the CPU accelerator and wherever ZeRO's data axis is one rank.

    Both are DeepSpeed's defaults for GPUs: reduce-scatter (a ``reduce`` per partition) sends each
    rank only its own gradients over NCCL, and the contiguous buffer keeps GPU memory from
    fragmenting. Over gloo on CPU neither saves anything, and the buffer is allocated anew every
    step and every gradient copied into it: with a 34 M-parameter model at data parallel 2, steps
    took 1-15% less time without them in four paired runs (3.27 -> 3.16, 3.66 -> 3.36, 3.10 -> 3.08,
    3.38 -> 2.86 s), with the same losses and gradient norms to the last digit, and 110 MiB less peak
    RSS per rank (BENCHMARKS.md). Over one rank there is nothing to scatter and the buffer is a copy of every
    gradient each step; without it the reduction is the one :func:`no_reduction_over_one_rank` skips.
    """
    zero = ds.get("zero_optimization", {})
    if (accelerator == "cpu" or data_axis == 1) and zero.get("stage", 0) == 1:
        zero.setdefault("reduce_scatter", False)
        zero.setdefault("contiguous_gradients", False)


def no_reduction_over_one_rank(optimizer) -> None:
    """ZeRO-1/2's gradient all-reduce skipped where its data-parallel group is one rank: the sum over one rank is the
    gradients themselves, and DeepSpeed 0.19.8 still copies them into a flat buffer, all-reduces it, divides it by 1
    and copies it back, every step (a pipeline stage with data parallelism 1, one GPU). Only a bucket it would hand
    back unchanged is skipped: gradients in the communication dtype (a cast to it would round them), no overlap stream,
    no output buffer, no sequence-parallel division; any other call, and a group of more ranks, goes to DeepSpeed's."""
    from deepspeed import comm as dist
    from deepspeed.runtime.zero import stage_1_and_2
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return
    reduce = optimizer.allreduce_and_copy

    def allreduce_and_copy(small_bucket, communication_data_type, rank=None, process_group=None, **kwargs):
        group = optimizer.dp_process_group if process_group is None else process_group
        unchanged = (
            dist.get_world_size(group=group) == 1
            and rank in (None, 0)
            and not optimizer.overlap_comm
            and optimizer.sequence_parallel_size == 1
            and not stage_1_and_2.pg_correctness_test
            and all(o is None for o in kwargs.get("output_bucket") or ())
            and all(t.dtype == communication_data_type for t in small_bucket)
        )
        if not unchanged:
            reduce(small_bucket, communication_data_type, rank=rank, process_group=process_group, **kwargs)

    optimizer.allreduce_and_copy = allreduce_and_copy


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay on matrices (projections, embeddings), none on 1-D tensors (RMSNorm weights).

    ``decay`` marks the group (ZeRO flattens the parameters, so their shapes cannot tell it later): it is
    saved with the optimizer state, and a resume that changes optim.weight_decay sets only those groups.
    """
    # full_shape: a parameter partitioned at build (ZeRO-3, models/files/zero3_load.py) holds an empty 1-D placeholder.
    decay = [p for p in model.parameters() if p.requires_grad and len(full_shape(p)) >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and len(full_shape(p)) < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay, "decay": True, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "decay": False, "name": "no_decay"},
    ]
    if any(is_moe_param(p) for g in groups for p in g["params"]):
        # Expert parallelism: DeepSpeed's MoE groups (the experts' states partitioned over their own group), made
        # here rather than by its engine so that the order train.py records (optimizer_param_names) is the optimizer's
        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    return [g for g in groups if g["params"]]


def grad_norm_in_one_kernel(optimizer) -> None:
    """ZeRO-1/2's gradient norm of a parameter group from one ``torch._foreach_norm`` over its gradients.

    DeepSpeed 0.19.8's ``get_grad_norm_direct`` loops over the group's gradients in Python, copying each to the norm
    dtype (fp64 on a GPU) and reducing it on its own: two or three kernel launches per parameter and a copy of every
    gradient each step, while the GPU waits for the loop (the plain loop's ``clip_grad_norm_`` makes one foreach
    norm). This is that function's 2-norm with the same filters (ZeRO's padding, parameters a pipeline replicates, the
    model-parallel rank that counts a shared one), the same accumulation dtype and the same reductions; the other
    norms, and an optimizer that is not ZeRO-1/2's, are left as they are.
    """
    from deepspeed import comm as dist
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.runtime.zero.utils import get_norm_dtype

    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return
    loop = optimizer.get_grad_norm_direct

    def get_grad_norm_direct(gradients, params, norm_type=2):
        if float(norm_type) != 2.0:
            return loop(gradients, params, norm_type)
        counted = [
            g
            for g, p in zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params)
            if not getattr(p, PIPE_REPLICATED, False)
            and (is_model_parallel_parameter(p) or optimizer.model_parallel_rank == 0)
        ]
        if counted:
            norms = torch._foreach_norm(counted, 2.0, dtype=get_norm_dtype())  # each [], fp64 on a GPU
            total = torch.stack(norms).pow(2).sum().float()
        else:
            total = torch.tensor(0.0, dtype=torch.float32).to(optimizer.device)
        if dist.get_world_size(group=optimizer.dp_process_group) > 1:  # a sum over one rank: the value itself
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=optimizer.dp_process_group)
        optimizer._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
        total = total.pow(0.5)
        mask_nan_or_inf_with_val_inplace(total, device=optimizer.device)  # -1: DeepSpeed's invalid norm
        return total

    optimizer.get_grad_norm_direct = get_grad_norm_direct


def overflow_check_in_one_kernel(optimizer) -> None:
    """ZeRO-1/2's check for an inf or NaN gradient before the step (bf16's ``check_grad_overflow``, fp16's) from one
    ``torch._foreach_norm`` in fp64 over the gradients.

    DeepSpeed 0.19.8's ``has_overflow_partitioned_grads_serial`` tests each gradient on its own (a max, a min, two
    ``isfinite``, a logical and, a not, an addition: about eight kernel launches per parameter, each gradient read
    twice). A gradient's fp64 2-norm is finite exactly when all its values are: a NaN or an infinity carries through
    the sum of squares, and the largest finite bf16 or fp32 value squared over any tensor's size stays far below
    fp64's limit. The same answer, with one pass over each gradient; without fp64 on the accelerator (DeepSpeed's
    ``get_norm_dtype``), and under optimizer offload, DeepSpeed's own check runs.
    """
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.runtime.zero.utils import get_norm_dtype

    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or get_norm_dtype() != torch.float64:
        return

    def has_overflow_partitioned_grads_serial() -> torch.Tensor:
        grads = [g for i in range(len(optimizer.bit16_groups)) for g in optimizer.averaged_gradients[i]]
        grads = [g for g in grads if g is not None and g.numel()]
        if not grads:
            return torch.zeros([1], dtype=torch.bool, device=get_accelerator().current_device_name())
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float64)  # each [] fp64
        return torch.stack(norms).sum().isfinite().logical_not().reshape(1)  # [1] bool, as DeepSpeed's

    optimizer.has_overflow_partitioned_grads_serial = has_overflow_partitioned_grads_serial


def reduce_grad_norm_once_across_stages(optimizer) -> None:
    """Make ZeRO-1/2's gradient norm cross the pipeline stages in one all-reduce instead of one per
    parameter group.

    DeepSpeed 0.19.8's ``scaled_global_norm`` reduces each group's norm over the stages separately, so
    every stage must hold the same number of groups. A stage holding only the LM head or only the
    embedding has no 1-D parameters, hence no no-decay group (ZeRO refuses an empty one): it finished
    the step while the other stages waited in their second reduction, and the run hung at its first
    optimizer step. Here each stage combines its own groups (data-parallel reductions as DeepSpeed does
    them), then the squared norms and an invalid flag cross the stages once.
    """
    from deepspeed.comm import pg_utils
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or not pg_utils.is_parallel(optimizer.model_parallel_group):
        return
    per_stage = type(optimizer).scaled_global_norm
    across_stages = type(optimizer)._model_parallel_all_reduce

    def scaled_global_norm(norm_type=2):
        optimizer._model_parallel_all_reduce = lambda tensor, op: None  # each group: data-parallel only
        try:
            local = per_stage(optimizer, norm_type)  # inf where a group's norm was inf/NaN
        finally:
            del optimizer._model_parallel_all_reduce  # the class's method again
        invalid = ~torch.isfinite(local) | (local < 0)
        packed = torch.stack([torch.where(invalid, 0.0, local.float() ** norm_type), invalid.float()])  # [2]
        across_stages(optimizer, packed, torch.distributed.ReduceOp.SUM)
        return torch.where(packed[1] > 0, torch.full_like(packed[0], float("inf")), packed[0] ** (1.0 / norm_type))

    optimizer.scaled_global_norm = scaled_global_norm


def apply_optim_settings(engine, cfg: TrainConfig, total_steps: int) -> None:
    """After ``load_checkpoint``: AdamW's hyper-parameters and the learning rate from ``cfg`` instead of
    the checkpoint's, from the next step on.

    DeepSpeed restores the optimizer's param groups (lr, betas, eps, weight decay) and LambdaLR's
    ``base_lrs`` from the checkpoint, while the schedule's shape (the lambda: warm-up, decay, min_lr,
    total steps) is the one built from ``cfg``: without this a changed optim.lr was silently ignored
    while a changed scheduler applied. The step counter stays the checkpoint's.
    """
    scheduler = engine.lr_scheduler
    scheduler.base_lrs = [cfg.optim.lr] * len(scheduler.base_lrs)
    factor = lr_lambda(cfg, total_steps)(scheduler.last_epoch)
    for group in scheduler.optimizer.param_groups:
        # A checkpoint saved before groups were marked: a group decays where it had a weight decay.
        decays = group.get("decay", group["weight_decay"] != 0.0)
        group.update(
            initial_lr=cfg.optim.lr,
            lr=cfg.optim.lr * factor,
            betas=tuple(cfg.optim.betas),
            eps=cfg.optim.eps,
            weight_decay=cfg.optim.weight_decay if decays else 0.0,
        )


def lr_lambda(cfg: TrainConfig, total_steps: int):
    """Multiplier of optim.lr for the optimizer step after ``step`` completed ones (LambdaLR's counter).

    Linear warm-up over ``warmup_steps`` (the first step uses lr / warmup_steps), then constant, or a
    linear or cosine decay that reaches ``min_lr`` at the last step (``total_steps - 1``).
    """
    o = cfg.optim
    warmup, floor = o.warmup_steps, o.min_lr / o.lr if o.lr > 0 else 0.0

    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if o.scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - 1 - warmup))  # 0 after warm-up .. 1 at the end
        decay = 1.0 - progress if o.scheduler == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return floor + (1.0 - floor) * decay

    return factor


def build_lr_scheduler(cfg: TrainConfig, total_steps: int):
    """A callable DeepSpeed accepts as ``lr_scheduler``: it gets the optimizer DeepSpeed built."""
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))
