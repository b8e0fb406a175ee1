"""Generation on the ranks of a DeepSpeed pipeline, each rank running only its own stage (models/generation.py's
:class:`StageGenerator` over the ``PipelineModule``'s local modules), each data-parallel replica its own prompts.

Every rank of a pipeline calls :func:`generate_on_stages` with the same arguments; each rank derives the padded
prompts, the attention mask and the positions of every step from the prompt lengths alone. What crosses, in the
ranks of this rank's pipeline only (DeepSpeed's grid: ``stage_to_global`` and the pipe group):

    prefill        stage k -> k+1   ``send``/``recv`` of hidden [B,S,H] (S the padded prompt length), or [B,1,H]
                                    from the stage holding the final norm on
    decode step    stage k -> k+1   ``send``/``recv`` of hidden [B,1,H]
    every step     last -> all      ``broadcast`` over the pipe group of the next tokens [B] int64, which the first
                                    stage feeds next; every rank keeps them, so each knows when every row has
                                    finished and ends with the same completions

The hidden states travel in the stages' weight dtype. The last stage picks the tokens, so a sampling
``generator`` is used there only (a seeded one on the other ranks is left untouched). The schedule runs one batch
at a time: while a stage works on a step the others wait; several micro-batches in flight (as training's schedule
keeps them) is not done yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.module import PipelineModule

from models.files.pipeline_dir import stage_pieces
from models.generation import (
    Completion,
    StageGenerator,
    completions,
    generation_problems,
    left_padded,
    next_positions,
    pick_tokens,
    positions_from_mask,
    sampling_processors,
    stage_problems,
)


def stage_modules(model: PipelineModule) -> list:
    """This rank's stage's modules in spec order (DeepSpeed's ``forward_funcs``: a tied head is a partial)."""
    return list(model.forward_funcs)


def pipeline_problems(model: PipelineModule) -> list[str]:
    """Why this rank's stage cannot generate, one line each (empty: it can)."""
    if len(stage_pieces(model)) > 1:
        return [
            "generate_on_stages: this rank holds two pieces of the model (DualPipeV's layout): generation runs "
            "one stage per rank; set pipeline_schedule to 1f1b"
        ]
    grid = model._grid
    if grid.model_parallel_size > 1:
        return [
            f"generate_on_stages: the topology has a model axis of {grid.model_parallel_size} (tensor "
            "parallelism): generation runs whole modules only; set tensor_parallel to 1"
        ]
    return [f"generate_on_stages: stage {model.stage_id}: {line}" for line in stage_problems(stage_modules(model))]


def chain_problems_of(units_kinds: list[tuple[bool, list[int], bool]], num_layers: int) -> list[str]:
    """Why the pipeline's stages, each told by (embedding?, its decoder layers, head?), do not make the whole spec
    list (the embedding on the first, every decoder layer once in order, the head on the last)."""
    problems = []
    last = len(units_kinds) - 1
    for stage, (embedding, _, head) in enumerate(units_kinds):
        if embedding != (stage == 0):
            problems.append(f"generate_on_stages: stage {stage} {'holds' if embedding else 'lacks'} the embedding")
        if head != (stage == last):
            problems.append(f"generate_on_stages: stage {stage} {'holds' if head else 'lacks'} the LM head")
    layers = [i for _, stage_layers, _ in units_kinds for i in stage_layers]
    if layers != list(range(num_layers)):
        problems.append(
            f"generate_on_stages: the stages hold the decoder layers {layers}, not each of 0..{num_layers - 1} once"
        )
    return problems


@dataclass(frozen=True)
class Request:
    """What every rank of a pipeline must be called with alike (compared across the pipe group)."""

    prompt_ids: list[list[int]]
    max_new_tokens: int
    eos_token_id: int | Sequence[int]
    do_sample: bool
    temperature: float
    top_p: float
    top_k: int
    pad_token_id: int | None


@torch.no_grad()
def generate_on_stages(
    model: PipelineModule,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    eos_token_id: int | Sequence[int],
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    pad_token_id: int | None = None,
) -> list[Completion]:
    """The completions of ``prompt_ids`` that models.generation.generate makes with the same arguments, returned on
    every rank of this rank's pipeline; each rank of the pipeline calls it with the same ``prompt_ids`` (those of
    its data-parallel replica) and arguments. ``generator``: the last stage's (the one that samples; module
    docstring). The modules run in the mode they are in. Problems on any rank of the pipeline are raised on all of
    them, together.
    """
    request = Request(prompt_ids, max_new_tokens, eos_token_id, do_sample, temperature, top_p, top_k, pad_token_id)
    problems = pipeline_problems(model)
    unit = StageGenerator(stage_modules(model)) if not problems else None
    if unit is not None and model.stage_id == model.num_stages - 1 and do_sample and generator is not None:
        if generator.device != unit.device:
            problems.append(
                f"generate_on_stages: the generator is on {generator.device}, the last stage on {unit.device}: "
                "make the generator on the last stage's device"
            )
    gathered: list = [None] * model._grid.pipe_parallel_size
    dist.all_gather_object(
        gathered, (problems, stage_kinds(unit), request), group=model._grid.get_pipe_parallel_group()
    )
    problems = agreed_problems(gathered, model._llama_config.num_hidden_layers)
    if problems:
        raise ValueError("\n".join(problems))
    try:
        return _generate(model, unit, request, generator)
    finally:
        unit.reset()  # the cache is freed with the generation


def stage_kinds(unit: StageGenerator | None) -> tuple[bool, list[int], bool] | None:
    """(holds the embedding, its decoder layers' indices, holds the LM head); None without a unit."""
    if unit is None:
        return None
    return unit.embedding is not None, [layer.self_attn.layer_idx for layer in unit.layers], unit.head is not None


def agreed_problems(gathered: list, num_layers: int) -> list[str]:
    """Every rank's problems, then the chain's and any request that differs from the first stage's, in one list
    that every rank of the pipeline computes alike."""
    problems = list(dict.fromkeys(line for lines, _, _ in gathered for line in lines))  # DualPipeV's: every rank's
    if problems:
        return problems
    problems = chain_problems_of([kinds for _, kinds, _ in gathered], num_layers)
    first: Request = gathered[0][2]
    problems += [
        f"generate_on_stages: stage {s} was called with other prompts or arguments than stage 0"
        for s, (_, _, request) in enumerate(gathered)
        if request != first
    ]
    return problems + generation_problems(
        first.prompt_ids, first.max_new_tokens, first.temperature, first.top_p, first.top_k
    )


def _generate(
    model: PipelineModule, unit: StageGenerator, request: Request, generator: torch.Generator | None
) -> list[Completion]:
    """models.generation.generate's loop, this rank's stage only, the hidden states and tokens sent as the module
    docstring says."""
    stage, last, grid = model.stage_id, model.num_stages - 1, model._grid
    previous = grid.stage_to_global(stage - 1) if stage > 0 else None
    following = grid.stage_to_global(stage + 1) if stage < last else None
    sampler, group = grid.stage_to_global(last), grid.get_pipe_parallel_group()
    device, dtype = unit.device, weight_dtype(unit)
    eos_ids = request.eos_token_id
    eos = torch.tensor([eos_ids] if isinstance(eos_ids, int) else list(eos_ids), dtype=torch.long)
    pad = int(eos[0]) if request.pad_token_id is None else request.pad_token_id
    processors = sampling_processors(request.temperature, request.top_k, request.top_p) if request.do_sample else None
    ids, mask = left_padded(request.prompt_ids, pad)
    positions = positions_from_mask(mask)
    mask = None if bool(mask.all()) else mask  # generate drops a mask without padding
    batch, hidden_size = len(request.prompt_ids), model._llama_config.hidden_size
    # The previous stage sends one position once it has applied the final norm: a stage with neither decoder layers
    # nor the norm holds the head alone, right after the norm's stage.
    after_norm = not unit.layers and unit.norm is None
    unit.reset()
    finished = torch.zeros(batch, dtype=torch.bool)
    tokens = []
    inputs = ids
    for _ in range(request.max_new_tokens):
        if previous is not None:
            width = 1 if after_norm else positions.shape[1]
            inputs = torch.empty(batch, width, hidden_size, dtype=dtype, device=device)
            dist.recv(inputs, src=previous)
        out = unit.step(inputs.to(device), mask.to(device) if mask is not None else None, positions.to(device))
        if following is not None:
            dist.send(out.to(dtype).contiguous(), dst=following)  # the dtype the next stage receives in
            chosen = torch.empty(batch, dtype=torch.long, device=device)
        else:
            chosen = pick_tokens(out, ids, tokens, processors, generator)
            chosen = torch.where(finished.to(device), torch.tensor(pad, device=device), chosen)
        dist.broadcast(chosen, src=sampler, group=group)  # [B] int64: the first stage's next inputs, every rank's
        chosen = chosen.cpu()
        tokens.append(chosen)
        finished |= torch.isin(chosen, eos)
        if bool(finished.all()):
            break
        inputs = chosen[:, None]  # [B,1]: one token per row, the cache holds the rest
        positions = next_positions(positions)  # [B,1]
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=1)
    return completions(torch.stack(tokens, dim=1), eos)


def weight_dtype(unit: StageGenerator) -> torch.dtype:
    """The dtype of the stage's floating weights: what its hidden states are computed, sent and received in."""
    modules = [m for m in (unit.embedding, *unit.layers, unit.norm) if m is not None]
    params = [p for m in modules for p in m.parameters() if p.is_floating_point()]
    if params:
        return params[0].dtype
    head = unit.head
    return (head.args[0].weight if hasattr(head, "args") else head.weight).dtype
