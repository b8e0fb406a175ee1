"""Generation on the ranks of a DeepSpeed pipeline (parallel/pipeline_generation.py), each rank running only its own
stage, makes on every rank the completions of Hugging Face's ``generate`` (greedy) and of models.generation.generate
in one process (sampled, the same seed), token for token.

CPU ranks, fp32, layer files converted from a tiny random model and loaded per stage as train.py loads them: llama
and qwen3_moe on pipe 2 x data 2, each data-parallel replica with its own prompts of different lengths (some rows
stopping at EOS, others at max_new_tokens), and llama with a tied head on pipe 3 x data 1 (the head alone on the
last stage, sent one position by the norm's stage); with the default micro-batches (one per stage) and with 1, 2 and
3 chunks of rows in flight, all alike; llama on pipe 2 x tensor 2 (data 1, in the 4-rank launch), every TP rank of
every stage alike. Prompts that differ between the stages, bad arguments and DualPipeV's two pieces per rank are
refused on every rank of the pipeline.
"""

from __future__ import annotations

import json

import pytest
import torch

from models.families import family_of, load_config
from models.files.hf_convert import hf_to_stages
from models.generation import Completion, generate
from models.llama_pipe import build_sequential
from models.tiny import save_random_model, tiny_config
from parallel.partition import stage_boundaries
from tests.support.ranks import run_deepspeed
from tests.test_generation import MAX_NEW, SAMPLING, eos_for_some_rows, hf_generate
from tests.test_stage_parity import copy_hf_weights

pytestmark = pytest.mark.multirank  # starts DeepSpeed ranks

SEED = 3
MICRO_BATCHES = [1, 2, 3]
REPLICA_PROMPTS = [  # one list per data-parallel replica: different lengths within each, different batches
    [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33, 34, 35], [40, 41, 42, 43]],
    [[50, 51, 52, 53, 54], [60, 61], [70, 71, 72, 73, 74, 75, 76, 77]],
]
# (name, model_type, tiny_config overrides, stages, partition_method, ranks): each launch of `ranks` ranks runs its
# cases in one go. 3 stages split by "type:Decoder|Head": [0, 3, 6, 7], the tied LM head alone on the last stage.
CASES = [
    ("llama", "llama", {}, 2, "compute", 4),
    ("qwen3_moe", "qwen3_moe", {}, 2, "compute", 4),
    ("llama_tied_3_stages", "llama", dict(tie_word_embeddings=True), 3, "type:Decoder|Head", 3),
]


def reference(hf_dir: str, stages: int, partition: str, prompts) -> dict:
    """The split, the EOS ids and the completions the ranks must make: Hugging Face's greedy ones, and those of
    models.generation.generate sampled in one process with ``SEED`` over the split of ``stages`` by ``partition``."""
    hf = family_of(load_config(hf_dir)).causal_lm.from_pretrained(hf_dir, attn_implementation="sdpa").eval()
    funcs = build_sequential(hf.config)
    copy_hf_weights(funcs, hf.config, hf.state_dict())
    for f in funcs:
        if isinstance(f, torch.nn.Module):
            f.eval()
    bounds = stage_boundaries(hf.config, stages, partition)
    split = [funcs[a:b] for a, b in zip(bounds, bounds[1:])]

    def sampled(eos):
        return generate(split, prompts, MAX_NEW, eos, True, generator=torch.Generator().manual_seed(SEED), **SAMPLING)

    greedy_eos = eos_for_some_rows(hf_generate(hf, prompts, 2))
    sampled_eos = eos_for_some_rows(sampled(2))
    return {
        "bounds": bounds,
        "greedy_eos": greedy_eos,
        "sampled_eos": sampled_eos,
        "greedy": hf_generate(hf, prompts, greedy_eos),
        "sampled": sampled(sampled_eos),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{case name: (the references per replica, every rank's results)}: one launch per rank count."""
    root = tmp_path_factory.mktemp("pipeline_generation")
    out = {}
    for ranks in sorted({r for *_, r in CASES}, reverse=True):
        cases, refs = [], {}
        for name, model_type, overrides, stages, partition, _ in (c for c in CASES if c[-1] == ranks):
            hf_dir, ckpt = str(root / f"{name}-hf"), str(root / name)
            save_random_model(tiny_config(model_type, initializer_range=0.2, **overrides), hf_dir)
            hf_to_stages(hf_dir, ckpt)
            replicas = [reference(hf_dir, stages, partition, p) for p in REPLICA_PROMPTS[: ranks // stages]]
            refs[name] = replicas
            cases.append(
                dict(
                    name=name,
                    hf=hf_dir,
                    ckpt=ckpt,
                    stages=stages,
                    partition=partition,
                    max_new_tokens=MAX_NEW,
                    seed=SEED,
                    sampling=SAMPLING,
                    micro_batches=MICRO_BATCHES,
                    replicas=[
                        dict(prompts=p, greedy_eos=r["greedy_eos"], sampled_eos=r["sampled_eos"])
                        for p, r in zip(REPLICA_PROMPTS, replicas)
                    ],
                )
            )
        (root / f"cases{ranks}.json").write_text(json.dumps(cases))
        result = str(root / f"result{ranks}.json")
        proc = run_deepspeed(
            ranks,
            "tests/ds_scripts/generate_on_stages.py",
            [result, str(root / f"cases{ranks}.json")],
            str(root / f"log{ranks}.txt"),
        )
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        per_rank = [json.loads(open(f"{result}.{r}").read()) for r in range(ranks)]
        for name in refs:
            out[name] = (refs[name], [rank[name] for rank in per_rank])
        if ranks == 4:
            out["refused"] = [rank["refused"] for rank in per_rank]
            out["tensor_parallel"] = (refs["llama"][0], [rank["tensor_parallel"] for rank in per_rank])
    return out


def completions_of(rows) -> list[Completion]:
    return [Completion(ids, truncated) for ids, truncated in rows]


@pytest.mark.parametrize("name", [c[0] for c in CASES])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_every_rank_makes_the_one_process_completions(runs, name, mode):
    refs, ranks = runs[name]
    stages = next(c[3] for c in CASES if c[0] == name)
    assert sorted((r["replica"], r["stage"]) for r in ranks) == [
        (d, s) for d in range(len(refs)) for s in range(stages)
    ]
    for replica, ref in enumerate(refs):
        assert {c.truncated for c in ref[mode]} == {True, False}  # EOS for some rows, max_new_tokens for the others
        for rank in (r for r in ranks if r["replica"] == replica):
            stage = rank["stage"]
            assert rank["specs"] == list(range(*ref["bounds"][stage : stage + 2]))  # the split of the reference
            assert completions_of(rank[mode]) == ref[mode], (name, mode, replica, stage)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_chunks_in_flight_make_the_same_completions(runs, name):
    """1, 2 or 3 micro-batches in flight (3 for the 3 rows of the second replica: one each): the completions of the
    one-process generation, greedy and sampled, on every rank."""
    refs, ranks = runs[name]
    for rank in ranks:
        ref = refs[rank["replica"]]
        assert sorted(rank["chunked"]) == [str(m) for m in MICRO_BATCHES]
        for micro_batches, made in rank["chunked"].items():
            for mode in ("greedy", "sampled"):
                assert completions_of(made[mode]) == ref[mode], (name, mode, micro_batches, rank["stage"])


def test_what_cannot_generate_is_refused_on_every_rank_of_the_pipeline(runs):
    """Each refusal is raised on every rank of the pipeline, the same message, so that no rank waits for a stage
    that gave up (a rank's local problem is gathered over the pipe group first)."""
    refused = runs["refused"]
    for case, message in {
        "other_prompts": "generate_on_stages: stage 1 was called with other prompts or arguments than stage 0",
        "no_tokens": "generate: max_new_tokens is 0; set it to 1 or more\n"
        "generate: temperature is 0.0; set it above 0 (or do_sample=False for greedy)",
        "dualpipev": "generate_on_stages: this rank holds two pieces of the model (DualPipeV's layout): generation "
        "runs one stage per rank; set pipeline_schedule to 1f1b",
    }.items():
        assert [rank[case] for rank in refused] == [message] * 4, case


def test_tensor_parallel_stages_make_the_one_process_completions(runs):
    """pipe 2 x tensor 2 (data 1): every rank, both TP ranks of each stage, makes the llama case's first replica's
    completions (Hugging Face's greedy, the one-process sampled with the same seed), with every micro_batches."""
    ref, ranks = runs["tensor_parallel"]
    assert sorted((r["stage"], r["tp_rank"]) for r in ranks) == [(s, t) for s in range(2) for t in range(2)]
    for rank in ranks:
        stage = rank["stage"]
        assert rank["specs"] == list(range(*ref["bounds"][stage : stage + 2]))
        for mode in ("greedy", "sampled"):
            assert completions_of(rank[mode]) == ref[mode], (mode, stage, rank["tp_rank"])
            for micro_batches, made in rank["chunked"].items():
                assert completions_of(made[mode]) == ref[mode], (mode, micro_batches, stage, rank["tp_rank"])
