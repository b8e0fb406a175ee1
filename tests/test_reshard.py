"""A checkpoint resumed on another layout (training/checkpoints/reshard.py) trains what the run trained on its own.

On 4 CPU ranks, fp32, shuffle on, run A (conftest) trains 8 steps on pipe 2 x data 2 (ZeRO-1), saving every 2. Each
other layout resumes A's step-4 checkpoint with the same global batch (grad_acc makes up for dp) and must train steps
5-8 as A did: losses within 1e-6 relative, final weights within 1e-6. Wrong optimizer state shows far beyond that: the
same resume with Adam's moments left at zero is 3.2e-3 off at step 6 (measured).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from models.files.pipeline_dir import load_layer_file
from tests.support.ranks import run_deepspeed
from tests.support.runs import loop_args, read_metrics
from tests.support.scripts import load_entry_point

pytestmark = pytest.mark.multirank

LOSS_RTOL = 1e-6
WEIGHT_ATOL = 1e-6


@pytest.fixture(scope="module")
def root(run_a):
    return run_a[0]


def checkpoint_at(src, dst, tag: str):
    """``src`` as a crash right after saving ``tag`` would leave it (later checkpoints gone)."""
    shutil.copytree(src, dst)
    for name in os.listdir(dst):
        if name.startswith("global_step") and int(name[len("global_step") :]) > int(tag[len("global_step") :]):
            shutil.rmtree(dst / name)
    (dst / "latest").write_text(tag)
    return dst


def resume(root, name: str, src, tag: str, **layout):
    out = checkpoint_at(src, root / name, tag)
    proc = run_deepspeed(4, "train.py", loop_args(root, out, **layout), str(root / f"{name}.log"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return out, proc.stdout


def assert_continues_a(root, out, first_step: int) -> None:
    """Losses from ``first_step`` on and the final weights of ``out`` are run A's (the differences are
    printed: ``pytest tests/test_reshard.py -s``)."""
    a = {m["step"]: m["loss"] for m in read_metrics(str(root / "A"))}
    b = {m["step"]: m["loss"] for m in read_metrics(str(out))}
    assert sorted(b) == list(range(1, 9))
    loss_diff = max(abs(b[step] - a[step]) / abs(a[step]) for step in range(first_step, 9))
    weight_diff = 0.0
    for name in sorted(os.listdir(root / "A" / "global_step8")):
        if name.startswith("layer_"):
            wa, wb = (load_layer_file(str(d / "global_step8" / name)) for d in (root / "A", out))
            weight_diff = max([weight_diff, *((wa[k] - wb[k]).abs().max().item() for k in wa)])
    print(f"[reshard] {out.name}: steps {first_step}-8 loss rel. diff <= {loss_diff:.1e}, weights {weight_diff:.1e}")
    assert loss_diff <= LOSS_RTOL and weight_diff <= WEIGHT_ATOL


@pytest.mark.parametrize(
    "name, layout, engine",
    [
        ("pipe4", dict(num_stages=4, gradient_accumulation_steps=4), "PipelineEngine, ZeRO stage 1"),
        ("pipe1", dict(num_stages=1, gradient_accumulation_steps=1), "PipelineEngine, ZeRO stage 1"),
        ("zero2", dict(num_stages=1, ds="zero2", gradient_accumulation_steps=1), "DeepSpeedEngine, ZeRO stage 2"),
    ],
)
def test_resume_on_another_layout_continues_exactly(root, name, layout, engine):
    out, stdout = resume(root, name, root / "A", "global_step4", **layout)
    assert "global_step4 was saved on another layout" in stdout and f"engine: {engine}" in stdout
    assert "steps 5..8 (resumed from global_step4)" in stdout
    assert_continues_a(root, out, 5)


def test_zero3_resumes_a_pipeline_checkpoint_and_back(root):
    """pipe 2 x data 2 (ZeRO-1) -> data 4 (ZeRO-3) at step 4 -> pipe 2 x data 2 at step 6."""
    zero3, stdout = resume(
        root,
        "zero3",
        root / "A",
        "global_step4",
        num_stages=1,
        ds="zero3",
        gradient_accumulation_steps=1,
        save_steps=2,
    )
    assert "engine: DeepSpeedEngine, ZeRO stage 3" in stdout
    assert_continues_a(root, zero3, 5)
    back, stdout = resume(root, "back", zero3, "global_step6")
    assert "global_step6 was saved on another layout (num_stages 1 -> 2, ds_config 'zero3' -> 'zero1'" in stdout
    assert_continues_a(root, back, 7)


def test_portable_checkpoint_resumes_with_another_partition(root):
    """convert2ckpt.py --reshard writes the states per layer file; partition_method changes the split at 2
    stages (compute: specs 0..2 | 3..6, uniform: 0..3 | 4..6)."""
    from safetensors import safe_open

    from training.checkpoints.reshard import SavedOptimizerState

    portable = root / "portable"
    assert (
        load_entry_point("convert2ckpt.py").main(
            ["--reshard", "--input", str(root / "A"), "--tag", "global_step4", "--output", str(portable)]
        )
        == 0
    )
    native = SavedOptimizerState(str(root / "A" / "global_step4"))
    with safe_open(str(portable / "global_step4" / "optimizer_03.safetensors"), "pt") as f:
        for s in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(f.get_tensor(f"mlp.up_proj.weight.{s}"), native.get((3, "mlp.up_proj.weight"))[s])
    out = portable.parent / "uniform"
    shutil.copytree(portable, out)
    proc = run_deepspeed(4, "train.py", loop_args(root, out, partition_method="uniform"), str(root / "uniform.log"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "(portable, written by convert2ckpt.py --reshard)" in proc.stdout
    assert "rank 0: stage 0 specs 0..3" in proc.stdout
    assert_continues_a(root, out, 5)


def test_a_changed_global_batch_continues_at_the_next_unseen_sample(root):
    out, stdout = resume(root, "batch12", root / "A", "global_step4", gradient_accumulation_steps=3, max_steps=6)
    assert "resume: the global batch changes from 8 to 12 samples" in stdout
    with open(out / "global_step6" / "trainer_state_rank00000.json") as f:
        assert json.load(f)["iterator"] == {"epoch": 0, "consumed": 4 * 8 + 2 * 12}
    lrs = {m["step"]: m["lr"] for m in read_metrics(str(out))}
    assert lrs[5] == {m["step"]: m["lr"] for m in read_metrics(str(root / "A"))}[5]  # the schedule's step 5


def test_an_incomplete_or_tampered_checkpoint_is_refused_before_training(root):
    """Checked by the validation train.py runs on every rank before any process group starts
    (``training.configuration.schema.resolve``, here through the preflight's ``check`` in this process): every problem
    in one message, nothing written, the malicious file never run."""
    from tests.test_run_failures import _Payload
    from training.configuration.preflight import check

    out = checkpoint_at(root / "A", root / "refused", "global_step4")
    tag_dir = out / "global_step4"
    marker = root / "PWNED"
    tampered = tag_dir / "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    state = torch.load(tampered, weights_only=False)
    state["tampered"] = _Payload(str(marker))
    torch.save(state, tampered)
    (tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    before = sorted(os.listdir(tag_dir))
    with pytest.raises(ValueError) as refused:
        check(4, loop_args(root, out, num_stages=4))
    message = str(refused.value)
    assert f"cannot resume {out}/global_step4: " in message
    assert "the optimizer states of data-parallel rank 1 of stage 0 are missing (of 2)" in message
    assert f"{tampered} holds objects a DeepSpeed checkpoint does not" in message
    assert sorted(os.listdir(tag_dir)) == before and not marker.exists()
