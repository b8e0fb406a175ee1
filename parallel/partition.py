"""How the specs are split into pipeline stages (the pipeline module is built with that split: parallel/stage.py).

The split is computed here, above ``models/`` (whose ``LlamaPipelineModule`` is given it), so the
``memory`` method can use the planner without ``models/`` importing it. Its searches (``memory``'s, DualPipeV's
mirrored pieces) and :func:`splitter`, the split as the planner (``parallel/memory_plan.py``) asks for it, live
here too: this module imports the planner's formulas, never the other way round.
"""

from __future__ import annotations

import itertools
import re

from transformers import PretrainedConfig

from models.llama_pipe import build_specs, spec_layout, spec_parameter_counts, spec_weights
from models.peft_targets import SAVABLE_MODULES
from parallel.layout import Layout
from parallel.memory_plan import Shape, shape_of, stage_estimate

# How train.py splits specs into stages by default (see stage_boundaries).
DEFAULT_PARTITION_METHOD = "compute"


def stage_boundaries(
    config: PretrainedConfig, num_stages: int, method: str = DEFAULT_PARTITION_METHOD, layout=None
) -> list[int]:
    """First spec of every stage, plus the end: the split ``LlamaPipelineModule`` is built with
    (parallel.stage.build_pipeline_model), also computed without building it (the memory planner).
    ``uniform``, ``parameters`` and ``type:`` are DeepSpeed's own methods on the same weights;
    ``compute`` is ``parameters`` over :func:`spec_weights` (both balanced per rank for DualPipeV's pieces,
    :func:`mirrored_pieces`); ``memory`` balances the planner's
    predicted per-GPU peak for ``layout`` (a ``parallel.layout.Layout``: precision, ZeRO, micro-batch,
    sequence, grad_acc, recomputation, loss chunk), see :func:`memory_boundaries`."""
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    method = method.lower()
    if method == "uniform":
        parts = partition_uniform(num_items=len(spec_layout(config)), num_parts=num_stages)
    elif method.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)  # DeepSpeed's _find_layer_type
        weights = [int(bool(pattern.search(spec.typename.__name__))) for spec in build_specs(config)]
        parts = partition_balanced(weights=weights, num_parts=num_stages)
    elif method == "memory":
        if layout is None or layout.pieces != num_stages:
            raise ValueError("partition_method 'memory' needs the run's layout with the same number of pieces")
        parts = memory_boundaries(config, layout)
    elif layout is not None and layout.schedule == "dualpipev" and num_stages == layout.pieces:
        parts = mirrored_pieces(spec_weights(config, method), layout.stages)
    else:
        parts = partition_balanced(weights=spec_weights(config, method), num_parts=num_stages)
    return [int(p) for p in parts]  # DeepSpeed returns numpy integers


def mirrored_pieces(weights: list[int], stages: int) -> list[int]:
    """DualPipeV's split of specs weighing ``weights`` into 2 x ``stages`` pieces, rank r holding piece r and
    piece 2 x stages - 1 - r: balanced per rank, each rank's two pieces summed (what it computes per step; even
    pieces put the embedding's and the LM head's pieces together on rank 0, the heaviest rank), ties broken
    by the most even pieces. A local search from DeepSpeed's per-piece split moves one boundary at a time while
    the ranks' loads, then the pieces', sorted largest first, get smaller."""
    from deepspeed.runtime.utils import partition_balanced

    pieces = 2 * stages
    total = list(itertools.accumulate(weights, initial=0))
    parts = [int(p) for p in partition_balanced(weights=weights, num_parts=pieces)]

    def key(bounds: list[int]) -> tuple:
        piece = [total[bounds[i + 1]] - total[bounds[i]] for i in range(pieces)]
        ranks = [piece[r] + piece[pieces - 1 - r] for r in range(stages)]
        return sorted(ranks, reverse=True), sorted(piece, reverse=True)

    return improve_boundaries(parts, key)


def splitter(config, total: float | None, method: str | None = None):
    """layout -> (parameters per piece, decoder layers per piece), split as train.py's
    ``partition_method`` splits (:func:`stage_boundaries`, which ``memory`` takes to
    :func:`memory_boundaries`; ``method`` None: its default); a bare count (``config`` None, ``total``
    parameters) splits evenly. A piece per stage, two per rank with DualPipeV (``Layout.pieces``). The
    ``split`` of ``fitting``."""
    if config is None:
        even = lambda layout: ([total / layout.pieces] * layout.pieces, None)  # noqa: E731
        even.work = lambda layout: None
        return even
    if method is None:
        method = DEFAULT_PARTITION_METHOD
    counts, kinds = spec_parameter_counts(config), [info.kind for info in spec_layout(config)]
    compute = spec_weights(config, "compute")
    layer = max(w for w, kind in zip(compute, kinds) if kind == "decoder")
    known: dict = {}  # the split of every stage count seen (of every layout, for ``memory``): the fit search asks often

    def boundaries(layout: Layout) -> list[int]:
        # DualPipeV's compute and parameters splits balance ranks, not pieces: the schedule is part of the key
        key = layout if method.lower() == "memory" else (layout.schedule, layout.pieces)
        if key not in known:
            known[key] = stage_boundaries(config, layout.pieces, method, layout)
        return known[key]

    def split(layout: Layout):
        parts = boundaries(layout)
        params = [float(sum(counts[parts[p] : parts[p + 1]])) for p in range(layout.pieces)]
        layers = [kinds[parts[p] : parts[p + 1]].count("decoder") for p in range(layout.pieces)]
        return params, layers

    def work(layout: Layout) -> list[float]:
        """Each piece's compute per token in decoder layers (the LM head counts by its matmul): the bubble's input."""
        parts = boundaries(layout)
        return [sum(compute[parts[p] : parts[p + 1]]) / layer for p in range(layout.pieces)]

    split.work = work
    return split


def memory_boundaries(config, layout: Layout) -> list[int]:
    """First spec of every stage, plus the end, for ``partition_method=memory``: of the contiguous splits
    whose largest predicted per-GPU peak (``parallel.memory_plan.stage_estimate``, the planner's own function, with the
    stage's position: in-flight micro-batches, the last stage's loss buffer) is smallest, the one whose
    smallest peak is largest. Exact: two dynamic programs over (stage, first spec of the next stage);
    every stage gets at least one spec. DualPipeV: ``layout.pieces`` + 1 boundaries from
    :func:`dualpipev_memory_boundaries`."""
    counts, kinds = spec_parameter_counts(config), [info.kind for info in spec_layout(config)]
    n, k, shape, total = len(counts), layout.stages, shape_of(config), float(sum(counts))
    params = list(itertools.accumulate(counts, initial=0))
    decoders = list(itertools.accumulate((kind == "decoder" for kind in kinds), initial=0))
    if layout.schedule == "dualpipev":
        return dualpipev_memory_boundaries(params, decoders, layout, shape)
    cost = {  # (stage p, first spec a, end b) -> peak of stage p holding specs a..b-1
        (p, a, b): stage_estimate(p, params[b] - params[a], decoders[b] - decoders[a], layout, shape, total).total
        for p in range(k)
        for b in range(p + 1, n - (k - 1 - p) + 1)
        for a in (range(p, b) if p else (0,))
    }

    def solve(combine, better, allowed) -> tuple[float, list[int]]:
        """best[p][b]: the best value of stages 0..p holding specs 0..b-1; start[p][b]: stage p's first spec."""
        best, start = [dict() for _ in range(k)], [dict() for _ in range(k)]
        for (p, a, b), c in cost.items():
            if p == 0 and allowed(c):
                best[0][b] = c
        for p in range(1, k):
            for (q, a, b), c in cost.items():
                if q == p and a in best[p - 1] and allowed(c):
                    value = combine(best[p - 1][a], c)
                    if b not in best[p] or better(value, best[p][b]):
                        best[p][b], start[p][b] = value, a
        parts, b = [n], n
        for p in range(k - 1, 0, -1):
            b = start[p][b]
            parts.append(b)
        return best[k - 1][n], [0, *reversed(parts)]

    smallest_max, _ = solve(max, lambda x, y: x < y, lambda c: True)
    _, parts = solve(min, lambda x, y: x > y, lambda c: c <= smallest_max * (1 + 1e-12))
    return parts


def dualpipev_memory_boundaries(
    params: list[float], decoders: list[int], layout: Layout, shape: Shape | None
) -> list[int]:
    """``partition_method=memory`` for DualPipeV: first spec of each of the 2 x stages pieces, plus the end,
    balancing each rank's predicted peak (``parallel.memory_plan.stage_estimate`` of its two pieces). ``params``,
    ``decoders``: cumulative parameters and decoder layers over the specs. A rank's peak couples two pieces far
    apart, so no dynamic program over one boundary at a time is exact: a local search instead, from equal decoder
    layers per piece, moving one boundary at a time to wherever between its neighbours the ranks' peaks,
    sorted largest first, are smallest (lexicographically, so ties at the top still move), until none moves."""
    n, pieces, total = len(params) - 1, layout.pieces, params[-1]
    layers = decoders[-1]
    parts = [0] + [decoders.index(round(i * layers / pieces)) for i in range(1, pieces)] + [n]
    for i in range(1, pieces):  # every piece at least one spec
        parts[i] = min(max(parts[i], parts[i - 1] + 1), n - (pieces - i))
    peaks: dict[tuple, float] = {}

    def peak(rank: int, bounds: list[int]) -> float:
        (a, b), (c, d) = [(bounds[p], bounds[p + 1]) for p in layout.rank_pieces(rank)]
        if (rank, a, b, c, d) not in peaks:
            psi = params[b] - params[a] + params[d] - params[c]
            held = [decoders[b] - decoders[a], decoders[d] - decoders[c]]
            peaks[rank, a, b, c, d] = stage_estimate(rank, psi, held, layout, shape, total).total
        return peaks[rank, a, b, c, d]

    return improve_boundaries(
        parts, lambda bounds: tuple(sorted((peak(r, bounds) for r in range(layout.stages)), reverse=True))
    )


def improve_boundaries(parts: list[int], key) -> list[int]:
    """Boundaries ``parts`` (first spec of each piece, plus the end) moved one at a time, each to wherever
    between its neighbours ``key(boundaries)`` is smallest, until no move lowers it; every piece keeps a spec.
    DualPipeV's splits: a rank's two pieces lie far apart, so no dynamic program over one boundary at a time
    applies."""
    best, moved = key(parts), True
    while moved:
        moved = False
        for i in range(1, len(parts) - 1):
            for at in range(parts[i - 1] + 1, parts[i + 1]):
                trial = parts[:i] + [at] + parts[i + 1 :]
                if key(trial) < best:
                    parts, best, moved = trial, key(trial), True
    return parts


def frozen_stage_problems(cfg, model_config, layout) -> list[str]:
    """A pipeline stage with nothing to train (only the frozen embedding, norm or LM head) has no optimizer
    group, which DeepSpeed's optimizers refuse: named here, with the knobs that move its boundaries."""
    kinds = [info.kind for info in spec_layout(model_config)]
    trained = {"decoder"} | {SAVABLE_MODULES[m] for m in cfg.peft.modules_to_save}
    bounds = stage_boundaries(model_config, layout.pieces, cfg.partition_method, layout)
    held = {s: [kinds[bounds[p] : bounds[p + 1]] for p in layout.rank_pieces(s)] for s in range(layout.stages)}
    empty = [s for s, pieces in held.items() if not trained & {kind for piece in pieces for kind in piece}]
    if not empty:
        return []
    return [
        f"with peft.method=lora, stage(s) {empty} of partition_method={cfg.partition_method} (specs "
        + ", ".join(f"{bounds[p]}..{bounds[p + 1] - 1}" for s in empty for p in layout.rank_pieces(s))
        + ") hold no decoder layer, hence nothing to train: "
        + "".join(f"use partition_method={m}, " for m in ("compute", "uniform") if m != cfg.partition_method)
        + "fewer num_stages, or train that module fully (peft.modules_to_save)"
    ]
