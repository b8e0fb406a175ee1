"""The training program as users run it (4 CPU ranks): exact resume, periodic checkpoints and pruning,
eval records, monitors, the plot script, and bf16 training from scratch."""

from __future__ import annotations

import csv
import json
import os
import shutil

import pytest
import torch

from models.files.hf_convert import hf_to_stages
from models.files.pipeline_dir import load_layer_file
from models.tiny import corpus_documents
from tests.support.ranks import run_deepspeed
from tests.support.runs import LOOP_STEPS, loop_args, read_metrics, run_args
from tests.support.scripts import run_script

pytestmark = pytest.mark.multirank  # starts DeepSpeed ranks


@pytest.fixture(scope="module")
def full_and_resumed(run_a):
    """Run A (conftest: 8 steps). Run B is A's output as a crash right after the step-4 save would leave it
    (latest = global_step4, later checkpoints gone, metrics up to step 8), resumed to step 8."""
    root, full = run_a
    shutil.copytree(root / "A", root / "B")
    for tag in ("global_step6", "global_step8"):
        shutil.rmtree(root / "B" / tag)
    (root / "B" / "latest").write_text("global_step4")
    resumed = run_deepspeed(4, "train.py", loop_args(root, root / "B"), str(root / "B.log"))
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    return root, full, resumed


def test_resume_continues_exactly(full_and_resumed):
    root, _, resumed = full_and_resumed
    assert "steps 5..8 (resumed from global_step4)" in resumed.stdout
    a, b = read_metrics(str(root / "A")), read_metrics(str(root / "B"))
    assert [m["step"] for m in b] == list(range(1, LOOP_STEPS + 1))  # lines after step 4 were replaced, not duplicated
    assert [m["loss"] for m in b] == [m["loss"] for m in a]  # bit-identical, steps 5-8 included
    assert [m["lr"] for m in b] == [m["lr"] for m in a]
    assert (
        read_metrics(str(root / "B"), "eval")[-1]["eval_loss"] == read_metrics(str(root / "A"), "eval")[-1]["eval_loss"]
    )
    for name in sorted(os.listdir(root / "A" / "global_step8")):
        if name.startswith("layer_"):
            a_state, b_state = (load_layer_file(str(root / r / "global_step8" / name)) for r in "AB")
            assert all(torch.equal(a_state[k], b_state[k]) for k in a_state), name


def test_checkpoints_are_pruned_complete_and_self_contained(full_and_resumed):
    root, full, _ = full_and_resumed
    out = root / "A"
    assert sorted(t for t in os.listdir(out) if t.startswith("global_step")) == [
        "global_step4",
        "global_step6",
        "global_step8",
    ]
    assert (out / "latest").read_text() == "global_step8"
    for tag in ("global_step4", "global_step6", "global_step8"):
        assert sorted(f for f in os.listdir(out / tag) if f.startswith("trainer_state")) == [
            f"trainer_state_rank{r:05d}.json" for r in range(4)
        ]
        assert (out / tag / "train_config.yaml").is_file()
    for name in ("config.json", "tokenizer.json", "train_config.yaml"):
        assert (out / name).is_file()


def test_eval_records_monitors_and_plot(full_and_resumed):
    root, full, _ = full_and_resumed
    evals = read_metrics(str(root / "A"), "eval")
    assert [e["step"] for e in evals] == [4, 8]
    assert all(e["eval_ppl"] == pytest.approx(2.718281828 ** e["eval_loss"], rel=1e-6) for e in evals)
    assert "eval @ step 8 | eval loss" in full.stdout
    csv_dir = root / "A" / "monitor" / "csv"
    assert {"Train_Samples_train_loss.csv", "Train_Samples_lr.csv"} <= set(os.listdir(csv_dir))
    with open(csv_dir / "Train_Samples_train_loss.csv") as f:
        rows = list(csv.reader(f))
    assert len(rows) == 1 + LOOP_STEPS  # a header and every step, the last too: written before the rank's os._exit
    proc = run_script(["scripts/plot_metrics.py", str(root / "A")])
    assert proc.returncode == 0, proc.stderr
    assert (root / "A" / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bf16_from_scratch_learns_a_small_repeated_set(tmp_path, tokenizer_dir):
    data = tmp_path / "small.jsonl"
    with open(data, "w") as f:
        for doc in corpus_documents()[:2]:
            f.write(json.dumps({"text": doc[:600]}) + "\n")
    args = [
        "model=tiny",
        f"model.tokenizer={tokenizer_dir}",
        f"output_dir={tmp_path / 'out'}",
        "data=text",
        f"data.train_file={data}",
        "data.max_seq_length=64",
        f"data.cache_dir={tmp_path / 'cache'}",
        "num_stages=2",
        "micro_batch_size=2",
        "gradient_accumulation_steps=2",
        "max_steps=20",
        "precision=bf16",
        "ds=zero1",
        "optim.lr=1e-2",
        "optim.warmup_steps=2",
    ]
    proc = run_deepspeed(2, "train.py", args, str(tmp_path / "log.txt"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "initialised from scratch (model=tiny, seed 42)" in proc.stdout
    losses = [m["loss"] for m in read_metrics(str(tmp_path / "out"))]
    assert len(losses) == 20 and losses[-1] < losses[0] - 1.0, losses  # measured: 6.25 -> 3.91
    weights = load_layer_file(str(tmp_path / "out" / "global_step20" / "layer_01-model_states.pt"))
    assert all(t.dtype == torch.bfloat16 for t in weights.values())


def test_activation_checkpointing_recomputes_decoder_layers(tmp_path, tiny_hf):
    """1 rank, 4 decoder layers, 2 micro-batches: 8 forwards without checkpointing, 16 with
    interval 1 (each layer again in the backward pass). Equal losses: tests/test_train_parity.py."""
    from models.tiny import write_random_tokens

    hf_to_stages(tiny_hf, str(tmp_path / "ckpt"))
    write_random_tokens(str(tmp_path / "d.jsonl"), 8, 16, vocab_size=512)
    proc = run_deepspeed(
        1,
        "tests/ds_scripts/train_counting_forwards.py",
        [
            f"model_name_or_path={tmp_path / 'ckpt'}",
            f"data.train_file={tmp_path / 'd.jsonl'}",
            "data.max_seq_length=16",
            f"data.cache_dir={tmp_path / 'cache'}",
            "max_steps=1",
            "gradient_accumulation_steps=2",
            "precision=fp32",
            f"output_dir={tmp_path / 'out'}",
            "activation_checkpoint_interval=1",
        ],
        str(tmp_path / "log.txt"),
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "DECODER_FORWARDS rank 0: 16" in proc.stdout


def test_zero3_data_parallel_run_resumes_exactly_and_exports(tmp_path, tiny_hf, corpus):
    """num_stages=1 with ZeRO-3 (DeepSpeed's data-parallel engine): the same checkpoints, resume and export."""
    ckpt = str(tmp_path / "ckpt")
    hf_to_stages(tiny_hf, ckpt)

    def args(out) -> list[str]:
        return run_args(
            ckpt,
            corpus,
            out,
            tmp_path / "cache",
            num_stages=1,
            ds="zero3",
            max_steps=4,
            save_steps=2,
            save_total_limit=0,
            save_async="true",  # step 2's checkpoint, resumed below, written in the background
        )

    full = run_deepspeed(2, "train.py", args(tmp_path / "A"), str(tmp_path / "A.log"))
    assert full.returncode == 0, (full.stdout + full.stderr)[-4000:]
    assert "engine: DeepSpeedEngine, ZeRO stage 3" in full.stdout
    shutil.copytree(tmp_path / "A", tmp_path / "B")
    shutil.rmtree(tmp_path / "B" / "global_step4")
    (tmp_path / "B" / "latest").write_text("global_step2")
    resumed = run_deepspeed(2, "train.py", args(tmp_path / "B"), str(tmp_path / "B.log"))
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    assert [m["loss"] for m in read_metrics(str(tmp_path / "B"))] == [
        m["loss"] for m in read_metrics(str(tmp_path / "A"))
    ]
    for name in sorted(os.listdir(tmp_path / "A" / "global_step4")):
        if name.startswith("layer_"):
            a_state, b_state = (load_layer_file(str(tmp_path / r / "global_step4" / name)) for r in "AB")
            assert all(torch.equal(a_state[k], b_state[k]) for k in a_state), name
    proc = run_script(
        [
            "convert2ckpt.py",
            "--to-hf",
            "--input",
            str(tmp_path / "A"),
            "--output",
            str(tmp_path / "hf"),
        ]
    )
    assert proc.returncode == 0, proc.stderr
    from transformers import LlamaForCausalLM

    exported = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"))
    trained = load_layer_file(str(tmp_path / "A" / "global_step4" / "layer_02-model_states.pt"))
    assert torch.equal(exported.model.layers[1].mlp.up_proj.weight, trained["mlp.up_proj.weight"])


def test_bf16_zero0_resumes_exactly_and_a_tampered_checkpoint_is_refused_unrun(tmp_path, tiny_hf, corpus):
    """bf16 at ZeRO-0 (DeepSpeed's BF16_Optimizer, whose resume DeepSpeed 0.19.8 breaks with KeyError: 0)
    trains with the chunked loss what it trains with the logits, and continues bit-identically from step
    2 of 4. The same checkpoint with a malicious engine-state file, a
    malicious optimizer-state file and another stage's optimizer file missing is refused, each file
    named, before anything is loaded; the payload never runs."""
    ckpt = str(tmp_path / "ckpt")
    hf_to_stages(tiny_hf, ckpt)

    def args(out):
        # step 2's checkpoint, resumed below, written in the background (save_steps=2)
        return run_args(
            ckpt, corpus, out, tmp_path / "cache", precision="bf16", ds="zero0", max_steps=4, save_async="true"
        )

    full = run_deepspeed(2, "train.py", args(tmp_path / "A"), str(tmp_path / "A.log"))
    assert full.returncode == 0, (full.stdout + full.stderr)[-4000:]
    # The chunked loss (the default) trains what the logits train under DeepSpeed's bf16 optimizer too:
    # with the head weight handed to the loss as the Parameter itself, the step-1 gradient norm was 10%
    # low (1.435 vs 1.600) and the head moved a third as far (models.llama_pipe.handed_out).
    # save_final=false: step 2's background save (save_steps=2) is published at the end, step 3 is not saved
    logits = run_deepspeed(
        2, "train.py", [*args(tmp_path / "A0"), "loss_chunk_tokens=0", "max_steps=3", "save_final=false"], "/dev/null"
    )
    assert logits.returncode == 0, (logits.stdout + logits.stderr)[-4000:]
    assert "save_final=false: no checkpoint of step 3; the last is global_step2" in logits.stdout
    assert sorted(p.name for p in (tmp_path / "A0").glob("*global_step*")) == ["global_step2"]
    assert (tmp_path / "A0" / "latest").read_text() == "global_step2"
    for chunked, whole in zip(read_metrics(str(tmp_path / "A")), read_metrics(str(tmp_path / "A0"))):
        assert abs(chunked["grad_norm"] - whole["grad_norm"]) < 1e-2 * whole["grad_norm"], (chunked, whole)
        assert abs(chunked["loss"] - whole["loss"]) < 1e-2 * whole["loss"]
    for name in ("B", "C"):
        shutil.copytree(tmp_path / "A", tmp_path / name)
        shutil.rmtree(tmp_path / name / "global_step4")
        (tmp_path / name / "latest").write_text("global_step2")
    resumed = run_deepspeed(2, "train.py", args(tmp_path / "B"), str(tmp_path / "B.log"))
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    assert "steps 3..4 (resumed from global_step2)" in resumed.stdout
    assert [m["loss"] for m in read_metrics(str(tmp_path / "B"))] == [
        m["loss"] for m in read_metrics(str(tmp_path / "A"))
    ]

    from tests.test_run_failures import _Payload

    marker = tmp_path / "PWNED"
    tag_dir = tmp_path / "C" / "global_step2"
    optim, missing = sorted(tag_dir.glob("*optim_states.pt"))  # one per stage
    engine_state = next(tag_dir.glob("mp_rank_*_model_states.pt"))
    for path in (optim, engine_state):
        state = torch.load(path, weights_only=False)
        state["tampered"] = _Payload(str(marker))
        torch.save(state, path)
    missing.unlink()
    refused = run_deepspeed(2, "train.py", args(tmp_path / "C"), str(tmp_path / "C.log"))
    out = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "cannot resume from" in out
    for path in (optim, engine_state):
        assert f"{path} names posix.system, which a DeepSpeed checkpoint never holds" in out
    assert f"{missing} is missing: the checkpoint is incomplete" in out
    assert not marker.exists()
