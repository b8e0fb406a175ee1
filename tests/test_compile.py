"""compile=true (training/compile.py): each layer of a stage torch.compile'd through DeepSpeed's engine.compile().

Fast: what it refuses (tensor and sequence parallelism, DualPipeV, LoRA, MoE models, the ZeRO 2/3 data-parallel
engine), all in one error with what to use instead; the warning on many micro-batch lengths; and packed rows of
another document layout reusing the compiled graphs (the per-document attention runs eagerly between them); DualPipeV's
deferred weight gradients breaking the graph at every linear layer (why it is refused), its gradients still right.

Multi-rank (two launches, fp32, activation checkpointing, inductor): untied at pipe 2 x data 2 on fixed-length random
tokens against the eager run (conftest's parity_pipe, the same data and settings) and the Hugging Face reference;
tied at pipe 2 on uneven SFT rows, cut to their longest row (a multiple of 8: new lengths, recompiles), against the
single-process reference; the compile-time line once, the recompile lines and metrics.jsonl's fields.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from models.llama_pipe import build_sequential
from models.tiny import tiny_config, write_uneven_sft
from parallel.layout import Layout
from tests.support.parity import (
    GLOBAL_BATCH,
    MICRO,
    PIPE,
    REL_TOL,
    STEPS,
    cached_rows,
    global_batches,
    max_rel_weight_diff,
    reference_run,
    rel,
    sft_reference_run,
    sft_train_args,
    train_args,
    trained_weights,
)
from tests.support.ranks import finish_deepspeed, start_deepspeed, train_run
from tests.support.runs import read_metrics
from tests.test_config import problems_of
from tests.test_stage_parity import packed_positions, run_chain
from training.compile import compile_problems, compile_warnings
from training.configuration.schema import DataConfig, PeftConfig, TrainConfig

COMPILED = dict(compile="true", activation_checkpoint_interval=1)


def test_compile_refuses_what_it_does_not_run_with_naming_what_to_use_instead():
    on, llama = TrainConfig(compile=True), tiny_config()
    assert compile_problems(TrainConfig(), tiny_config("qwen3_moe"), Layout(stages=1, tp=2, zero=3)) == []
    assert compile_problems(on, llama, Layout(stages=2, dp=2, zero=1)) == []
    cases = {
        "tensor_parallel 2": (Layout(stages=2, tp=2, zero=1), llama, "set tensor_parallel=1"),
        "sequence_parallel 2": (Layout(stages=2, sp=2, zero=1), llama, "set sequence_parallel=1"),
        "pipeline_schedule=dualpipev": (Layout(stages=2, schedule="dualpipev"), llama, "pipeline_schedule=1f1b"),
        "model_type qwen3_moe": (Layout(stages=2), tiny_config("qwen3_moe"), "set compile=false"),
        "ZeRO-3 and num_stages=1": (Layout(stages=1, zero=3), llama, "use ds=zero1"),
    }
    for what, (layout, config, instead) in cases.items():
        (problem,) = compile_problems(on, config, layout)
        assert what in problem and instead in problem, problem
    (lora,) = compile_problems(TrainConfig(compile=True, peft=PeftConfig(method="lora")), llama, Layout(stages=2))
    assert "peft.method=lora" in lora and "compile=false" in lora


def test_train_config_refusals_come_together_before_start(tmp_path, tiny_hf):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    cfg = TrainConfig(
        model_name_or_path=tiny_hf,
        num_stages=2,
        sequence_parallel=2,
        pipeline_schedule="dualpipev",
        gradient_accumulation_steps=4,
        compile=True,
        data=DataConfig(train_file=str(data), pad_to_multiple_of=0),
    )
    problems = problems_of(cfg, world_size=4)
    assert "compile=true with sequence_parallel 2" in problems
    assert "compile=true with pipeline_schedule=dualpipev" in problems


def test_many_micro_batch_lengths_warn_with_their_number():
    layout = Layout(stages=2)
    assert (
        compile_warnings(TrainConfig(compile=True, data=DataConfig(max_seq_length=512, pad_to_multiple_of=64)), layout)
        == []
    )
    assert compile_warnings(TrainConfig(compile=True, data=DataConfig(pad_to_multiple_of=0)), layout) == []
    assert compile_warnings(TrainConfig(data=DataConfig(pad_to_multiple_of=8)), layout) == []
    (warning,) = compile_warnings(TrainConfig(compile=True, data=DataConfig(max_seq_length=512)), layout)
    assert "up to 64 lengths" in warning and "raise data.pad_to_multiple_of" in warning


@pytest.mark.slow
def test_packed_rows_of_another_document_layout_reuse_the_compiled_graphs(dynamo_without_guard_timing):
    """The per-document attention finds documents with data-dependent Python: compiled, it runs eagerly between
    the layer's graphs, so another packing of the rows neither recompiles nor changes a number."""
    from torch._dynamo.utils import counters  # seconds to import: not at collection

    torch.manual_seed(0)
    config = tiny_config(num_hidden_layers=2)
    eager = build_sequential(config)
    compiled = build_sequential(config)
    for a, b in zip(eager, compiled):
        if isinstance(a, torch.nn.Module):
            b.load_state_dict(a.state_dict())
            b.compile(backend="eager")  # dynamo's capture alone: the graphs, guards and recompiles, no codegen
    ids = torch.randint(3, config.vocab_size, (1, 24))
    torch._dynamo.reset()
    counters.clear()
    for starts in ([0], [0, 7], [0, 5, 16], [0, 11]):
        pos = packed_positions(starts, 24)
        torch.testing.assert_close(run_chain(compiled, ids, pos), run_chain(eager, ids, pos), rtol=0, atol=0)
        if starts == [0, 7]:
            graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0 and counters["stats"]["unique_graphs"] == graphs, (graphs, counters["stats"])


@pytest.mark.slow
def test_a_layer_over_whole_rows_compiles_into_one_graph(dynamo_without_guard_timing):
    """Rows of one document each (unpacked data): the layer asks the host first and the causal SDPA call is traced
    into the layer's graph, one graph as the plain loop's compiled layer has, the same numbers as eager. Packed rows
    run the per-document attention between the layer's graphs."""
    from torch._dynamo.utils import counters  # seconds to import: not at collection

    torch.manual_seed(0)
    config = tiny_config(num_hidden_layers=1)
    eager, compiled = build_sequential(config)[1], build_sequential(config)[1]
    compiled.load_state_dict(eager.state_dict())
    compiled.compile(backend="eager")
    hidden = torch.randn(2, 24, config.hidden_size)
    for starts, graphs in (([0], 1), ([0, 7], 5)):
        torch._dynamo.reset()
        counters.clear()
        pos = packed_positions(starts, 24).expand(2, 24)
        grads = []
        for layer in (compiled, eager):
            x = hidden.clone().requires_grad_()
            out = layer((x, pos))[0]
            out.sum().backward()
            grads.append((out, x.grad))
        torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
        per_document = sum(n for reason, n in counters["graph_break"].items() if "attention_per_document" in reason)
        assert counters["stats"]["unique_graphs"] == graphs and (per_document > 0) == (graphs > 1), dict(counters)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, parity_pipe, tiny_hf, tiny_ckpt, tiny_tied_hf, tiny_tied_ckpt):
    """Two compiled launches with activation checkpointing: ``untied`` at pipe 2 x data 2 beside conftest's eager
    parity_pipe run (its data and settings), ``tied`` on uneven SFT rows at pipe 2 (2 ranks: its data-parallel copies
    would only compile the same graphs again, 40 s of a cold inductor cache on 2 cores), the two launched together."""
    root, data, samples = parity_pipe["root"], parity_pipe["data"], parity_pipe["samples"]
    sft = tmp_path_factory.mktemp("compile_sft")
    sft_data, eval_data = str(sft / "train.jsonl"), str(sft / "eval.jsonl")
    write_uneven_sft(sft_data, STEPS * GLOBAL_BATCH, seed=0)
    write_uneven_sft(eval_data, 16, seed=1)
    sft_args = sft_train_args(
        tiny_tied_ckpt,
        sft_data,
        eval_data,
        str(sft / "tied"),
        num_stages=2,
        gradient_accumulation_steps=8,
        ds_config="zero1",
        eval_steps=2,  # eval's first pass (no gradients) compiles after step 2: counted at step 3
        **COMPILED,
    )
    # Both at once: a pipeline's stages compile one after the other, so each launch alone leaves a core idle for
    # part of its compiling (about 20 s of the 2 cores here).
    tied_job = start_deepspeed(2, "train.py", sft_args)
    args = train_args(tiny_ckpt, data, str(root / "compiled"), **PIPE, **COMPILED)
    untied = train_run(root, "compiled", 4, args)
    tied = finish_deepspeed(tied_job, str(sft / "tied.log"))
    assert tied.returncode == 0, (tied.stdout + tied.stderr)[-4000:]
    steps, _, _ = global_batches(cached_rows(str(sft / "cache"), sft_data), dp=1, gas=8, steps=STEPS)
    tied_losses, tied_model = sft_reference_run(tiny_tied_hf, steps, "tokens")
    ref_losses, _, _, _ = reference_run(tiny_hf, samples, global_batch=MICRO * 4)
    return dict(
        root=root,
        sft=sft,
        untied=untied,
        tied=tied,
        ref_losses=ref_losses,
        tied_losses=tied_losses,
        tied_model=tied_model,
    )


@pytest.mark.multirank
def test_compiled_pipe_x_data_equals_eager_and_the_reference(runs):
    compiled = read_metrics(str(runs["root"] / "compiled"))
    eager = read_metrics(str(runs["root"] / "pipe"))
    assert [m["step"] for m in compiled] == [m["step"] for m in eager] == list(range(1, STEPS + 1))
    vs_eager = max(rel(c["loss"], e["loss"]) for c, e in zip(compiled, eager))
    vs_ref = max(rel(c["loss"], r) for c, r in zip(compiled, runs["ref_losses"]))
    norms = max(rel(c["grad_norm"], e["grad_norm"]) for c, e in zip(compiled, eager))
    print(f"untied compiled vs eager: loss {vs_eager:.2e}, grad norm {norms:.2e}; vs reference: loss {vs_ref:.2e}")
    assert vs_eager < REL_TOL and vs_ref < REL_TOL and norms < REL_TOL


@pytest.mark.multirank
def test_compiled_tied_run_with_new_lengths_equals_the_reference(runs):
    tied = read_metrics(str(runs["sft"] / "tied"))
    assert [m["step"] for m in tied] == list(range(1, STEPS + 1))
    loss_diff = max(rel(m["loss"], r) for m, r in zip(tied, runs["tied_losses"]))
    weights = max_rel_weight_diff(
        trained_weights(str(runs["sft"] / "tied"), runs["tied_model"].config), runs["tied_model"]
    )
    print(f"tied compiled, uneven rows vs reference: loss {loss_diff:.2e}, weights {weights:.2e} relative L2")
    assert loss_diff < REL_TOL and weights < REL_TOL


@pytest.mark.multirank
def test_compile_time_is_said_once_and_recompiles_are_counted(runs):
    for name in ("untied", "tied"):
        out = runs[name].stdout
        (first,) = re.findall(r"\[train\] compile: step 1 compiled .*: (\d+) graphs, ([\d.]+) s compiling", out)
        assert int(first[0]) > 0 and float(first[1]) > 0, out[-3000:]
    # fixed-length rows: nothing recompiled in training
    untied = read_metrics(str(runs["root"] / "compiled"))
    assert all(m["recompiles"] == 0 for m in untied) and untied[-1]["compile_s"] > 0
    # rows cut to their longest (data.pad_to_multiple_of 8): step 1 meets several lengths, the length becomes dynamic
    # there; graphs compiled later (eval's first pass after step 2) are counted, and said when the count grows
    tied = read_metrics(str(runs["sft"] / "tied"))
    counts = [m["recompiles"] for m in tied]
    assert counts[0] == 0 and counts[-1] > 0 and counts == sorted(counts), counts
    lines = re.findall(r"\[train\] compile: (\d+) graphs recompiled since step 1", runs["tied"].stdout)
    assert [int(n) for n in lines] == sorted(set(counts) - {0}), (lines, counts)
    assert (
        "warning: compile=true with data.pad_to_multiple_of 8: micro-batches come in up to 16 lengths"
        in runs["tied"].stdout
    )


@pytest.mark.slow
def test_dualpipev_deferred_weight_gradients_break_the_graph_at_every_linear_layer(dynamo_without_guard_timing):
    """Why compile=true refuses DualPipeV: its linear layers queue their weight gradients from inside their backward,
    which dynamo does not trace, so every one of them breaks the graph and runs eagerly (the gradients stay right)."""
    from torch._dynamo.utils import counters  # seconds to import: not at collection

    from parallel.dualpipev import WeightGradStore, defer_linear_weights_

    torch.manual_seed(0)
    config = tiny_config(num_hidden_layers=1)
    layer, plain = build_sequential(config)[1], build_sequential(config)[1]
    plain.load_state_dict(layer.state_dict())
    store = WeightGradStore()
    linears = defer_linear_weights_([layer], store)
    layer.compile(backend="eager")
    torch._dynamo.reset()
    counters.clear()
    hidden, pos = torch.randn(1, 16, config.hidden_size), torch.arange(16)[None]
    store.deferring = True
    layer((hidden, pos))[0].sum().backward()
    store.deferring = False
    store.flush()
    store.pop()
    plain((hidden, pos))[0].sum().backward()
    for (name, p), q in zip(layer.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    breaks = sum(n for reason, n in counters["graph_break"].items() if "side effect" in reason.lower())
    print(f"{linears} deferred linear layers, {breaks} graph breaks on their side effect")
    assert linears == 7 and breaks >= linears, dict(counters["graph_break"])
