"""Generation on the ranks of a DeepSpeed pipeline, each rank running only its own stage (models/generation.py's
:class:`StageGenerator` over the ``PipelineModule``'s local modules), each data-parallel replica its own prompts.

Every rank of a pipeline calls :func:`generate_on_stages` with the same arguments; each rank derives the padded
prompts, the attention mask and the positions of every step from the prompt lengths alone. The rows run in
``micro_batches`` chunks (models/generation.py's ``Batch``: row slices of the padded batch, each with its own KV cache
on each stage), several in flight so that every stage works. The schedule, which every rank computes alike from what
it has received (so all agree by construction), runs in ticks; at tick ``t``:

    stage 0 starts the chunk whose turn it is (round robin over the chunks not done, in row order) once that
    chunk's previous tokens are in; if they are not, it idles (a bubble: fewer chunks than stages, or some done);
    stage k runs what stage 0 started at tick ``t - k``; the last stage's chunk has its tokens picked at once

so the chunks come to the last stage step by step, in row order within a step (sampling's draw order: models/
generation.py's ``TokenPicker``), and with as many chunks as stages no stage waits. What crosses, in the ranks of
this rank's pipeline only (DeepSpeed's grid: ``stage_to_global`` and the pipe group), per tick and rank in this order:

    recv     stage k-1 -> k   hidden [b,S,H] of the chunk's prefill (S the padded prompt length) or [b,1,H] of a
                              decode step (from the stage holding the final norm on: [b,1,H]); b the chunk's rows
    broadcast  last -> all    if the last stage ran a chunk: its next tokens [b] int64, over the pipe group; every
                              rank keeps them (the first stage feeds them next; each knows which rows have finished)
    send     stage k -> k+1   what this stage computed this tick

Blocking ``send``/``recv`` pair across ticks (sent at the end of tick ``t``, received at the start of ``t + 1``), and
every rank makes the same broadcasts in the same order, so gloo's blocking calls cannot deadlock. The hidden states
travel in the stages' weight dtype. The last stage picks the tokens, so a sampling ``generator`` is used there only
(a seeded one on the other ranks is left untouched).

With tensor parallelism inside the stages (the topology's model axis), each TP rank index makes its own pipeline:
DeepSpeed's pipe groups and ``stage_to_global`` keep this rank's model coordinate, so TP rank i of stage k sends its
hidden states (replicated within the group) to TP rank i of stage k+1 and broadcasts tokens over its own pipe group.
Every rank of a stage's TP group runs the same step on the same inputs (models/generation.py's ``StageGenerator``
given the group: the layers all-reduce inside, the head's vocabulary slices are gathered), and each TP rank of the
last stage picks the tokens from the same whole logits with its own generator: the caller seeds them alike, so
every TP rank draws the same noise and the completions do not depend on tp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.module import PipelineModule

from models.files.pipeline_dir import stage_pieces
from models.generation import (
    Batch,
    Completion,
    StageGenerator,
    TokenPicker,
    generation_problems,
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
    lines = stage_problems(stage_modules(model), tensor_parallel=tp_group(model) is not None)
    return [f"generate_on_stages: stage {model.stage_id}: {line}" for line in lines]


def tp_group(model: PipelineModule):
    """This rank's tensor-parallel group (the topology's model axis), None without one."""
    grid = model._grid
    return grid.get_slice_parallel_group() if grid.get_slice_parallel_world_size() > 1 else None


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
    micro_batches: int


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
    micro_batches: int | None = None,
) -> list[Completion]:
    """The completions of ``prompt_ids`` that models.generation.generate makes with the same arguments, returned on
    every rank of this rank's pipeline; each rank of the pipeline calls it with the same ``prompt_ids`` (those of
    its data-parallel replica) and arguments. ``generator``: the last stage's (the one that samples; with tensor
    parallelism each TP rank's there, seeded alike; module docstring). ``micro_batches``: how many chunks of rows
    are in flight (None: the number of stages; capped at the batch size); the completions are the same for any. The
    modules run in the mode they are in. Problems on any rank of the pipeline (and of its TP peers) are raised on all
    of them, together.
    """
    chunks = model.num_stages if micro_batches is None else micro_batches
    request = Request(
        prompt_ids, max_new_tokens, eos_token_id, do_sample, temperature, top_p, top_k, pad_token_id, chunks
    )
    problems = pipeline_problems(model)
    unit = StageGenerator(stage_modules(model), tp_group(model)) if not problems else None
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
    if tp_group(model) is not None:  # the tensor-parallel peers' (other pipelines') problems and requests too
        peers: list = [None] * model._grid.get_slice_parallel_world_size()
        dist.all_gather_object(peers, (problems, request), group=tp_group(model))
        problems = list(dict.fromkeys(line for lines, _ in peers for line in lines))
        if any(other != request for _, other in peers):
            problems.append("generate_on_stages: the tensor-parallel peers were called with other prompts or arguments")
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
        first.prompt_ids, first.max_new_tokens, first.temperature, first.top_p, first.top_k, first.micro_batches
    )


def _generate(
    model: PipelineModule, unit: StageGenerator, request: Request, generator: torch.Generator | None
) -> list[Completion]:
    """models.generation.generate's loop, this rank's stage only, the chunks in flight and the hidden states and
    tokens sent as the module docstring's schedule says."""
    stage, last, grid = model.stage_id, model.num_stages - 1, model._grid
    previous = grid.stage_to_global(stage - 1) if stage > 0 else None
    following = grid.stage_to_global(stage + 1) if stage < last else None
    sampler, group = grid.stage_to_global(last), grid.get_pipe_parallel_group()
    device, dtype, hidden_size = unit.device, weight_dtype(unit), model._llama_config.hidden_size
    batch = Batch(request.prompt_ids, request.eos_token_id, request.pad_token_id, request.micro_batches)
    processors = sampling_processors(request.temperature, request.top_k, request.top_p) if request.do_sample else None
    picker = TokenPicker(processors, generator, batch)  # used on the last stage only
    # The previous stage sends one position once it has applied the final norm: a stage with neither decoder layers
    # nor the norm holds the head alone, right after the norm's stage.
    after_norm = not unit.layers and unit.norm is None
    unit.reset(len(batch.chunks))
    schedule = Schedule(batch.chunks, request.max_new_tokens)
    while schedule.running():
        schedule.tick()
        mine, out = schedule.at(stage), None
        if mine is not None:
            chunk = batch.chunks[mine]
            inputs = chunk.inputs
            if previous is not None:
                width = 1 if after_norm or chunk.step > 0 else batch.width
                inputs = torch.empty(len(chunk.rows), width, hidden_size, dtype=dtype, device=device)
                dist.recv(inputs, src=previous)
            unit.select(mine)
            mask = chunk.mask.to(device) if chunk.mask is not None else None
            out = unit.step(inputs.to(device), mask, chunk.positions.to(device))
        ending = schedule.at(last)
        if ending is not None:
            chunk = batch.chunks[ending]
            tokens = picker(out, chunk) if following is None else torch.empty(len(chunk.rows), dtype=torch.long)
            tokens = tokens.to(device)
            dist.broadcast(tokens, src=sampler, group=group)  # [b] int64: the chunk's next inputs, every rank's
            schedule.land(ending, tokens.cpu())
        if out is not None and following is not None:
            dist.send(out.to(dtype).contiguous(), dst=following)  # the dtype the next stage receives in
    return batch.completions()


class Schedule:
    """The module docstring's ticks over ``chunks`` (models/generation.py's ``Chunk``), kept alike on every rank of
    the pipeline: :meth:`tick` makes stage 0's choice, :meth:`at` tells what a stage runs in the tick,
    :meth:`land` takes a chunk's tokens from the last stage."""

    def __init__(self, chunks: list, max_new_tokens: int):
        self.chunks, self.max_new_tokens = chunks, max_new_tokens
        self.started: list[int | None] = []  # per tick, the chunk stage 0 started (None: it idled)
        self.in_flight: set[int] = set()
        self.turn = 0

    def running(self) -> bool:
        return not all(chunk.done(self.max_new_tokens) for chunk in self.chunks)

    def tick(self) -> None:
        """Stage 0 starts the chunk whose turn it is (the first not done from ``turn`` on, round robin) if its
        previous tokens are in, else idles."""
        count = len(self.chunks)
        turns = (j % count for j in range(self.turn, self.turn + count))
        chosen = next(j for j in turns if not self.chunks[j].done(self.max_new_tokens))
        if chosen in self.in_flight:
            self.started.append(None)
            return
        self.started.append(chosen)
        self.in_flight.add(chosen)
        self.turn = chosen + 1

    def at(self, stage: int) -> int | None:
        """The chunk stage ``stage`` runs in this tick: what stage 0 started ``stage`` ticks ago (None: none)."""
        tick = len(self.started) - 1 - stage
        return self.started[tick] if tick >= 0 else None

    def land(self, chunk: int, tokens) -> None:
        """The chunk's next tokens [b], picked on the last stage in this tick."""
        self.chunks[chunk].take(tokens)
        self.in_flight.discard(chunk)


def weight_dtype(unit: StageGenerator) -> torch.dtype:
    """The dtype of the stage's floating weights: what its hidden states are computed, sent and received in."""
    modules = [m for m in (unit.embedding, *unit.layers, unit.norm) if m is not None]
    params = [p for m in modules for p in m.parameters() if p.is_floating_point()]
    if params:
        return params[0].dtype
    head = unit.head
    return (head.args[0].weight if hasattr(head, "args") else head.weight).dtype
