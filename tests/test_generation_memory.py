"""GRPO's generation memory on a stage (parallel/generation_memory.py): the planned KV cache equals, byte for byte,
what each stage's ``DynamicCache`` holds after ``models.generation.generate`` (tensor storages, fp32), right after the
prefill and at the end, and the planned logits and sampling bytes are generate's profiled peak.

Two stages of a tiny model, four left-padded prompts of up to 9 tokens, 10 tokens picked per row (no EOS): llama
(GQA: 4 query, 2 KV heads), qwen3 with sliding layers (window 4), mixtral (MoE, window 5 on every layer), qwen3_moe
and llama4_text (MoE, chunked layers of 8). A formula that caches the query heads, or ignores the windows, or the
prompt a sliding layer holds until its first decode step, misses; so does a logits count without the sampling's
noise or top-p's int64 indices. Also the reference weights and the hidden states sent, on examples worked by hand.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import models.generation as generation
from models.generation import generate
from models.llama_pipe import build_sequential
from models.moe_counts import MoEShape
from models.tiny import tiny_config
from parallel.generation_memory import (
    cache_windows,
    hidden_bytes,
    kv_cache_bytes,
    logits_bytes,
    prefill_mask_bytes,
    reference_weight_bytes,
    stage_generation_bytes,
    stage_layer_indices,
)
from parallel.layout import Layout
from parallel.memory_plan import Shape, shape_of

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33, 34, 35], [40, 41, 42, 43]]
WIDTH = max(map(len, PROMPTS))  # the prefill's padded length S
MAX_NEW = 10
BOUNDS = [0, 3, 7]  # specs 0 embedding, 1-4 decoder layers, 5 norm, 6 head: layers 0-1 | layers 2-3
LAYERS_PER_STAGE = [2, 2]
FAMILIES = {
    "llama": ("llama", {}),
    "qwen3_sliding": ("qwen3", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2)),
    "mixtral": ("mixtral", dict(sliding_window=5)),
    "qwen3_moe": ("qwen3_moe", {}),
    "llama4_text": ("llama4_text", {}),
}


def held_bytes(cache) -> int:
    """Bytes of the storages under a cache's keys and values (a sliding layer keeps a view of a longer tensor)."""
    storages = {}
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None and t.numel():
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def measured(monkeypatch, config, max_new: int) -> tuple[list[int], list[int]]:
    """Each stage's cache bytes when ``generate`` resets it after ``max_new`` tokens (1: the prefill alone), and the
    bytes of the attention masks it builds for the prefill."""
    torch.manual_seed(0)
    funcs = build_sequential(config)
    seen: dict[int, int] = {}
    masks = [0, 0]
    reset = generation.StageGenerator.reset

    def recording_reset(self, *args):
        if any(self.caches):
            seen[self.layers[0].self_attn.layer_idx] = sum(held_bytes(cache) for cache in self.caches)
        reset(self, *args)

    def recording(mask_function):
        def build(**kwargs):
            mask = mask_function(**kwargs)
            if mask is not None and mask.shape[-2] > 1:  # the prefill's
                masks[kwargs["layer_idx"] >= LAYERS_PER_STAGE[0]] += mask.nbytes
            return mask

        return build

    monkeypatch.setattr(generation.StageGenerator, "reset", recording_reset)
    for kind, mask_function in list(generation.MASK_FUNCTIONS.items()):
        monkeypatch.setitem(generation.MASK_FUNCTIONS, kind, recording(mask_function))
    stages = [funcs[a:b] for a, b in zip(BOUNDS, BOUNDS[1:])]
    out = generate(stages, PROMPTS, max_new, eos_token_id=config.vocab_size, pad_token_id=0)  # no EOS: all max_new
    monkeypatch.undo()
    assert all(len(c.ids) == max_new for c in out)
    return [seen[first] for first in (0, LAYERS_PER_STAGE[0])], masks


def planned(config, seq_len: int, prompt_len: int = 0, windows="config", **change) -> list[int]:
    """Each stage's :func:`kv_cache_bytes` in fp32 (``change``: Shape fields replaced; ``windows`` None: all full)."""
    shape = dataclasses.replace(shape_of(config), **change)
    windows = cache_windows(config) if windows == "config" else windows
    rows = len(PROMPTS)
    return [
        kv_cache_bytes(shape, stage_layer_indices(LAYERS_PER_STAGE, s), rows, seq_len, 4, 1, windows, prompt_len)
        for s in range(2)
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_cache_bytes_equal_the_dynamic_caches(family, monkeypatch):
    model_type, overrides = FAMILIES[family]
    config = tiny_config(model_type, **overrides)
    end = WIDTH + MAX_NEW - 1  # the last token picked is never fed back
    after_generation, masks = measured(monkeypatch, config, MAX_NEW)
    after_prefill, _ = measured(monkeypatch, config, 1)
    assert planned(config, end) == after_generation
    assert planned(config, WIDTH, WIDTH) == after_prefill
    peak = [max(a, b) for a, b in zip(after_generation, after_prefill)]
    assert planned(config, end, WIDTH) == peak
    # caching the query heads (forgetting GQA) doubles every figure here
    forgot_gqa = planned(config, end, WIDTH, kv_heads=config.num_attention_heads)
    assert all(f == 2 * p for f, p in zip(forgot_gqa, peak))
    windows = cache_windows(config)
    rows = len(PROMPTS)
    assert [
        prefill_mask_bytes(stage_layer_indices(LAYERS_PER_STAGE, s), rows, WIDTH, windows) for s in range(2)
    ] == masks
    windowed = any(w is not None for w in windows)
    assert (planned(config, end, WIDTH, windows=None) != peak) == windowed  # the windows ignored
    assert (planned(config, end) != peak) == windowed  # the prompt held until the first decode step forgotten


def peak_bytes(fn) -> int:
    """The most bytes ``fn`` holds at once beyond what existed before, from the profiler's CPU allocation events: a
    leaf op's at its start, what a parent op frees beyond its children's at its end, frees outside ops as they come."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    deltas = []
    for e in prof.events():
        own = e.cpu_memory_usage - sum(c.cpu_memory_usage for c in e.cpu_children)
        deltas.append((e.time_range.end if e.cpu_children else e.time_range.start, own))
    now = top = 0
    for _, d in sorted(deltas, key=lambda x: x[0]):
        now += d
        top = max(top, now)
    return top


SAMPLINGS = {  # (generate's arguments, micro_batches)
    "greedy": (dict(), 1),
    "every_processor": (dict(do_sample=True, temperature=0.7, top_k=40, top_p=0.8), 1),
    "top_p_two_chunks": (dict(do_sample=True, top_p=0.8), 2),
}


@pytest.mark.parametrize("case", SAMPLINGS)
def test_logits_bytes_are_the_last_stages_measured_peak(case):
    """generate's peak (profiled, fp32, a vocabulary of 16384 so that the [rows, vocab] tensors dominate) is the
    planned logits and sampling bytes plus the KV cache, within a quarter byte per logit (masks, ids and positions);
    the sampling's noise forgotten, or top-p's int64 indices, misses by a whole [rows, vocab] fp32 tensor or more."""
    kwargs, chunks = SAMPLINGS[case]
    config = tiny_config("llama", vocab_size=16384)
    torch.manual_seed(0)
    funcs = build_sequential(config)
    stages = [funcs[a:b] for a, b in zip(BOUNDS, BOUNDS[1:])]
    new = 3
    measured = peak_bytes(
        lambda: generate(stages, PROMPTS, new, config.vocab_size, pad_token_id=0, micro_batches=chunks, **kwargs)
    )
    shape, rows = shape_of(config), len(PROMPTS)
    kv = sum(planned(config, WIDTH + new - 1, WIDTH))
    sampling = {k: v for k, v in kwargs.items() if k != "do_sample"}
    logits = logits_bytes(shape, rows, 4, kwargs.get("do_sample", False), micro_batches=chunks, **sampling)
    one = rows * shape.vocab * 4  # one [rows, vocab] fp32 tensor
    assert 0 <= measured - (logits + kv) <= one / 16
    if kwargs:
        assert measured - (logits - one + kv) > one / 16  # the noise forgotten
    if "top_p" in kwargs:
        indices = rows // chunks * shape.vocab * 8
        assert measured - (logits - indices + kv) > one / 16


def test_reference_weights_and_hidden_states_worked_by_hand():
    """The reference copy: psi / tp in the training precision, routed experts / ep; none at beta 0 or under LoRA.
    The prefill's hidden states: [rows, S, H] received and sent by a middle stage, one of them at either end."""
    moe = MoEShape(
        num_experts=8, top_k=2, moe_layers=8, expert_width=64, expert_params=800_000_000, largest_expert_tensor=1
    )
    shape = Shape(hidden=64, ffn=176, layers=8, heads=4, kv_heads=2, vocab=512, moe=moe)
    assert reference_weight_bytes(1e9, Layout(dtype="bf16", tp=2), None, None, beta=0.04) == 1e9
    assert reference_weight_bytes(1e9, Layout(dtype="fp32"), None, None, beta=0.04) == 4e9
    assert reference_weight_bytes(1e9, Layout(dtype="bf16"), None, None, beta=0.0) == 0
    assert reference_weight_bytes(1e9, Layout(lora_rank=8, lora_targets=("q_proj",)), None, None, beta=0.04) == 0
    # 4 of 8 MoE layers: 4e8 routed-expert parameters of the stage's 6e8, a quarter of them on each of 4 ranks
    assert reference_weight_bytes(6e8, Layout(dtype="bf16", ep=4), shape, 4, beta=0.04) == 2 * (2e8 + 1e8)
    assert [hidden_bytes(shape, 8, 100, 2, s, 3) for s in range(3)] == [102_400, 204_800, 102_400]
    assert hidden_bytes(shape, 8, 100, 2, 0, 1) == 0


def test_a_stage_of_llama3_8b_worked_by_hand():
    """Llama 3 8B's shape on 2 stages in bf16, 64 completions of 1024 tokens after prompts of 512, sampled at TRL's
    defaults (temperature 1, no top-k or top-p), beta 0.04: the last stage's 16 layers cache 2 x 8 x 128 x 1536 x 64
    x 2 bytes each; its logits peak is the probabilities' moment, 4 + 4 + 4 bytes per logit and the noise's 4."""
    shape = Shape(hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, vocab=128256, head_dim=128)
    layout = Layout(stages=2, dtype="bf16")
    params = [4.0e9, 4.0e9]
    last = stage_generation_bytes(shape, layout, None, params, [16, 16], 1, 64, 512, 1024, beta=0.04)
    assert last.kv_cache == 16 * 2 * 8 * 128 * 1536 * 64 * 2 == 6_442_450_944
    assert last.masks == 64 * 512 * 512
    assert last.hidden == 64 * 512 * 4096 * 2
    assert last.logits == (12 + 4) * 64 * 128256
    assert last.reference == 2 * 4.0e9
    first = stage_generation_bytes(shape, layout, None, params, [16, 16], 0, 64, 512, 1024, beta=0.0)
    assert (first.logits, first.reference, first.kv_cache) == (0, 0, last.kv_cache)
    assert first.total == first.kv_cache + first.masks + first.hidden
