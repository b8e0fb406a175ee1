"""GRPO's generation memory on a stage (parallel/generation_memory.py): the planned KV cache equals, byte for byte,
what each stage's ``DynamicCache`` holds after ``models.generation.generate`` (tensor storages, fp32), right after the
prefill and at the end, and the planned logits and sampling bytes are generate's profiled peak.

Two stages of a tiny model, four left-padded prompts of up to 9 tokens, 10 tokens picked per row (no EOS): llama
(GQA: 4 query, 2 KV heads), qwen3 with sliding layers (window 4), mixtral (MoE, window 5 on every layer), qwen3_moe
and llama4_text (MoE, chunked layers of 8). A formula that caches the query heads, or ignores the windows, or the
prompt a sliding layer holds until its first decode step, misses; so does a logits count without the sampling's
noise or top-p's int64 indices. Also the reference weights and the hidden states sent, on examples worked by hand,
and a train_objective=grpo layout's estimate in the planner and preflight: the larger of the training step and the
generation beside the resident weights and the reference weights.
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
    with_generation,
)
from parallel.layout import GenerationBatch, Layout
from parallel.memory_plan import Shape, shape_of, stage_estimates, stage_table
from training.configuration.schema import GRPOConfig, TrainConfig

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


LLAMA3_8B = Shape(hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, vocab=128256, head_dim=128)


def grpo_estimates(completion: int, beta: float, seq_len: int = 1536):
    """(layout, per-stage estimates) of Llama 3 8B on pipe 2 x data 2, ZeRO-0, micro 1 x grad_acc 32, act. ckpt:
    32 rows per data-parallel rank, prompts of seq_len - completion tokens."""
    params, layers = [4.0e9, 4.0e9], [16, 16]
    layout = Layout(
        stages=2, dp=2, zero=0, micro_batch=1, seq_len=seq_len, grad_accum=32, checkpointing=True, loss_chunk=1024
    )
    layout = dataclasses.replace(layout, generation=GenerationBatch(completion, beta=beta))
    return layout, with_generation(
        stage_estimates(params, layout, LLAMA3_8B, layers), params, layout, LLAMA3_8B, layers
    )


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_a_grpo_estimate_adds_the_generation_over_the_training_step_and_the_reference_weights(beta):
    """Per stage, with_generation keeps the training estimate's resident bytes and adds the reference weights (beta
    > 0 only) and the generation's excess over the training step, which it does not meet: here 32 rows' KV cache of
    1536 tokens (3.2 GB a stage) exceeds 1 micro-batch's checkpointed activations."""
    params, layers = [4.0e9, 4.0e9], [16, 16]
    layout, planned = grpo_estimates(1024, beta)
    training = stage_estimates(params, dataclasses.replace(layout, generation=None), LLAMA3_8B, layers)
    for stage, (e, t) in enumerate(zip(planned, training)):
        g = stage_generation_bytes(LLAMA3_8B, layout, None, params, layers, stage, 32, 512, 1024, beta, micro_batches=2)
        assert (e.generation, e.kv_cache, e.reference) == (g.transient, g.kv_cache, g.reference)
        assert e.kv_cache == 16 * 2 * 8 * 128 * 1536 * 32 * 2
        assert e.reference == (2 * 4.0e9 if beta else 0)
        assert e.model_states == t.model_states and e.training == t.training < e.generation
        assert e.total == pytest.approx(t.total + (e.generation - t.training) + e.reference, rel=1e-12)


def test_a_grpo_estimate_grows_with_the_completion_and_the_reference():
    """The prompt budget and the completion doubled double the KV cache; beta > 0 adds exactly the reference weights;
    where the training step is the larger, the generation adds nothing."""
    _, short = grpo_estimates(1024, 0.04)
    _, long = grpo_estimates(2048, 0.04, seq_len=3072)
    _, without = grpo_estimates(1024, 0.0)
    for s, l, w in zip(short, long, without):
        assert l.kv_cache == 2 * s.kv_cache
        assert s.total - w.total == pytest.approx(s.reference, rel=1e-12) and s.reference == 2 * 4.0e9
    layout, few = grpo_estimates(8, 0.0, seq_len=16)  # 32 rows of 16 tokens: a small cache
    training = stage_estimates([4.0e9, 4.0e9], dataclasses.replace(layout, generation=None), LLAMA3_8B, [16, 16])
    assert [e.total for e in few] == [t.total for t in training] and all(e.generation < e.training for e in few)


def test_the_stage_table_shows_gen_and_ref_for_grpo_alone():
    """The planner's table has gen and ref columns for a GRPO layout, none otherwise."""
    layout, planned = grpo_estimates(1024, 0.04)
    head, first = stage_table(planned, [16, 16], layout)[:2]
    assert head.split()[7:11] == ["loss", "g.tmp", "gen", "ref"]
    assert f" {planned[0].generation / 1e9:>6.2f} {planned[0].reference / 1e9:>6.2f} " in first
    plain = stage_estimates([4.0e9, 4.0e9], Layout(stages=2), LLAMA3_8B, [16, 16])
    assert "gen" not in stage_table(plain, [16, 16])[0].split()


def test_a_grpo_config_gives_its_layout_the_generation():
    """Layout.of: grpo.* as the GenerationBatch of a train_objective=grpo config; None for another objective."""
    g = GRPOConfig(max_completion_length=64, temperature=0.7, top_k=5, top_p=0.9, beta=0.1, generation_micro_batches=3)
    cfg = TrainConfig(train_objective="grpo", grpo=g, micro_batch_size=2, gradient_accumulation_steps=4)
    layout = Layout.of(cfg, 2, {})
    assert layout.generation == GenerationBatch(64, 3, 0.7, 5, 0.9, 0.1) and layout.rank_batch == 8
    assert Layout.of(TrainConfig(grpo=g), 2, {}).generation is None


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_preflight_names_the_generation_kv_cache_and_the_reference_weights(tmp_path, tokenizer_dir, beta):
    """training/configuration/preflight.py on a GRPO config: the most loaded GPU's sum names the reference weights
    and the generation's KV cache, the table has their columns, and a line says the generation batch in its knobs."""
    from training.configuration.preflight import check

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "count to 1"}\n{"prompt": "count to 2"}\n')
    overrides = ["model=llama3.2-1b", f"model.tokenizer={tokenizer_dir}", "model.architecture.vocab_size=512"]
    overrides += ["data=grpo", f"data.train_file={prompts}", "data.max_seq_length=1024", "max_steps=10"]
    overrides += ["grpo.reward_funcs=[tests.support.rewards_fixture:length_reward]", "grpo.max_completion_length=512"]
    overrides += [f"grpo.beta={beta}", "num_stages=2", "micro_batch_size=2", "gradient_accumulation_steps=4"]
    overrides += ["loss_chunk_tokens=1024", f"output_dir={tmp_path / 'out'}", "min_free_disk_gb=0"]
    lines = check(4, overrides)
    planner = next(line for line in lines if line.startswith("planner"))
    reference = "reference weights 1.0 GB" if beta else "reference weights 0.0 GB"
    assert reference in planner and "and the generation (KV cache " in planner, planner
    assert "the larger of the training step (activations " in planner, planner
    assert any(line.split()[9:11] == ["gen", "ref"] for line in lines), lines
    generation = next(line for line in lines if line.startswith("generation (train_objective=grpo)"))
    assert (
        "8 rows per data-parallel rank (micro_batch_size 2 x gradient_accumulation_steps 4) in 2 chunks" in generation
    )
    assert (
        "prompts of up to 512 tokens (data.max_seq_length - grpo.max_completion_length) + 512 generated" in generation
    )
    kept = "the reference weights (grpo.beta 0.04) stay beside the trained ones" if beta else "no reference weights"
    assert kept in generation, generation


def test_estimate_memory_counts_a_grpo_generation_and_fits_only_layouts_grpo_runs(capsys):
    """scripts/estimate_memory.py --grpo-completion-length: the table's gen and ref columns, the line naming the
    KV cache and the reference weights; the fit search counts them and proposes no layout train_objective=grpo
    refuses (sequence or expert parallelism, DualPipeV, the data-parallel engine)."""
    from tests.support.scripts import load_entry_point

    script = load_entry_point("scripts/estimate_memory.py")
    flags = ["--model", "llama3-8b", "--seq-len", "1536", "--grad-accum", "16", "--loss-chunk-tokens", "1024"]
    grpo = ["--grpo-completion-length", "1024", "--grpo-beta", "0.04"]
    script.main([*flags, *grpo, "--stages", "2", "--dp", "4", "--zero", "1"])
    out = capsys.readouterr().out
    assert "gen    ref bucket" in out, out
    assert "16 rows per data-parallel rank, prompts of up to 512 + 1024 tokens; on stage 0 its KV cache 1.71 GB" in out
    assert "reference weights 8.47 GB (ref, --grpo-beta > 0)" in out, out
    script.main([*flags, "--stages", "2", "--dp", "4", "--zero", "1"])
    assert "gen" not in capsys.readouterr().out.split()
    script.main([*flags, *grpo, "--gpus", "8", "--gpu-mem", "80", "--schedule", "both", "--top", "100"])
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  ") and "ZeRO" in line]
    assert listed and not any("sequence" in line or "DualPipeV" in line or "dualpipev" in line for line in listed)
    with pytest.raises(SystemExit) as exit_:
        script.main([*flags, *grpo, "--schedule", "dualpipev", "--stages", "2", "--dp", "4", "--grad-accum", "8"])
    assert exit_.value.code == 1 and "--schedule dualpipev with --grpo-completion-length:" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="leaves no token of --seq-len 1536"):
        script.main([*flags, "--grpo-completion-length", "1536"])
