"""Per-GPU memory that GRPO adds on a pipeline stage: the generation batch's KV cache, the last stage's logits and
sampling temporaries, the hidden states that cross between stages, and the frozen reference model (beta > 0).

KV cache. models/generation.py's ``StageGenerator`` keeps a transformers ``DynamicCache(config=...)`` holding only its
own decoder layers' keys and values, [rows, kv_heads, tokens, head_dim] each, in the stage's dtype. A layer holding L
tokens of R rows costs

    2 (key + value) x kv_heads / tp x head_dim x L x R x dtype bytes                        (layer_cache_bytes)

kv_heads, not the query heads: GQA caches k_proj's and v_proj's outputs before they are repeated for the queries;
a MoE layer has the same attention (only its MLP differs). tp must divide kv_heads (the tensor-parallel rule).
Multi-head latent attention (DeepSeek-V3's ``DeepseekV3Attention``) caches its compressed latent, [rows, 1, tokens,
kv_lora_rank], as the key and the shared RoPE key, [rows, 1, tokens, qk_rope_head_dim], as the value, and expands
them to every head's keys and values at each step: (kv_lora_rank + qk_rope_head_dim) elements a token and layer
(576 for DeepSeek-V3, where 128 heads of 192-wide keys and 128-wide values would be 40960). gpt-oss's sink is a key
its attention adds at each step (models/family_gpt_oss.py), not cached.
After a generation whose prompts are left-padded to S tokens and which picked n tokens, every full-attention layer
holds L = S + n - 1 (the last token picked is never fed back); the planner passes seq_len = the prompt budget +
max_completion_length, one token to spare.

Sliding-window and chunked layers (transformers 5.23, cache_utils.py): ``DynamicCache(config=...)`` gives a layer of
type ``sliding_attention`` (window ``config.sliding_window``: Mistral, Mixtral, Qwen2/3 above max_window_layers) or
``chunked_attention`` (Llama 4, window ``attention_chunk_size``) a ``DynamicSlidingWindowLayer``. Its update
concatenates the new keys to those it kept and keeps a view of the last W - 1; the view's storage is the whole
concatenation, so the layer holds min(L, W) tokens once a decode step has run, and the whole prompt, S tokens, from
the prefill until its first decode step. The stage's peak is the larger of the two moments (after the prefill the
full layers only grow and the sliding ones hold min(L, W)): :func:`kv_cache_bytes`, measured against the caches by
tests/test_generation_memory.py.
With the rows in chunks (``generate``'s micro_batches) every chunk is padded to the batch's S and every chunk's
prefill runs before any decode step: the same bytes. Not counted: the layer's concatenation being made in an update
(one layer's keys and values twice, for an instant). The prefill also builds one [R, 1, S, S] bool attention mask per
attention type of the stage (:func:`prefill_mask_bytes`).

Last stage, per step (``StageGenerator.step``, ``generate`` and ``TokenPicker``, rows in chunks of b): the LM head's
[b, V] output in the dtype, its fp32 copy (the same tensor in fp32) and the previous chunk's fp32 logits, still bound
while the next chunk runs; sampling keeps the Exp(1) noise of all R rows, [R, V] fp32, for the whole step (two for an
instant as the next step draws); per [b, V] element, the fp32 logits (4) alive throughout: temperature's output 4;
top-k's mask 1 and output 4; top-p's sorted logits 4, sorted indices 8 (int64), softmax then cumulative sum 4 + 4,
the two masks 1 + 1 and its output 4; the probabilities 4, then their ratio to the noise 4
(:func:`sampling_bytes_per_element`, :func:`logits_bytes`). Greedy: argmax, nothing more. Vocabulary whole:
generation runs whole modules (``stage_problems``).

Between stages, in the prefill: hidden [R, S, H] in the dtype, the one a stage receives and the one it sends
(:func:`hidden_bytes`); a decode step's [R, 1, H] are negligible beside them.

Reference model (TRL's ``beta`` > 0: the KL term's frozen reference): a copy of the stage's weights in the training
precision, on the ranks the trained ones are (1/tp of them, 1/ep of the routed experts), as the planner counts a
frozen base; none under LoRA, where the base without its adapters is the reference (:func:`reference_weight_bytes`).

In the planner (:func:`with_generation`, for a layout with ``Layout.generation``): each data-parallel rank generates
its micro_batch_size x gradient_accumulation_steps rows of a step in one call, prompts of up to
data.max_seq_length - grpo.max_completion_length tokens. The generation and the training step never meet (the cache
is freed before the step), so a stage's estimate holds the larger of the two beside the weights, optimizer states and
reference weights, which are resident in both (``Estimate.total``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from parallel.layout import Layout
from parallel.memory_plan import Estimate, Shape, elem_bytes, frozen_weight_bytes, local_params, stage_estimates


def cache_windows(config) -> tuple[int | None, ...]:
    """Per decoder layer of the model, the window W its ``DynamicCache`` layer keeps (a sliding or chunked layer);
    None: a full-attention layer, which keeps every token. Read from the cache transformers builds for ``config``,
    as ``StageGenerator`` builds it."""
    windows = []
    for i, layer in enumerate(DynamicCache(config=config).layers):
        if isinstance(layer, DynamicSlidingWindowLayer):
            windows.append(layer.sliding_window)
        elif type(layer) is DynamicLayer:
            windows.append(None)
        else:
            raise ValueError(f"layer {i}: a {type(layer).__name__} cache, which the planner does not count")
    return tuple(windows)


def stage_layer_indices(layers_per_stage: Sequence[int], stage: int) -> range:
    """The decoder layer indices of ``stage`` from each stage's decoder layer count (``splitter``'s second list):
    a stage's decoder layers are consecutive."""
    start = sum(layers_per_stage[:stage])
    return range(start, start + layers_per_stage[stage])


def cached_tokens(window: int | None, seq_len: int) -> int:
    """Tokens of one row a cache layer's storage holds once ``seq_len`` tokens were fed, the last by a decode step:
    all of them for a full layer, min(seq_len, W) for a window W (W = 1 keeps all: its slice [-0:] is the whole)."""
    if window is None or window <= 1:
        return seq_len
    return min(seq_len, window)


def layer_cache_bytes(shape: Shape, rows: int, tokens: int, dtype_bytes: int, tp: int = 1) -> int:
    """One decoder layer's cached keys and values: 2 x kv_heads / tp x head_dim x tokens x rows x dtype_bytes; with
    multi-head latent attention the latent and the shared RoPE key, (kv_lora_rank + qk_rope_head_dim) x tokens x rows
    x dtype_bytes (module docstring)."""
    if shape.mla is not None:
        return (shape.mla.kv_rank + shape.mla.rope_dim) * tokens * rows * dtype_bytes
    if shape.kv_heads % tp:
        raise ValueError(f"tensor parallelism {tp} does not divide the {shape.kv_heads} KV heads")
    head_dim = shape.head_dim or shape.hidden // shape.heads
    return 2 * shape.kv_heads // tp * head_dim * tokens * rows * dtype_bytes


def kv_cache_bytes(
    shape: Shape,
    stage_layers: Sequence[int],
    batch_rows: int,
    seq_len: int,
    dtype_bytes: int,
    tp: int = 1,
    windows: Sequence[int | None] | None = None,
    prompt_len: int = 0,
) -> int:
    """Peak bytes of the KV cache of a generation batch on one stage: ``stage_layers`` its decoder layer indices,
    ``batch_rows`` rows, ``seq_len`` tokens fed in all (the prompt budget + max_completion_length), ``prompt_len`` of
    them in the prefill (0: the cache at the end alone), ``windows`` per layer of the model (:func:`cache_windows`;
    None: every layer full). The larger of the cache right after the prefill and at the end (module docstring)."""
    windows = windows if windows is not None else [None] * shape.layers
    end = sum(cached_tokens(windows[i], seq_len) for i in stage_layers)
    prefill = prompt_len * len(stage_layers)
    return layer_cache_bytes(shape, batch_rows, max(end, prefill), dtype_bytes, tp)


def sampling_bytes_per_element(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> int:
    """Bytes per [rows, vocab] element of a chunk the sampling holds at its peak, its fp32 logits (4) included,
    counted from ``TokenPicker`` and transformers' processors (module docstring); the noise apart."""
    peak, held = 4, 4  # the fp32 logits; ``held``: they and the output of the processors so far
    if temperature != 1.0:
        peak, held = max(peak, held + 4), held + 4
    if top_k != 0:
        peak, held = max(peak, held + 1 + 4), 4 + 4  # mask and output; the previous output freed after
    if top_p < 1.0:
        # sorted logits 4 and indices 8, the softmax beside its cumulative sum, then the two masks and the output
        peak, held = max(peak, held + 12 + 4 + 4, held + 12 + 4 + 1 + 1 + 4), 4 + 4
    # the probabilities beside the processed logits; then the logits, the probabilities and their ratio to the noise
    return max(peak, held + 4, 4 + 4 + 4)


def logits_bytes(
    shape: Shape,
    batch_rows: int,
    dtype_bytes: int,
    do_sample: bool = True,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    micro_batches: int = 1,
) -> int:
    """The last stage's logits and sampling peak in a generation step of ``batch_rows`` rows in ``micro_batches``
    chunks (b rows the largest), x vocab: the largest of the LM head's moment (the previous chunk's fp32 logits,
    the head's output in the dtype, its fp32 copy: 4 + dtype + 4 per b-row element; fp32: 4 + 4), the new noise's
    (the logits, the old and the new noise) and the sampling's (:func:`sampling_bytes_per_element`), the sampling's
    Exp(1) noise of all the rows, 4 per element, held throughout."""
    rows = -(-batch_rows // min(micro_batches, batch_rows))  # the largest chunk
    head = (4 + dtype_bytes + (4 if dtype_bytes != 4 else 0)) * rows  # fp32: .float() returns the head's output
    if not do_sample:
        return head * shape.vocab
    noise = 4 * batch_rows
    sampling = sampling_bytes_per_element(temperature, top_k, top_p) * rows
    return max(head + noise, 4 * rows + 2 * noise, sampling + noise) * shape.vocab


def prefill_mask_bytes(
    stage_layers: Sequence[int], batch_rows: int, prompt_len: int, windows: Sequence[int | None] | None = None
) -> int:
    """The prefill's attention masks on a stage: one [rows, 1, S, S] bool per attention type of its layers (a window
    each, ``windows`` as for :func:`kv_cache_bytes`), as transformers' sdpa mask functions build them for left-padded
    prompts (none without padding, where sdpa runs causal; a decode step's [rows, 1, 1, kv] are negligible)."""
    kinds = {windows[i] for i in stage_layers} if windows is not None else {None} if stage_layers else set()
    return len(kinds) * batch_rows * prompt_len * prompt_len


def hidden_bytes(shape: Shape, batch_rows: int, prompt_len: int, dtype_bytes: int, stage: int, stages: int) -> int:
    """The prefill's hidden states [rows, S, H] a stage receives from the one before and sends to the one after
    (the first stage only sends, the last only receives; one stage: none)."""
    buffers = (stage > 0) + (stage < stages - 1)
    return buffers * batch_rows * prompt_len * shape.hidden * dtype_bytes


def reference_weight_bytes(psi: float, layout: Layout, shape: Shape | None, layers: int | None, beta: float) -> float:
    """The frozen reference model's weights per GPU of a stage holding ``psi`` parameters and ``layers`` decoder
    layers: none with ``beta`` 0 or under LoRA (the base is the reference); else its 1/tp in the training precision,
    1/ep of its routed experts, as ``parallel.memory_plan.stage_estimate`` counts a frozen base."""
    if beta == 0 or layout.lora_rank:
        return 0.0
    return frozen_weight_bytes(*local_params(psi, layout, shape, layers), layout)


@dataclass(frozen=True)
class GenerationBytes:
    """What GRPO adds per GPU on one pipeline stage, in bytes (module docstring)."""

    kv_cache: int  # the generation batch's keys and values at their peak (kv_cache_bytes)
    masks: int  # the prefill's attention masks (prefill_mask_bytes)
    hidden: int  # the prefill's hidden states received and sent (hidden_bytes)
    logits: int  # the last stage's logits and sampling in a step (logits_bytes); 0 elsewhere
    reference: float  # the frozen reference weights (reference_weight_bytes)

    @property
    def transient(self) -> int:
        """What the generation holds while it runs, freed before the training step: an upper bound (the prefill's
        masks and hidden states and a decode step's logits do not meet)."""
        return self.kv_cache + self.masks + self.hidden + self.logits

    @property
    def total(self) -> float:
        """The transient bytes and the reference weights."""
        return self.transient + self.reference


def stage_generation_bytes(
    shape: Shape,
    layout: Layout,
    windows: Sequence[int | None] | None,
    stage_params: Sequence[float],
    layers_per_stage: Sequence[int],
    stage: int,
    rows: int,
    prompt_len: int,
    completion_len: int,
    beta: float,
    do_sample: bool = True,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    micro_batches: int = 1,
) -> GenerationBytes:
    """:class:`GenerationBytes` of 1F1B stage ``stage`` (``stage_params``, ``layers_per_stage``: what
    ``parallel.partition.splitter`` gives per stage; ``windows``: :func:`cache_windows`) generating ``rows``
    completions of ``completion_len`` tokens after prompts padded to ``prompt_len``, in the training precision."""
    elem, layers = elem_bytes(layout), stage_layer_indices(layers_per_stage, stage)
    seq_len = prompt_len + completion_len
    last = stage == layout.stages - 1
    return GenerationBytes(
        kv_cache_bytes(shape, layers, rows, seq_len, elem, layout.tp, windows, prompt_len),
        prefill_mask_bytes(layers, rows, prompt_len, windows),
        hidden_bytes(shape, rows, prompt_len, elem, stage, layout.stages),
        logits_bytes(shape, rows, elem, do_sample, temperature, top_k, top_p, micro_batches) if last else 0,
        reference_weight_bytes(stage_params[stage], layout, shape, layers_per_stage[stage], beta),
    )


def prompt_tokens(layout: Layout) -> int:
    """The most tokens of a prompt in ``layout.generation``: data.max_seq_length - grpo.max_completion_length."""
    return layout.seq_len - layout.generation.completion_len


def generation_chunks(layout: Layout) -> int:
    """The chunks of rows ``layout.generation`` runs in flight: grpo.generation_micro_batches, 0 = one per stage."""
    return layout.generation.chunks or layout.stages


def layout_generation_bytes(
    shape: Shape,
    layout: Layout,
    windows: Sequence[int | None] | None,
    stage_params: Sequence[float],
    layers_per_stage: Sequence[int],
    stage: int,
) -> GenerationBytes:
    """:func:`stage_generation_bytes` of the generation ``layout.generation`` describes: a data-parallel rank's
    ``Layout.rank_batch`` rows, prompts padded to seq_len - completion_len, in its chunks (0: one per stage)."""
    g = layout.generation
    return stage_generation_bytes(
        shape,
        layout,
        windows,
        stage_params,
        layers_per_stage,
        stage,
        layout.rank_batch,
        prompt_tokens(layout),
        g.completion_len,
        g.beta,
        True,  # GRPO samples (grpo.temperature > 0)
        g.temperature,
        g.top_k,
        g.top_p,
        generation_chunks(layout),
    )


def with_generation(
    estimates: Sequence[Estimate],
    stage_params: Sequence[float],
    layout: Layout,
    shape: Shape | None,
    stage_layers: Sequence[int] | None,
    windows: Sequence[int | None] | None = None,
) -> list[Estimate]:
    """``parallel.memory_plan.stage_estimates``' ``estimates`` with each stage's generation and reference weights
    (:func:`layout_generation_bytes`), for a layout with ``Layout.generation``; unchanged without. ``windows``:
    :func:`cache_windows` of the model (None: every layer full)."""
    if layout.generation is None:
        return list(estimates)
    if shape is None or stage_layers is None:
        raise ValueError("the generation's KV cache is counted from the model's shape: give the model, not a count")
    if layout.schedule == "dualpipev":  # the axis refuses it with train_objective=grpo (parallel/dualpipev.py)
        raise ValueError("generation runs on 1F1B stages, not on DualPipeV's pieces: set pipeline_schedule=1f1b")
    out = []
    for e in estimates:
        g = layout_generation_bytes(shape, layout, windows, stage_params, stage_layers, e.stage)
        out.append(dataclasses.replace(e, generation=g.transient, kv_cache=g.kv_cache, reference=g.reference))
    return out


def generation_plan(windows: Sequence[int | None] | None = None):
    """``parallel.memory_plan.fitting``'s ``plan``: each layout's stage estimates with its generation
    (:func:`with_generation`; ``windows``: :func:`cache_windows`)."""

    def plan(stage_params, layout: Layout, shape: Shape | None, stage_layers) -> list[Estimate]:
        estimates = stage_estimates(stage_params, layout, shape, stage_layers)
        return with_generation(estimates, stage_params, layout, shape, stage_layers, windows)

    return plan
