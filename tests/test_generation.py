"""Generation stage by stage (models/generation.py), each stage keeping its own layers' KV cache, makes token for token
what ``<Family>ForCausalLM.generate`` makes with the same weights (fp32), greedy and sampled with the same seed.

Prompts of different lengths in one left-padded batch, some rows stopping at EOS and others at max_new_tokens, split
into 2 and 3 stages (the norm with the head, or the head alone), for llama, qwen2 (tied), qwen3 with sliding layers,
mistral with a window shorter than the prompts, qwen3_moe, mixtral and llama4_text (chunked attention). Each decode
step feeds one token per row and the caches grow by one; right padding, no mask, decode positions that stop
advancing, a window ignored or the sampling processors in another order each break the equality. The rows run in
chunks (micro-batches) make the same tokens, greedy and sampled; a draw per chunk instead of one per step breaks that.
Modules split by a parallel axis are refused, tensor-parallel pieces passing only for a stage told so (the
pipeline's, which runs them with the group).
"""

from __future__ import annotations

import pytest
import torch
from transformers.masking_utils import create_causal_mask

import models.generation as generation
from models.families import family_of
from models.generation import Completion, StageGenerator, generate
from models.llama_pipe import build_sequential
from models.tiny import tiny_config
from parallel.partition import stage_boundaries
from parallel.tensor_parallel import VocabEmbedding
from tests.test_stage_parity import copy_hf_weights

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33, 34, 35], [40, 41, 42, 43]]
MAX_NEW = 10
SAMPLING = dict(temperature=0.7, top_k=40, top_p=0.8)

FAMILIES = {  # (model_type, tiny_config overrides): each family's difference visible within 13 + 10 tokens
    "llama": ("llama", {}),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3_sliding": ("qwen3", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2)),
    "mistral_window": ("mistral", dict(sliding_window=4)),
    "qwen3_moe": ("qwen3_moe", {}),
    "mixtral": ("mixtral", dict(sliding_window=5)),
    "llama4_text": ("llama4_text", {}),
}
# 4 layers: specs 0 embedding, 1-4 decoder layers, 5 norm, 6 head
SPLITS = {"norm_with_head": [0, 3, 5, 7], "head_alone": [0, 2, 6, 7]}


def pair(model_type: str, build: dict | None = None, **overrides):
    """(``<Family>ForCausalLM`` in eval mode, the spec modules with its weights). The weights are drawn 10 times wider
    than Hugging Face's default: at 0.02 the attention is near uniform, and decode positions that stop advancing
    still made llama's tokens. ``build``: build_sequential's other arguments."""
    config = tiny_config(model_type, initializer_range=0.2, **overrides)
    torch.manual_seed(0)
    hf = family_of(config).causal_lm._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    funcs = build_sequential(config, **(build or {}))
    copy_hf_weights(funcs, config, hf.state_dict())
    for f in funcs:
        if isinstance(f, torch.nn.Module):
            f.eval()
    return hf, funcs


def stages_of(funcs, bounds: list[int]) -> list[list]:
    return [funcs[a:b] for a, b in zip(bounds, bounds[1:])]


def hf_generate(hf, prompts, eos, seed: int | None = None, **sampling) -> list[Completion]:
    """Hugging Face's completions of a left-padded batch (padding and finished rows filled with the first EOS)."""
    eos_ids = [eos] if isinstance(eos, int) else eos
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), eos_ids[0])
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :], mask[row, width - len(p) :] = torch.tensor(p), 1
    if seed is not None:
        torch.manual_seed(seed)
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=MAX_NEW,
        eos_token_id=eos,
        pad_token_id=eos_ids[0],
        do_sample=seed is not None,
        **sampling,
    )[:, width:].tolist()
    cut = [next((i for i, t in enumerate(row) if t in eos_ids), None) for row in out]
    return [Completion(row, True) if i is None else Completion(row[: i + 1], False) for row, i in zip(out, cut)]


def eos_for_some_rows(completions: list[Completion]) -> int:
    """A token the first row makes within max_new_tokens and the last row never: as EOS, some rows stop, some not."""
    last = set(completions[-1].ids)
    return next(t for t in completions[0].ids[2:] if t not in last)


def ours(stages, prompts, eos, seed: int | None = None, micro_batches: int = 1, **sampling) -> list[Completion]:
    if seed is None:
        return generate(stages, prompts, MAX_NEW, eos, micro_batches=micro_batches)
    g = torch.Generator().manual_seed(seed)
    return generate(stages, prompts, MAX_NEW, eos, True, generator=g, micro_batches=micro_batches, **sampling)


def assert_equals_hf(hf, funcs, splits: list[list[int]], seed: int | None, prompts=PROMPTS) -> list[Completion]:
    sampling = SAMPLING if seed is not None else {}
    eos = eos_for_some_rows(hf_generate(hf, prompts, 2, seed, **sampling))
    ref = hf_generate(hf, prompts, eos, seed, **sampling)
    assert {c.truncated for c in ref} == {True, False}  # EOS for some rows, max_new_tokens for the others
    for bounds in splits:
        assert ours(stages_of(funcs, bounds), prompts, eos, seed, **sampling) == ref, bounds
    return ref


FAST_FAMILIES = ("llama", "mistral_window")  # the fast tier's; the sweep over the others is slow (a second or more)


@pytest.mark.parametrize(
    "name", [n if n in FAST_FAMILIES else pytest.param(n, marks=pytest.mark.slow) for n in FAMILIES]
)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_stage_generation_equals_hf_generate(name, sampled):
    model_type, overrides = FAMILIES[name]
    hf, funcs = pair(model_type, **overrides)
    two = stage_boundaries(hf.config, 2)  # train.py's split
    assert_equals_hf(hf, funcs, [two, SPLITS["norm_with_head"], SPLITS["head_alone"]], 0 if sampled else None)


def test_prompts_of_one_length_and_several_eos_ids():
    """No padding (generate drops the mask) and EOS given as a list, one of them produced."""
    hf, funcs = pair("llama")
    prompts = [p[:3] for p in PROMPTS]
    free = hf_generate(hf, prompts, 2)
    eos = [1, eos_for_some_rows(free)]
    ref = hf_generate(hf, prompts, eos)
    assert {c.truncated for c in ref} == {True, False}
    assert ours(stages_of(funcs, SPLITS["head_alone"]), prompts, eos) == ref


def test_the_seed_decides_the_draws():
    hf, funcs = pair("llama")
    stages = stages_of(funcs, SPLITS["norm_with_head"])
    first = ours(stages, PROMPTS, 2, 0, **SAMPLING)
    assert ours(stages, PROMPTS, 2, 0, **SAMPLING) == first
    assert ours(stages_of(funcs, [0, 7]), PROMPTS, 2, 0, **SAMPLING) == first  # one stage: the same draws
    assert ours(stages, PROMPTS, 2, 1, **SAMPLING) != first


def test_a_decode_step_feeds_one_token_and_each_stage_caches_its_own_layers(monkeypatch):
    hf, funcs = pair("llama")
    seen = []
    step = StageGenerator.step

    def recording(unit, inputs, attention_mask, position_ids):
        out = step(unit, inputs, attention_mask, position_ids)
        cached = [unit.cache.get_seq_length(i) for i in range(4)] if unit.cache is not None else None
        seen.append((unit, tuple(inputs.shape), tuple(position_ids.shape), tuple(out.shape), cached))
        return out

    monkeypatch.setattr(StageGenerator, "step", recording)
    completions = generate(stages_of(funcs, SPLITS["head_alone"]), PROMPTS, MAX_NEW, eos_token_id=2)
    assert all(c.truncated and len(c.ids) == MAX_NEW for c in completions)
    batch, width, hidden, vocab = len(PROMPTS), max(map(len, PROMPTS)), 64, 512
    own = ([0], [1, 2, 3], None)  # stage 0: layer 0; stage 1: layers 1-3 and the norm; stage 2: the head alone
    assert len(seen) == 3 * MAX_NEW
    for t in range(MAX_NEW):
        tokens = width if t == 0 else 1  # the prefill, then one token per row
        steps = seen[3 * t : 3 * t + 3]
        assert [s[1] for s in steps] == [(batch, tokens), (batch, tokens, hidden), (batch, 1, hidden)]
        assert [s[2] for s in steps] == [(batch, tokens)] * 3
        assert [s[3] for s in steps] == [(batch, tokens, hidden), (batch, 1, hidden), (batch, vocab)]
        for (_, _, _, _, cached), layers in zip(steps, own):
            if layers is None:
                assert cached is None
            else:
                assert cached == [width + t if i in layers else 0 for i in range(4)]


def right_padding(left_padded):
    """``left_padded`` turned into right padding: each prompt first, then the padding."""

    def padded(prompt_ids, pad_token_id):
        ids, mask = left_padded([p[::-1] for p in prompt_ids], pad_token_id)
        return ids.flip(1), mask.flip(1)

    return padded


BREAKS = {  # a wrong treatment (patched into models/generation.py) and the family it shows on
    "right_padding": ("llama", "left_padded", right_padding),
    "positions_stand_still": ("llama", "next_positions", lambda real: lambda p: p[:, -1:]),
    "no_mask": ("llama", "run_stages", lambda real: lambda units, x, mask, pos: real(units, x, None, pos)),
    "window_ignored": (
        "mistral_window",
        "MASK_FUNCTIONS",
        lambda real: {**real, "sliding_attention": create_causal_mask},
    ),
    "processors_reversed": ("llama", "sampling_processors", lambda real: lambda *a: type(real(*a))(real(*a)[::-1])),
}


@pytest.mark.parametrize("name", BREAKS)
def test_a_wrong_treatment_breaks_the_equality(name, monkeypatch):
    family, attribute, wrong = BREAKS[name]
    model_type, overrides = FAMILIES[family]
    hf, funcs = pair(model_type, **overrides)
    seed = 0 if name == "processors_reversed" else None
    ref = assert_equals_hf(hf, funcs, [SPLITS["norm_with_head"]], seed)
    monkeypatch.setattr(generation, attribute, wrong(getattr(generation, attribute)))
    eos = next(c.ids[-1] for c in ref if not c.truncated)
    sampling = SAMPLING if seed is not None else {}
    assert ours(stages_of(funcs, SPLITS["norm_with_head"]), PROMPTS, eos, seed, **sampling) != ref


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_chunked_generation_equals_unchunked(sampled, monkeypatch):
    """The rows in 2, 3, 4 or (capped) 9 chunks, each with its own caches, make the one-chunk completions token for
    token; a chunk whose rows have all finished runs no more steps (one row per chunk: a row's steps are its
    tokens)."""
    _, funcs = pair("llama")
    stages = stages_of(funcs, SPLITS["head_alone"])
    seed, sampling = (0, SAMPLING) if sampled else (None, {})
    eos = eos_for_some_rows(ours(stages, PROMPTS, 2, seed, **sampling))
    ref = ours(stages, PROMPTS, eos, seed, **sampling)
    assert {c.truncated for c in ref} == {True, False}
    steps = []
    run = generation.run_stages
    monkeypatch.setattr(generation, "run_stages", lambda units, x, *rest: steps.append(len(x)) or run(units, x, *rest))
    for micro_batches in (2, 3, 4, 9):
        steps.clear()
        assert ours(stages, PROMPTS, eos, seed, micro_batches, **sampling) == ref, micro_batches
    assert len(steps) == sum(len(c.ids) for c in ref) and set(steps) == {1}  # 9 capped at 4: one row per chunk


def test_one_draw_per_chunk_breaks_the_chunked_equality(monkeypatch):
    """A fresh multinomial draw per chunk (not one for the whole batch each step) changes the sampled tokens."""
    _, funcs = pair("llama")
    stages = stages_of(funcs, SPLITS["head_alone"])
    ref = ours(stages, PROMPTS, 2, 0, **SAMPLING)
    pick = generation.TokenPicker.__call__

    def per_chunk(picker, logits, chunk):
        picker.noise_step = -1
        return pick(picker, logits, chunk)

    monkeypatch.setattr(generation.TokenPicker, "__call__", per_chunk)
    assert ours(stages, PROMPTS, 2, 0, **SAMPLING) == ref  # one chunk: the same draws
    assert ours(stages, PROMPTS, 2, 0, 2, **SAMPLING) != ref


def test_stages_that_are_not_the_spec_list_are_refused():
    _, funcs = pair("llama")
    with pytest.raises(ValueError) as e:
        generate([funcs[:2], funcs[3:]], PROMPTS, MAX_NEW, 2)
    assert (
        str(e.value) == "generate: the stages hold the decoder layers [0, 2, 3], not each of [0, 1, 2, 3] once in order"
    )
    with pytest.raises(ValueError) as e:
        StageGenerator([funcs[2], funcs[1], torch.nn.Linear(2, 2)])
    assert str(e.value).splitlines() == [
        "stage module 2 (Linear) is not a spec of models/llama_pipe.py's build_specs (embedding, decoder layer, "
        "norm, LM head)",
        "the decoder layers [1, 0] are not consecutive",
    ]
    with pytest.raises(ValueError) as e:
        generate(
            [funcs[3:], funcs[:3]], [[]], 0, 2, do_sample=True, temperature=0.0, top_p=1.5, top_k=-1, micro_batches=0
        )
    assert str(e.value).splitlines() == [
        "generate: every prompt needs at least one token (an empty prompt or no prompts given)",
        "generate: max_new_tokens is 0; set it to 1 or more",
        "generate: temperature is 0.0; set it above 0 (or do_sample=False for greedy)",
        "generate: top_p is 1.5; set it in (0, 1] (1: off)",
        "generate: top_k is -1; set it to 0 (off) or more",
        "generate: micro_batches is 0; set it to 1 or more",
        "generate: the first stage must start with the embedding (spec 0)",
        "generate: the last stage must end with the LM head (the last spec)",
        "generate: stage 0 holds the LM head, which only the last stage may",
        "generate: stage 1 holds the embedding, which only the first stage may",
        "generate: the stages hold the decoder layers [2, 3, 0, 1], not each of [0, 1, 2, 3] once in order",
    ]


def test_modules_split_by_a_parallel_axis_are_refused():
    """A tensor-parallel piece (its parameters marked ``tp_split``) or a sequence-parallel embedding (a hook slices its
    rows): what a stage computes there is not the whole model's."""
    _, funcs = pair("llama")
    funcs[2].mlp.down_proj.weight.tp_split = (1, 0, 2)
    funcs[0].register_forward_pre_hook(lambda module, args: None)
    with pytest.raises(ValueError) as e:
        generate([funcs[:3], funcs[3:]], PROMPTS, MAX_NEW, 2)
    assert str(e.value).splitlines() == [
        f"generate: stage 0: stage module {i} ({name}) is split by tensor, expert or sequence parallelism or ZeRO-3: "
        "generation runs whole modules only"
        for i, name in ((0, "EmbeddingPipe"), (2, "LlamaDecoderLayerPipe"))
    ]


def test_tensor_parallel_pieces_pass_only_for_a_stage_told_so():
    """parallel/tensor_parallel.py's pieces (``tp_split``, the vocabulary-parallel embedding's hooks) pass with
    ``tensor_parallel`` (the pipeline's StageGenerator runs them with the group); an expert-parallel piece, a
    ZeRO-3 partition or another hook is still refused."""
    _, funcs = pair("llama")
    VocabEmbedding.split(funcs[0], None, 0, 2)
    funcs[2].mlp.down_proj.weight.tp_split = (1, 0, 2)
    assert generation.stage_problems(funcs[:3], tensor_parallel=True) == []
    assert len(generation.stage_problems(funcs[:3])) == 2  # the one-process generate refuses them
    funcs[1].mlp.up_proj.weight.ep_split = (0, 0, 2)
    funcs[2].input_layernorm.weight.ds_id = 7
    funcs[3].register_forward_pre_hook(lambda module, args: None)
    assert generation.stage_problems(funcs[:4], tensor_parallel=True) == [
        f"stage module {i} ({name}) is split by tensor, expert or sequence parallelism or ZeRO-3: "
        "generation runs whole modules only"
        for i, name in ((1, "LlamaDecoderLayerPipe"), (2, "LlamaDecoderLayerPipe"), (3, "LlamaDecoderLayerPipe"))
    ]


@pytest.mark.parametrize("name", ["llama", "qwen2_tied"])
def test_stages_built_for_the_chunked_loss_or_the_dense_mask_generate_alike(name):
    """The LM head built to hand its weight to the chunked loss (tied or not), the layers built with transformers'
    sdpa and masks (attention=dense_mask): the same tokens as Hugging Face's."""
    model_type, overrides = FAMILIES[name]
    hf, funcs = pair(model_type, dict(loss_chunk_tokens=64, attention="sdpa"), **overrides)
    assert assert_equals_hf(hf, funcs, [SPLITS["head_alone"]], seed=None)


def test_the_stage_config_is_put_back():
    """A generation step attends with sdpa and its masks; the stages' own attention is back after it."""
    _, funcs = pair("llama")
    config = funcs[1].self_attn.config
    before = config._attn_implementation
    generate([funcs], PROMPTS, 2, 2)
    assert config._attn_implementation == before == "sdpa_documents"
