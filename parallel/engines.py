"""The two DeepSpeed engines a layout runs on, as two objects with one interface: the pipeline engine (any
``num_stages`` with ZeRO 0/1, and every ``num_stages`` > 1) and the data-parallel engine (``num_stages=1`` with
ZeRO 2/3). Everything that differs between the two is here, so no other module asks which one a run uses:
``Layout.engine`` gives the object and callers ask it what they need.

The interface (``ds_engine``: what ``deepspeed.initialize`` returned for the run):

- ``needs_pipeline(what, ds_config)``: the problem of running ``what``, a feature only the pipeline engine runs;
- ``pipeline_only(problem)``: the same, where the feature says it in its own words (LoRA, compile);
- ``runs_instructions``: whether a step runs as pipe instructions, which the straggler clock times per rank;
- ``weight_copies``: how many copies of the weights a checkpoint holds (its size, checked before start);
- ``build_model(build_stage, config, ds_config, **stack_args)``: this rank's model, before ``deepspeed.initialize``;
- ``counts_labels(ds_engine)``: whether this rank counts its micro-batches' label tokens (each micro-batch once);
- ``train_batch(ds_engine, micro_batches, loss_fn)``: one optimizer step, its loss averaged over all ranks;
- ``eval_batch(ds_engine, micro_batches, count, loss_fn)``: ``count`` micro-batches forward only, the mean loss;
- ``write_layer_files(ds_engine, config, tag_dir)``: after DeepSpeed's save, the layer files it did not write.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator

import deepspeed
import torch
import torch.distributed as dist

from models.files.pipeline_dir import local_modules
from models.files.zero3_load import build_partitioned_stack, builds_partitioned
from models.llama_pipe import LlamaStack, layer_file_name


class PipelineEngine:
    """DeepSpeed's ``PipelineEngine``: stages, micro-batches through the schedule, ZeRO 0/1."""

    name = "pipeline engine"
    # Load, forward, backward, optimizer step: instructions of the schedule (training/observation/straggler.py).
    runs_instructions = True
    # save_checkpoint writes the weights once, as one layer file per spec.
    weight_copies = 1

    def __init__(self, layout):
        self.layout = layout

    def needs_pipeline(self, what: str, ds_config: str | None = None) -> list[str]:
        """The problem of running ``what`` (a feature only the pipeline engine runs) on this engine: none here."""
        return []

    def pipeline_only(self, problem: str) -> list[str]:
        """``problem``, a feature's own words for not running on the data-parallel engine: none here."""
        return []

    def build_model(self, build_stage: Callable[[], torch.nn.Module], config, ds_config: dict, **stack_args):
        """``build_stage()``: this rank's pipeline stage (parallel.stage.build_pipeline_model, which the layout's
        module cannot import), only its own layers built."""
        return build_stage()

    def counts_labels(self, ds_engine) -> bool:
        """Of the ranks holding the labels (the last stage; the first with DualPipeV), the first of its
        tensor-parallel and sequence-parallel peers, which hold the same micro-batch (``Layout.counts_labels``)."""
        grid = ds_engine.grid
        return self.layout.counts_labels(
            ds_engine.stage_id, grid.get_data_parallel_rank(), grid.get_slice_parallel_rank()
        )

    def train_batch(self, ds_engine, micro_batches: Iterator | None, loss_fn) -> float:
        """DeepSpeed's ``train_batch``: the schedule reads the step's micro-batches (``micro_batches``: None on a
        stage that reads none), the last stage applies ``loss_fn`` (the model's own), and the loss comes averaged
        over the data axis and broadcast to every stage."""
        return ds_engine.train_batch(data_iter=micro_batches).item()

    def eval_batch(self, ds_engine, micro_batches: Iterator | None, count: int, loss_fn) -> float:
        """DeepSpeed's ``eval_batch`` of ``count`` micro-batches: as :meth:`train_batch`, without gradients."""
        return ds_engine.eval_batch(data_iter=micro_batches, num_micro_batches=count).item()

    def write_layer_files(self, ds_engine, config, tag_dir: str) -> None:
        """Nothing: the pipeline engine's ``save_checkpoint`` wrote the layer files."""

    def __str__(self) -> str:
        return self.name


class DataParallelEngine:
    """DeepSpeed's plain engine: one whole model per data-parallel rank, ZeRO 2/3 (``num_stages=1``)."""

    name = "data-parallel engine"
    # A step is the step's own forward, backward and step calls, the gradient reduction inside backward.
    runs_instructions = False
    # save_checkpoint writes the module's weights in its engine file; write_layer_files writes them again.
    weight_copies = 2

    def __init__(self, layout):
        self.layout = layout

    def needs_pipeline(self, what: str, ds_config: str | None = None) -> list[str]:
        """``what`` runs on the pipeline engine only: the problem, with the knob that gives it."""
        ds_config = ds_config if ds_config is not None else f"zero{self.layout.zero}"
        return self.pipeline_only(
            f"{what} runs on the pipeline engine; num_stages=1 with ds={ds_config} (ZeRO {self.layout.zero}) uses "
            "DeepSpeed's data-parallel engine: use ds=zero0 or ds=zero1"
        )

    def pipeline_only(self, problem: str) -> list[str]:
        """``problem``, a feature's own words for not running on this engine."""
        return [problem]

    def build_model(self, build_stage: Callable[[], torch.nn.Module], config, ds_config: dict, **stack_args):
        """Every spec in one module (``LlamaStack(config, **stack_args)``), the same layers as the pipeline's; under
        ZeRO-3 (``ds_config``: the run's filled DeepSpeed config) built partitioned (``deepspeed.zero.Init``,
        models/files/zero3_load.py), no rank ever holding the whole model. ``build_stage`` is not called."""
        if builds_partitioned(ds_config):
            return build_partitioned_stack(config, ds_config, **stack_args)
        return LlamaStack(config, **stack_args)

    def counts_labels(self, ds_engine) -> bool:
        """Every rank: each holds the whole model and reads micro-batches of its own."""
        return True

    def train_batch(self, ds_engine, micro_batches: Iterator, loss_fn) -> float:
        """The step's micro-batches (gradient_accumulation_steps of them) forward, through ``loss_fn`` and backward;
        DeepSpeed applies the optimizer at the last. The loss: the mean over micro-batches and ranks."""
        losses = []
        for (input_ids, position_ids), labels in itertools.islice(
            micro_batches, ds_engine.gradient_accumulation_steps()
        ):
            loss = loss_fn(ds_engine(input_ids, position_ids), labels)
            ds_engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps
            ds_engine.step()  # applies the optimizer at the accumulation boundary only
            losses.append(loss.detach())
        return mean_over_ranks(torch.stack(losses).mean())

    def eval_batch(self, ds_engine, micro_batches: Iterator, count: int, loss_fn) -> float:
        """``count`` micro-batches forward through ``loss_fn``, in eval mode and without gradients; the loss: the
        mean over micro-batches and ranks."""
        ds_engine.eval()
        with torch.no_grad():
            batches = itertools.islice(micro_batches, count)
            losses = [loss_fn(ds_engine(ids, pos), labels) for (ids, pos), labels in batches]
        ds_engine.train()
        return mean_over_ranks(torch.stack(losses).mean())

    def write_layer_files(self, ds_engine, config, tag_dir: str) -> None:
        """Collective: the pipeline's per-spec layer files, written by rank 0 through the engine's checkpoint engine
        (``save_async``: its host copy), so the checkpoint exports with ``convert2ckpt.py --to-hf`` and loads as
        ``model_name_or_path`` like one the pipeline engine saved. Under ZeRO-3 each module's parameters are
        gathered first (a no-op for ZeRO 0-2)."""
        ckpt = ds_engine.checkpoint_engine
        clone = ckpt.preserves_storage_sharing()  # save_async's host copy copies them anyway
        for index, m in local_modules(ds_engine.module):
            with deepspeed.zero.GatheredParameters(list(m.parameters()), modifier_rank=None):
                if dist.get_rank() == 0:
                    # cloned: a parameter may be a view of a flat buffer, which torch.save would write whole
                    state = {k: v.detach().clone() if clone else v for k, v in m.state_dict().items()}
                    ckpt.save(state, os.path.join(tag_dir, layer_file_name(index)))

    def __str__(self) -> str:
        return self.name


def mean_over_ranks(value: torch.Tensor) -> float:
    """The mean of a scalar over all ranks (data-parallel engine: every rank is a replica)."""
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def engine_for(layout) -> PipelineEngine | DataParallelEngine:
    """The engine ``layout`` runs on: the data-parallel engine for one stage with ZeRO 2/3, else the pipeline's."""
    return DataParallelEngine(layout) if layout.stages == 1 and layout.zero >= 2 else PipelineEngine(layout)
