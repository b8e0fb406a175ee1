"""DualPipeV (pipeline_schedule=dualpipev) trains what Hugging Face trains, and resumes across schedules.

Fast tier: the refusals, each naming its knob; the specs each rank holds (two pieces, the embedding and the
LM head on the first rank); which ranks read data.

Multi-rank (CPU ranks, fp32, 5 steps, packed SFT rows, clipping on at 0.5 (below every step's norm, so every
step is clipped), the loss normalised per label token of the global batch, against the family's
ForCausalLM + AdamW + clip_grad_norm_ on the same global batches, Trainer's ``num_items_in_batch``):
  pipe 2 x data 2 (4 ranks; Llama with tied embeddings, one module on rank 0; ZeRO-1; chunked loss;
  activation checkpointing; eval on the held-out file; checkpoints at steps 3 and 5);
  pipe 4 (4 ranks, 8 pieces split by the planner's predicted peaks, partition_method=memory; Qwen2, untied, 8
  decoder layers; ZeRO-0, whose gradient norm covers every piece);
  pipe 2 (2 ranks, grad_acc 4, ZeRO-1) for two families of 2026: Gemma 3 (gemma3_text: its scaled embedding and
  unscaled tied head one module on rank 0, sliding and full layers; activation checkpointing) and Qwen3.5
  (qwen3_5_text: Gated DeltaNet layers and a full one, their linear layers' weight gradients deferred; unpacked rows).
Per-step loss, the logged (pre-clip) gradient norm, the eval loss and the trained weights within 1e-6 (Gemma 3's
element by element); the pipe 2 x data 2 run's step-3 checkpoint resumed under 1F1B (a layout change: optimizer
states read per parameter) continues it exactly. tests/test_sft_parity.py resumes a 1F1B run's checkpoint under
DualPipeV.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from models.files.hf_convert import hf_to_stages
from parallel.layout import Layout
from tests.support.models import make_hf_dir
from tests.support.parity import (
    GLOBAL_BATCH,
    STEPS,
    cached_rows,
    eval_losses,
    global_batches,
    max_rel_weight_diff,
    rel,
    sft_reference_run,
    sft_train_args,
    trained_weights,
)
from tests.support.ranks import train_run
from tests.support.runs import read_metrics
from tests.test_config import good, problems_of  # noqa: F401 (a fixture)
from tests.test_profile import check_profiled_run
from tests.test_sequence_parallel import assert_gemma3_weights_near
from training.configuration.schema import ConfigError
from training.configuration.validate import resolve

REL_TOL = 1e-6
CLIP = 0.5
DUALPIPEV = {"pipeline_schedule": "dualpipev", "data.pad_to_multiple_of": 0, "data.packing": "true"}


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(gradient_accumulation_steps=3), "gradient_accumulation_steps >= 2 x num_stages = 4"),
        (dict(num_stages=1), "DualPipeV needs 2 pipeline ranks or more"),
        (dict(num_stages=4, gradient_accumulation_steps=8), "more than its 4 decoder layers: set num_stages <= 2"),
        ({"data.pad_to_multiple_of": 8}, "set data.pad_to_multiple_of=0"),
        (dict(tensor_parallel=2), "tensor_parallel 2 is not supported yet"),
        (dict(sequence_parallel=2), "sequence_parallel 2 is not supported yet"),
        (dict(pipeline_schedule="gpipe"), "pipeline_schedule 'gpipe' unknown: choose one of ['1f1b', 'dualpipev']"),
    ],
)
def test_what_dualpipev_does_not_run_with_is_refused(good, change, message):  # noqa: F811
    cfg = dataclasses.replace(good, pipeline_schedule="dualpipev", num_stages=2, gradient_accumulation_steps=4)
    cfg.data.pad_to_multiple_of = 0
    for key, value in change.items():
        if key.startswith("data."):
            setattr(cfg.data, key[5:], value)
        else:
            cfg = dataclasses.replace(cfg, **{key: value})
    with pytest.raises(ConfigError) as err:  # the values the test sets are the user's: refused, not adapted
        resolve(cfg, world_size=8, given=set(change))
    assert message in str(err.value), str(err.value)


def test_a_valid_dualpipev_config_resolves(good):  # noqa: F811
    cfg = dataclasses.replace(good, pipeline_schedule="dualpipev", num_stages=2, gradient_accumulation_steps=4)
    cfg.data.pad_to_multiple_of = 0
    resolved = resolve(cfg, world_size=4)
    assert resolved.layout.pieces == 4 and resolved.warnings == []


def test_a_dualpipev_rank_holds_its_piece_and_the_mirror():
    layout = Layout(stages=4, schedule="dualpipev", grad_accum=8)
    assert layout.pieces == 8
    assert [layout.rank_pieces(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert Layout(stages=4).rank_pieces(1) == [1] and "pipe 4 (DualPipeV)" in layout.axes()


@pytest.fixture(scope="module")
def dpv_runs(tmp_path_factory, tiny_tied_hf, tiny_tied_ckpt, tokenizer_dir):
    from models.tiny import write_uneven_sft

    root = tmp_path_factory.mktemp("dualpipev")
    data, eval_data = str(root / "train.jsonl"), str(root / "eval.jsonl")
    write_uneven_sft(data, 4 * STEPS * GLOBAL_BATCH, seed=0)  # packed: a row holds several examples
    write_uneven_sft(eval_data, 96, seed=1)  # packed rows for 4 micro-batches of 2 per rank at dp 2, 8 at dp 1
    qwen = make_hf_dir(root, tokenizer_dir, "hf_qwen2", model_type="qwen2", num_hidden_layers=8)
    gemma3 = make_hf_dir(root, tokenizer_dir, "hf_gemma3", model_type="gemma3_text", tie_word_embeddings=True)
    qwen3_5 = make_hf_dir(root, tokenizer_dir, "hf_qwen3_5", model_type="qwen3_5_text")  # layers 0-2 linear, 3 full
    ckpts = {"ckpt_tied": tiny_tied_ckpt}  # read only
    for name, hf_dir in (("qwen", qwen), ("gemma3", gemma3), ("qwen3_5", qwen3_5)):
        ckpts[f"ckpt_{name}"] = str(root / f"ckpt_{name}")
        hf_to_stages(hf_dir, ckpts[f"ckpt_{name}"])

    def launch(name: str, ckpt: str, ranks: int = 4, **overrides):
        args = sft_train_args(ckpts[ckpt], data, eval_data, str(root / name), **overrides)
        return args, train_run(root, name, ranks, args).stdout

    common = {**DUALPIPEV, "optim.max_grad_norm": CLIP}
    args, log = launch(
        "pipe2_dp2",
        "ckpt_tied",
        num_stages=2,
        gradient_accumulation_steps=4,
        ds_config="zero1",
        loss_chunk_tokens=48,
        activation_checkpoint_interval=1,
        save_steps=3,
        save_async="true",  # step 3's checkpoint, resumed below, written in the background
        **common,
    )
    _, deep_log = launch(
        "pipe4",
        "ckpt_qwen",
        num_stages=4,
        gradient_accumulation_steps=8,
        ds_config="zero0",
        partition_method="memory",
        profile_steps="[4,5]",  # tests/test_profile.py's checks of a DualPipeV profile (same losses, ranges only)
        **common,
    )
    # Families of 2026 on pipe 2 (2 ranks): Gemma 3 with activation checkpointing; Qwen3.5 on unpacked rows (Hugging
    # Face's torch DeltaNet runs its state on across a packed row's documents, where the stages restart it)
    unpacked = {"data.packing": "false", "data.cache_dir": str(root / "cache_unpacked")}
    for name, extra in (("gemma3", {"activation_checkpoint_interval": 1}), ("qwen3_5", unpacked)):
        pipe2 = dict(num_stages=2, gradient_accumulation_steps=4, ds_config="zero1", loss_chunk_tokens=48)
        launch(f"{name}_pipe2", f"ckpt_{name}", 2, **pipe2, **{**common, **extra})
    results = {}
    for name, hf_dir, dp, gas, cache in (
        ("pipe2_dp2", tiny_tied_hf, 2, 4, "cache"),
        ("pipe4", qwen, 1, 8, "cache"),
        ("gemma3_pipe2", gemma3, 1, 4, "cache"),
        ("qwen3_5_pipe2", qwen3_5, 1, 4, "cache_unpacked"),
    ):
        rows, eval_rows = cached_rows(str(root / cache), data), cached_rows(str(root / cache), eval_data)
        steps = global_batches(rows, dp=dp, gas=gas, steps=STEPS)[0]
        norms: list[float] = []
        losses, model = sft_reference_run(hf_dir, steps, "tokens", norms, max_grad_norm=CLIP)
        results[name] = dict(losses=losses, norms=norms, model=model, eval=eval_losses(model, eval_rows, dp)[0])
    return dict(root=root, results=results, args=args, logs={"pipe2_dp2": log, "pipe4": deep_log})


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["pipe2_dp2", "pipe4", "gemma3_pipe2", "qwen3_5_pipe2"])
def test_dualpipev_trains_what_hugging_face_trains(dpv_runs, name):
    root, ref = dpv_runs["root"], dpv_runs["results"][name]
    metrics = read_metrics(str(root / name))
    assert len(metrics) == STEPS and min(ref["norms"]) > CLIP, ref["norms"]  # every step clipped
    diffs = [rel(m["loss"], r) for m, r in zip(metrics, ref["losses"])]
    # ZeRO-1 logs the pre-clip norm; ZeRO-0 keeps none (n/a), its clipping shows in the losses and weights
    norm_diffs = [rel(m["grad_norm"], r) for m, r in zip(metrics, ref["norms"]) if m["grad_norm"] is not None]
    assert len(norm_diffs) == (0 if name == "pipe4" else STEPS)
    (evaluation,) = read_metrics(str(root / name), "eval")[-1:]
    eval_diff = rel(evaluation["eval_loss"], ref["eval"])
    weights = trained_weights(str(root / name), ref["model"].config)
    weight_diff = max_rel_weight_diff(weights, ref["model"])
    print(
        f"[{name}] largest relative difference: loss {max(diffs):.1e}, grad norm {max(norm_diffs, default=0):.1e}, "
        f"eval {eval_diff:.1e}, weights {weight_diff:.1e}"
    )
    assert max(diffs) < REL_TOL and max(norm_diffs, default=0) < REL_TOL, (diffs, norm_diffs)
    assert eval_diff < REL_TOL
    if name.startswith("gemma3"):
        assert_gemma3_weights_near(weights, ref["model"])  # measured 4.6e-6 relative, single elements
    else:
        assert weight_diff < REL_TOL


@pytest.mark.multirank
def test_only_the_first_pipeline_rank_reads_data_and_holds_both_ends(dpv_runs):
    log = dpv_runs["logs"]["pipe2_dp2"]
    assert "engine: LlamaDualPipeVEngine" in log and "world 4 = pipe 2 (DualPipeV) x data 2" in log
    # rank 0: 1 decoder layer of the 4 (7 linear layers each), 2 with rank 2's: the tied head is no nn.Linear
    assert "zero bubble: the weight gradients of 14, 14, 14, 14 linear layers (per rank) deferred where" in log
    # 5 specs of the tied model's 7 on rank 0: the embedding's piece and the piece ending in the LM head
    assert "rank 0: stage 0 specs 0..1, 4..6" in log and "rank 2: stage 1 specs 2..3" in log
    for rank in (0, 1):
        assert f"rank {rank}: data builds + reads" in log or f"rank {rank}: data reads" in log
    for rank in (2, 3):
        assert f"rank {rank}: data placeholder" in log
    deep = dpv_runs["logs"]["pipe4"]
    assert "rank 0: data builds + reads" in deep and all(f"rank {r}: data placeholder" in deep for r in (1, 2, 3))


@pytest.mark.multirank
def test_a_profiled_dualpipev_step_shows_every_instruction(dpv_runs):
    """The pipe 4 run's profile_steps=[4,5]: every rank's trace and the drawn step (tests/test_profile.py)."""
    print(check_profiled_run(str(dpv_runs["root"] / "pipe4"), ranks=4, steps=(4, 5), micro_batches=8, dualpipev=True))


@pytest.mark.multirank
def test_a_dualpipev_checkpoint_resumes_under_1f1b(dpv_runs, tmp_path):
    """Back from DualPipeV: the pipe 2 x data 2 run's step-3 checkpoint under 1F1B (rank 0 held specs 0..1 and
    4..6, now stage 0 holds 0..3): steps 4 and 5 and the final weights as the uninterrupted run's."""
    root = dpv_runs["root"]
    out = tmp_path / "resumed"
    shutil.copytree(root / "pipe2_dp2", out)
    shutil.rmtree(out / "global_step5")
    (out / "latest").write_text("global_step3")
    args = [a for a in dpv_runs["args"] if not a.startswith(("output_dir=", "pipeline_schedule="))]
    args += [f"output_dir={out}", "pipeline_schedule=1f1b"]
    proc = train_run(tmp_path, "resumed", 4, args)
    assert "was saved on another layout (pipeline_schedule 'dualpipev' -> '1f1b')" in proc.stdout
    straight = {m["step"]: m["loss"] for m in read_metrics(str(root / "pipe2_dp2"))}
    resumed = [m for m in read_metrics(str(out)) if m["step"] > 3]
    assert [m["step"] for m in resumed] == [4, 5]
    assert all(rel(m["loss"], straight[m["step"]]) < REL_TOL for m in resumed), resumed
    model = dpv_runs["results"]["pipe2_dp2"]["model"]
    assert max_rel_weight_diff(trained_weights(str(out), model.config), model) < REL_TOL


@pytest.mark.parametrize("stages, micro_batches", [(2, 4), (2, 8), (3, 6), (4, 8), (4, 16)])
def test_the_zero_bubble_schedule_is_deepspeeds_with_the_weights_split_off(stages, micro_batches):
    from deepspeed.runtime.pipe.schedule import BackwardPass, DualPipeVSchedule

    from parallel.dualpipev import WeightPass, ZeroBubbleDualPipeVSchedule

    def names(cmds):
        return [(type(c).__name__, c.kwargs.get("buffer_id"), c.kwargs.get("phase")) for c in cmds]

    for rank in range(stages):
        theirs = [c for s in DualPipeVSchedule(micro_batches, stages, rank).steps() for c in s]
        ours = [c for s in ZeroBubbleDualPipeVSchedule(micro_batches, stages, rank).steps() for c in s]
        assert names([c for c in ours if not isinstance(c, WeightPass)]) == names(theirs)
        pending = 0
        for c in ours:  # every WeightPass has a deferred backward to compute, and none is left over
            pending += bool(isinstance(c, BackwardPass) and c.kwargs.get("defer_weights"))
            pending -= isinstance(c, WeightPass)
            assert pending >= 0
        assert pending == 0 and any(isinstance(c, WeightPass) for c in ours)


@pytest.mark.parametrize("micro_batches", [4, 8])
def test_zero_bubble_halves_the_1f1b_bubble_in_the_simulation(micro_batches):
    """Pipe 2, equal pieces, backward twice the forward, half of it weight gradients (the decoder's matmuls):
    DeepSpeed's DualPipeV alone keeps 0.71 / 0.69 of 1F1B's bubble; with the weights split off, under half."""
    from parallel.schedule_sim import simulate

    one_f = simulate("1f1b", 2, micro_batches, [2.0] * 2, [4.0] * 2).idle_share
    plain = simulate("dualpipev", 2, micro_batches, [1.0] * 4, [2.0] * 4).idle_share
    split = simulate("dualpipev", 2, micro_batches, [1.0] * 4, [2.0] * 4, [1.0] * 4).idle_share
    assert one_f == pytest.approx(1 / (micro_batches + 1))
    assert 0.6 < plain / one_f < 0.75 and split / one_f < 0.5, (one_f, plain, split)


def test_deferred_weight_gradients_equal_autograds():
    """A decoder layer's linear layers routed through DeferrableLinear: while deferring, its inputs' and the norms'
    gradients as autograd's and no projection weight gradient; after the WeightPass, all of them."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from models.tiny import tiny_config
    from parallel.dualpipev import WeightGradStore, defer_linear_weights_

    config = tiny_config(attn_implementation="sdpa")
    torch.manual_seed(0)
    layers = [LlamaDecoderLayer(config, 0) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(2, 16, config.hidden_size)
    positions = torch.arange(16).expand(2, 16)
    rotary = LlamaRotaryEmbedding(config)(x, positions)

    def backward(layer):
        inputs = x.clone().requires_grad_()
        out = layer(inputs, position_embeddings=rotary, position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
        return inputs.grad

    store = WeightGradStore()
    assert defer_linear_weights_([layers[1]], store) == 7  # q, k, v, o, gate, up, down
    expected = backward(layers[0])
    store.deferring = True
    got = backward(layers[1])
    store.deferring = False
    store.flush()
    assert torch.allclose(got, expected, atol=1e-6)
    assert layers[1].self_attn.q_proj.weight.grad is None and layers[1].input_layernorm.weight.grad is not None
    store.pop()
    for (name, ref), (_, p) in zip(layers[0].named_parameters(), layers[1].named_parameters()):
        assert torch.allclose(p.grad, ref.grad, rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("stages, micro_batches", [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16)])
def test_deferring_the_weights_raises_no_rank_s_peak_of_held_micro_batches(stages, micro_batches):
    """The planner's DualPipeV activation memory stands: counting a deferred backward's micro-batch as held until
    its WeightPass (its linear layers' inputs and output gradients wait there), no rank holds more at once."""
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass

    from parallel.dualpipev import WeightPass
    from parallel.schedule_sim import instructions

    for rank in range(stages):
        peaks = []
        for zero_bubble in (False, True):
            held, peak, deferred = [0, 0], 0, []
            for c in instructions("dualpipev", stages, micro_batches, rank, zero_bubble):
                if isinstance(c, ForwardPass):
                    held[c.phase] += 1
                    peak = max(peak, sum(held))
                elif isinstance(c, BackwardPass) and c.kwargs.get("defer_weights"):
                    deferred.append(c.phase)
                elif isinstance(c, BackwardPass):
                    held[c.phase] -= 1
                elif isinstance(c, WeightPass):
                    held[deferred.pop(0)] -= 1
            peaks.append(peak)
        assert peaks[0] == peaks[1] == 2 * stages + 1, peaks
