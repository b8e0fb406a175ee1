"""deepspeed train.py, pipe 2 x data 2 on 4 CPU ranks, trains exactly what Hugging Face would.

Five fp32 steps on fixed data (shuffle off) are compared with a single-process reference loop
(LlamaForCausalLM + torch.optim.AdamW + clip_grad_norm_) on the same global batches, with a
1-rank num_stages=1 run, and with pipe 4 x data 1 under ZeRO-1 (two middle stages on placeholder data, the
last stage holding only the LM head). The trained
checkpoint is exported to Hugging Face and compared weight by weight with the DeepSpeed layer files and
with the reference model. Activation checkpointing is compared with a reference in
tests/test_family_training.py (the Mistral run), and counted recomputing in tests/test_training_loop.py.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from transformers import LlamaForCausalLM

from models.files.pipeline_dir import load_layer_file, read_tag
from models.llama_pipe import layer_file_name, spec_layout
from tests.support.parity import (
    DATA_PARALLEL_CONFIGS,
    MICRO,
    OPTIM,
    REL_TOL,
    STEPS,
    WEIGHT_BOUND,
    beyond_bound,
    reference_run,
    rel,
    train_args,
)
from tests.support.ranks import train_run
from tests.support.runs import read_metrics
from tests.support.scripts import run_script
from tests.test_convert import hf_tensors

pytestmark = pytest.mark.multirank  # starts DeepSpeed ranks


@pytest.fixture(scope="module")
def runs(parity_pipe, tiny_hf, tiny_tied_hf, tiny_ckpt, tiny_tied_ckpt):
    # Same global batch of 8 everywhere: micro 2 x grad_acc x dp. The pipe 2 x data 2 run, ZeRO-1, is
    # conftest's parity_pipe (tests/test_multinode.py compares two simulated nodes with it); the others
    # train beside it, on its data.
    root, data, samples, pipe = (parity_pipe[k] for k in ("root", "data", "samples", "proc"))
    ckpts = {"ckpt": tiny_ckpt, "ckpt_tied": tiny_tied_ckpt}  # read only

    def launch(name: str, ranks: int, ckpt: str, **overrides):
        return train_run(root, name, ranks, train_args(ckpts[ckpt], data, str(root / name), **overrides))

    launch("single", 1, "ckpt", num_stages=1, gradient_accumulation_steps=4, ds_config="zero0")
    # Four stages on four ranks: stages 1 and 2 are middle stages with placeholder data. uniform splits
    # the 7 specs 2-2-2-1: the last stage holds only the LM head, hence one AdamW group where the others
    # hold two (ZeRO-1 used to hang there, training/optim.reduce_grad_norm_once_across_stages).
    launch(
        "deep",
        4,
        "ckpt",
        num_stages=4,
        gradient_accumulation_steps=4,
        ds_config="zero1",
        partition_method="uniform",
        count_step_memory="true",
    )
    # ZeRO-1 with the optimizer offloaded to the host (DeepSpeed's CPU Adam).
    offload = launch("offload", 4, "ckpt", num_stages=2, gradient_accumulation_steps=2, ds="zero1_offload")
    assert "optimizer DeepSpeedCPUAdam (offload: cpu)" in offload.stdout
    # num_stages=1 with ZeRO 2/3 (with and without offload): DeepSpeed's data-parallel engine, dp 2.
    for ds in DATA_PARALLEL_CONFIGS:
        dp_run = launch(ds, 2, "ckpt", num_stages=1, gradient_accumulation_steps=2, ds=ds)
        assert "engine: DeepSpeedEngine, ZeRO stage" in dp_run.stdout
    # Tied embeddings: the shared weight lives on the first and the last stage.
    launch("tied", 4, "ckpt_tied", num_stages=2, gradient_accumulation_steps=2, ds_config="zero0")
    ref_losses, ref_lrs, ref_norms, ref_model = reference_run(tiny_hf, samples, global_batch=MICRO * 4)
    tied_losses, _, _, _ = reference_run(tiny_tied_hf, samples, global_batch=MICRO * 4)
    unclipped_losses, _, _, _ = reference_run(tiny_hf, samples, global_batch=MICRO * 4, max_grad_norm=0.0)
    return dict(
        root=root,
        pipe=pipe,
        ref_losses=ref_losses,
        ref_lrs=ref_lrs,
        ref_norms=ref_norms,
        ref_model=ref_model,
        hf=tiny_hf,
        tied_losses=tied_losses,
        unclipped_losses=unclipped_losses,
    )


def test_pipe_x_data_losses_equal_reference_and_single_rank(runs):
    pipe = read_metrics(str(runs["root"] / "pipe"))
    single = read_metrics(str(runs["root"] / "single"))
    deep = read_metrics(str(runs["root"] / "deep"))
    assert [m["step"] for m in pipe] == [m["step"] for m in deep] == list(range(1, STEPS + 1))
    for p, s, d, ref, lr in zip(pipe, single, deep, runs["ref_losses"], runs["ref_lrs"]):
        assert rel(p["loss"], ref) < REL_TOL, (p["step"], p["loss"], ref)
        assert rel(s["loss"], ref) < REL_TOL, (s["step"], s["loss"], ref)
        assert rel(d["loss"], ref) < REL_TOL, (d["step"], d["loss"], ref)
        assert rel(p["loss"], s["loss"]) < REL_TOL
        assert p["lr"] == pytest.approx(lr, rel=1e-12)
    print(
        "max relative loss difference: pipe2xdata2 vs reference "
        f"{max(rel(p['loss'], r) for p, r in zip(pipe, runs['ref_losses'])):.2e}, 1-rank vs reference "
        f"{max(rel(s['loss'], r) for s, r in zip(single, runs['ref_losses'])):.2e}, pipe4 vs reference "
        f"{max(rel(d['loss'], r) for d, r in zip(deep, runs['ref_losses'])):.2e}"
    )
    offload = read_metrics(str(runs["root"] / "offload"))
    offload_diff = max(rel(o["loss"], r) for o, r in zip(offload, runs["ref_losses"]))
    print(f"max relative loss difference, ZeRO-1 + CPU offload pipe2xdata2 vs reference: {offload_diff:.2e}")
    assert len(offload) == STEPS and offload_diff < REL_TOL
    for ds in DATA_PARALLEL_CONFIGS:
        diff = max(rel(m["loss"], r) for m, r in zip(read_metrics(str(runs["root"] / ds)), runs["ref_losses"]))
        print(f"max relative loss difference, {ds} (num_stages=1, data parallel 2) vs reference: {diff:.2e}")
        assert diff < REL_TOL, ds
    tied = read_metrics(str(runs["root"] / "tied"))
    tied_diff = max(rel(t["loss"], r) for t, r in zip(tied, runs["tied_losses"]))
    print(f"max relative loss difference, tied embeddings pipe2xdata2 vs reference: {tied_diff:.2e}")
    assert len(tied) == STEPS and tied_diff < REL_TOL
    # The comparison is over a run that changes the model: the first steps moved the weights by
    # about lr x steps, far above the tolerance of the export check below.
    initial = LlamaForCausalLM.from_pretrained(runs["hf"], dtype=torch.float32).state_dict()
    moved = max((runs["ref_model"].state_dict()[k] - v).abs().max().item() for k, v in initial.items())
    assert moved > 1e-3, moved


def test_clipping_caps_the_gradient_norm(runs):
    """The logged pre-clip norms exceed max_grad_norm, and the runs follow the clipped reference
    (within REL_TOL, checked above), not the unclipped one: DeepSpeed capped the norm the way
    clip_grad_norm_ does. Adam is nearly invariant to gradient scale, so the unclipped trajectory
    is close (measured 9e-6), yet outside the tolerance: the parity checks would catch missing clipping."""
    pipe = read_metrics(str(runs["root"] / "pipe"))
    assert all(m["grad_norm"] > OPTIM["max_grad_norm"] for m in pipe)
    assert max(rel(p["loss"], u) for p, u in zip(pipe, runs["unclipped_losses"])) > 2 * REL_TOL


@pytest.mark.parametrize("name", ["pipe", "deep", "offload", "zero2", "zero3"])
def test_logged_gradient_norm_is_the_reference_norm_over_every_stage(runs, name):
    """The pre-clip norm DeepSpeed logs (ZeRO keeps it; ZeRO-0 logs n/a) is the whole model's: every
    stage's parameters, each counted once. Leaving out the smallest stage, the LM head alone of "deep",
    would be off by far more than the tolerance (asserted)."""
    metrics = read_metrics(str(runs["root"] / name))
    diff = max(rel(m["grad_norm"], total) for m, (total, _) in zip(metrics, runs["ref_norms"]))
    without_head = min(rel((total**2 - head**2) ** 0.5, total) for total, head in runs["ref_norms"])
    print(f"{name}: logged grad norm vs reference: {diff:.2e} relative (without the LM head: {without_head:.2e})")
    assert len(metrics) == STEPS and diff < 1e-5 < without_head / 100


def test_step_memory_is_counted_on_every_rank(runs):
    """count_step_memory=true: each rank reports its second step's peak of allocated tensors, at least
    the gradients of its stage's parameters (fp32), which backward allocates within the step."""
    log = (runs["root"] / "deep.log").read_text()
    line = next(line for line in log.splitlines() if "step 2 peak of allocated tensors above its start" in line)
    peaks = [float(x) for x in re.findall(r"rank \d+ ([\d.]+)", line)]
    params = [float(x) for x in re.findall(r"rank \d+: stage \d+ specs \S+ \(\d+ specs, ([\d.]+) M params\)", log)]
    assert len(peaks) == len(params) == 4
    assert all(peak >= p * 1e6 * 4 / 2**20 for peak, p in zip(peaks, params)), (peaks, params)


def test_final_figures_are_the_last_metrics_record_as_printed(runs):
    """The figures train.py prints last (peak memory, model states, with count_step_memory the second step's peak)
    are also metrics.jsonl's last record: one entry per rank, positive, the numbers the lines print."""
    out, log = str(runs["root"] / "deep"), (runs["root"] / "deep.log").read_text()
    with open(os.path.join(out, "metrics.jsonl")) as f:
        last = json.loads(f.readlines()[-1])
    assert read_metrics(out, "final") == [last] and last["step"] == STEPS

    def printed(marker: str, pattern: str) -> list[tuple]:
        return re.findall(pattern, next(line for line in log.splitlines() if marker in line))

    peaks, states, step_peaks = last["peak_memory_mib"], last["model_states_mib"], last["step_peak_mib"]
    assert len(peaks) == len(states) == len(step_peaks) == 4 and last["step_peak_at"] == 2
    assert all(v > 0 for p in peaks for v in p.values()) and all(s["total"] > 0 for s in states)
    assert all(p > 0 for p in step_peaks)
    assert printed("peak memory per rank", r"rank \d+ host (\d+)(?: / GPU (\d+))?") == [
        (f"{p['host']:.0f}", f"{p['gpu']:.0f}" if "gpu" in p else "") for p in peaks
    ]
    roles = ("weights", "grads", "optimizer", "total")
    assert printed("model states per rank", r"rank \d+ ([\d.]+) \+ ([\d.]+) \+ ([\d.]+) = ([\d.]+)") == [
        tuple(f"{s[role]:.2f}" for role in roles) for s in states
    ]
    assert printed("step 2 peak of allocated tensors", r"rank \d+ ([\d.]+)") == [f"{p:.1f}" for p in step_peaks]


def test_progress_is_announced_and_logged_once_per_step(runs):
    out = runs["pipe"].stdout
    assert "world 4 = pipe 2 x data 2" in out and "256 tokens/step" in out
    for rank in range(4):
        assert f"rank {rank}: stage {rank // 2} specs" in out
    assert sum(line.startswith("step ") for line in out.splitlines()) == STEPS  # one rank logs
    deep = (runs["root"] / "deep.log").read_text()
    assert "rank 1: data placeholder" in deep and "rank 2: data placeholder" in deep  # middle stages read nothing
    assert "rank 0: data builds + reads" in deep and "rank 3: data reads" in deep


def test_hf_export_holds_exactly_the_trained_weights(runs):
    out, hf_out = str(runs["root"] / "pipe"), str(runs["root"] / "exported")
    proc = run_script(["convert2ckpt.py", "--to-hf", "--input", out, "--output", hf_out])
    assert proc.returncode == 0, proc.stderr
    exported = hf_tensors(hf_out)
    config = LlamaForCausalLM.config_class.from_pretrained(hf_out)
    tag = read_tag(out)
    assert tag == f"global_step{STEPS}"
    for info in spec_layout(config):
        if info.owns_file:
            for key, tensor in load_layer_file(os.path.join(out, tag, layer_file_name(info.index))).items():
                assert torch.equal(exported[info.hf_prefix + key], tensor), info.hf_prefix + key

    model = LlamaForCausalLM.from_pretrained(hf_out, dtype=torch.float32)
    ref_state = runs["ref_model"].state_dict()
    bound = WEIGHT_BOUND
    worst, off, total = beyond_bound(model.state_dict(), ref_state)
    print(
        f"exported pipe2xdata2 model vs reference loop: max abs weight difference {worst:.2e}, "
        f"{off} of {total} weights beyond 5% of lr"
    )
    # The ZeRO-3 run's layer files hold the full (gathered) trained weights too.
    zero3 = load_layer_file(os.path.join(runs["root"], "zero3", tag, layer_file_name(1)))  # model.layers.0
    for k in zero3:
        torch.testing.assert_close(zero3[k], ref_state[f"model.layers.0.{k}"], rtol=0, atol=bound, msg=k)
    # Same training as the reference loop up to fp32 reduction order. Adam turns that noise into weight
    # differences where a gradient element is near eps (update sensitivity ~ lr / 4 eps): almost every
    # weight agrees within 5% of one step's lr, a rare element (a rarely seen token's embedding) by up to
    # a step's lr. A missing, misscaled or misrouted update moves most weights by ~lr: the untrained
    # model, 5 updates short, fails the same criterion.
    assert off <= total // 10_000 and worst < OPTIM["lr"], (worst, off)
    untrained = LlamaForCausalLM.from_pretrained(runs["hf"], dtype=torch.float32).state_dict()
    _, untrained_off, _ = beyond_bound(untrained, ref_state)
    assert untrained_off > total // 2, untrained_off
