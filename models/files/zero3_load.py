"""ZeRO-3 without a full model per rank (``num_stages=1``, DeepSpeed's data-parallel engine).

The stack is built under ``deepspeed.zero.Init``: each module's parameters are partitioned as soon as
the module exists, so a rank never holds more than one parameter whole while building. The weights
then go in one tensor at a time, each rank keeping its own slice
(``models.files.pipeline_dir.assign_partitioned``): layer files through ``load_stage_weights``, a from-scratch
start through ``init_partitioned_`` below. Host memory at load is about the rank's partition plus one
layer, instead of the whole model on every rank (what ``deepspeed.initialize`` partitioned before).

ZeRO-2 does not partition parameters and builds the ordinary stack.
"""

from __future__ import annotations

import os

import deepspeed
import torch
from deepspeed.pipe import LayerSpec
from torch import nn
from transformers import PretrainedConfig

from models.families import family_of
from models.files.pipeline_dir import assign_partitioned, is_partitioned
from models.llama_pipe import DecoderLayerPipe, LlamaStack, init_weights_

# Benchmark only (benchmarks/bench_zero3_load.py): "1" builds the whole stack on every rank and lets
# deepspeed.initialize partition it, the load path before zero.Init, to measure against.
FULL_BUILD_ENV = "BENCH_ZERO3_FULL_BUILD"


def builds_partitioned(ds_config: dict) -> bool:
    """Whether the data-parallel stack is built partitioned: ZeRO-3, with its parameter partitions in
    memory (accelerator or host; partitions swapped to NVMe take DeepSpeed's own conversion path)."""
    zero = ds_config.get("zero_optimization") or {}
    if int(zero.get("stage", 0)) != 3:
        return False
    if (zero.get("offload_param") or {}).get("device") == "nvme":
        return False
    return os.environ.get(FULL_BUILD_ENV, "0") in ("", "0")


def build_partitioned_stack(config: PretrainedConfig, ds_config: dict, **stack_args) -> LlamaStack:
    """``LlamaStack(config, **stack_args)`` built under ``deepspeed.zero.Init`` with the run's
    DeepSpeed JSON (``ds_config``: ZeRO-3 settings, parameter offload and the training dtype), so
    every parameter is partitioned over all ranks as it is created, in the training dtype.

    A tied embedding stays one module (and one parameter) used by both ends, as in the plain stack.
    The parameters hold DeepSpeed's construction values until ``load_stage_weights`` or
    ``init_partitioned_`` replaces them.
    """
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        stack = LlamaStack(config, **stack_args)
    keep_fp32_buffers(stack)
    return stack


def keep_fp32_buffers(stack: LlamaStack) -> None:
    """Rebuild the rotary embeddings outside ``zero.Init``, which creates every floating tensor of a
    module's ``__init__`` in the training dtype: under bf16 the rotary ``inv_freq`` came out of a bf16
    ``arange`` (measured: other values, not just another dtype). The engine keeps buffers as they are
    (fp32 before zero.Init), so rotary positions stay exactly those of the unpartitioned model.
    """
    for module in stack.modules():
        if isinstance(module, DecoderLayerPipe):
            config = module.self_attn.config
            module.rotary_emb = family_of(config).rotary_embedding(config)
    lowered = [name for name, b in stack.named_buffers() if b.is_floating_point() and b.dtype != torch.float32]
    if lowered:  # a buffer of another module type: its values would differ from the unpartitioned model's
        raise RuntimeError(f"buffers created in a lower precision under deepspeed.zero.Init: {lowered}")


@torch.no_grad()
def init_partitioned_(module: nn.Module, spec: LayerSpec, config: PretrainedConfig, seed: int) -> None:
    """``init_weights_(module, config, seed)`` for a module built under ``zero.Init``: the same weights.

    Every rank builds the spec's module whole in fp32 (outside zero.Init), initialises it from the
    spec's seed exactly as the unpartitioned path does, and keeps its own partition of each tensor,
    cast to the training dtype as the engine cast the whole model before: one layer whole at a time,
    no communication (each rank computed every layer before, too).
    """
    fresh = spec.build()
    init_weights_(fresh, config, seed=seed)
    targets = module.state_dict(keep_vars=True)
    for key, t in fresh.state_dict().items():
        if is_partitioned(targets[key]):
            assign_partitioned(targets[key], t)
        else:
            targets[key].copy_(t)
    del fresh


def partition_bytes(params: list[nn.Parameter]) -> int:
    """Bytes of the slices this rank holds of ``params`` (ZeRO-3 partitions, padding included)."""
    return sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in params if is_partitioned(p))
