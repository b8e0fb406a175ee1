"""SFT trains what Hugging Face Trainer trains: the loss of an optimizer step is the summed token loss of
the whole global batch over its label-token count (Trainer's ``num_items_in_batch`` with
``average_tokens_across_devices``), on both DeepSpeed engines.

SFT data whose response lengths alternate between 1-3 and 20-30 words (micro-batches of about 20 and
about 170 label tokens), pipe 2 x data 2 with grad_acc 4, five fp32 steps without clipping, against a
single-process LlamaForCausalLM loop that passes ``num_items_in_batch`` (Trainer's own loss path) over
the same global batches. ``loss_normalization=micro_batch`` is checked against the mean of
per-micro-batch means, and the two references are shown to differ by far more than the tolerance.
The pipe 2 x data 2 run computes the loss chunk by chunk (``loss_chunk_tokens=48``); the same run with the
whole logits (``loss_chunk_tokens=0``) trains the same losses and weights, and both equal the reference.
"""

from __future__ import annotations

import shutil

import pytest

from models.loss import label_tokens
from models.tiny import write_uneven_sft
from tests.support.parity import (
    GLOBAL_BATCH,
    REL_TOL,
    SFT_SEQ,
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

pytestmark = pytest.mark.multirank  # starts DeepSpeed ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_hf, tiny_ckpt):
    root = tmp_path_factory.mktemp("sft")
    data, eval_data = str(root / "train.jsonl"), str(root / "eval.jsonl")
    write_uneven_sft(data, STEPS * GLOBAL_BATCH, seed=0)
    write_uneven_sft(eval_data, 16, seed=1)  # whole micro-batches of 2 at dp 2 and dp 4: every row evaluated

    def launch(name: str, ranks: int, **overrides) -> None:
        train_run(root, name, ranks, sft_train_args(tiny_ckpt, data, eval_data, str(root / name), **overrides))

    # loss_chunk_tokens=48: micro-batches of about 20 and 170 label tokens take one chunk, or four with a
    # partial last one (the default, 1024, would take every micro-batch here in one chunk).
    # Its step-3 checkpoint is resumed under DualPipeV (test_a_1f1b_checkpoint_resumes_under_dualpipev).
    launch(
        "tokens", 4, num_stages=2, gradient_accumulation_steps=4, ds_config="zero1", loss_chunk_tokens=48, save_steps=3
    )
    # The same run with the [B,S,V] logits (the chunked loss off).
    launch("tokens_unchunked", 4, num_stages=2, gradient_accumulation_steps=4, ds_config="zero1", loss_chunk_tokens=0)
    launch(
        "micro_batch",
        4,
        num_stages=2,
        gradient_accumulation_steps=4,
        ds_config="zero1",
        loss_normalization="micro_batch",
    )
    # DeepSpeed's data-parallel engine, dp 4 x grad_acc 2: other micro-batch groups, the same global batches.
    launch("zero2", 4, num_stages=1, gradient_accumulation_steps=2, ds="zero2")

    rows = cached_rows(str(root / "cache"), data)
    steps, step_tokens, step_fed = global_batches(rows, dp=2, gas=4, steps=STEPS)
    token_losses, token_model = sft_reference_run(tiny_hf, steps, "tokens")
    micro_losses, micro_model = sft_reference_run(tiny_hf, steps, "micro_batch")
    eval_rows = cached_rows(str(root / "cache"), eval_data)
    return dict(
        root=root,
        ckpt=tiny_ckpt,
        config=token_model.config,
        steps=steps,
        step_tokens=step_tokens,
        step_fed={"tokens": step_fed, "tokens_unchunked": step_fed, "zero2": global_batches(rows, 4, 2, STEPS)[2]},
        token_losses=token_losses,
        token_model=token_model,
        micro_losses=micro_losses,
        micro_model=micro_model,
        token_eval=eval_losses(token_model, eval_rows),
        micro_eval=eval_losses(micro_model, eval_rows),
        eval_rows=eval_rows,
    )


def test_the_data_makes_the_two_normalisations_differ(runs):
    """Uneven micro-batches (a tolerance that could not tell the two apart would prove nothing)."""
    counts = [label_tokens(labels) for step in runs["steps"] for _, labels in step]
    assert max(counts) > 5 * min(counts), counts
    worst = max(rel(m, t) for m, t in zip(runs["micro_losses"][1:], runs["token_losses"][1:]))
    weights = max_rel_weight_diff(dict(runs["micro_model"].state_dict()), runs["token_model"])
    print(f"micro-batch mean vs token mean references: loss {worst:.2e} relative, weights {weights:.2e} relative L2")
    assert worst > 1000 * REL_TOL and weights > 1000 * REL_TOL
    assert rel(runs["micro_eval"][1], runs["token_eval"][0]) > 1000 * REL_TOL


@pytest.mark.parametrize("name", ["tokens", "tokens_unchunked", "zero2"])
def test_token_normalised_loss_and_weights_equal_trainer_semantics(runs, name):
    metrics = read_metrics(str(runs["root"] / name))
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    loss_diff = max(rel(m["loss"], r) for m, r in zip(metrics, runs["token_losses"]))
    weight_diff = max_rel_weight_diff(trained_weights(str(runs["root"] / name), runs["config"]), runs["token_model"])
    before = max(rel(m, r) for m, r in zip(runs["micro_losses"], runs["token_losses"]))
    print(
        f"{name}: vs Trainer-semantics reference: loss {loss_diff:.2e} relative, weights {weight_diff:.2e} relative L2 "
        f"(per-micro-batch normalisation: loss {before:.2e})"
    )
    assert loss_diff < REL_TOL and weight_diff < REL_TOL
    # Honest throughput: real tokens and label tokens of the global batch, counted on the ranks that read it.
    for m, step, tokens, fed in zip(metrics, runs["steps"], runs["step_tokens"], runs["step_fed"][name]):
        assert m["label_tokens"] == sum(label_tokens(labels) for _, labels in step)
        assert m["tokens"] == tokens < GLOBAL_BATCH * SFT_SEQ  # padding is not counted
        assert m["tokens_per_s"] == pytest.approx(tokens / m["step_s"], rel=1e-2)
        assert tokens < fed < GLOBAL_BATCH * SFT_SEQ and m["padding"] == round(1 - tokens / fed, 4)  # rows were cut


def test_padding_share_and_normalisation_are_announced(runs):
    log = (runs["root"] / "tokens.log").read_text()
    assert "loss normalised per label token of the global batch (loss_normalization=tokens)" in log
    assert f"data: rows of {SFT_SEQ} tokens, " in log and (
        "% padding; each micro-batch cut to its longest row, up to a multiple of 8 (data.group_by_length=true pads "
        "less)" in log
    )
    assert (
        "loss normalised per micro-batch (loss_normalization=micro_batch)"
        in (runs["root"] / "micro_batch.log").read_text()
    )


def test_micro_batch_normalisation_keeps_the_old_behaviour(runs):
    metrics = read_metrics(str(runs["root"] / "micro_batch"))
    loss_diff = max(rel(m["loss"], r) for m, r in zip(metrics, runs["micro_losses"]))
    weight_diff = max_rel_weight_diff(
        trained_weights(str(runs["root"] / "micro_batch"), runs["config"]), runs["micro_model"]
    )
    assert loss_diff < REL_TOL and weight_diff < REL_TOL, (loss_diff, weight_diff)


@pytest.mark.parametrize(
    "name, normalization, which",
    [("tokens", "token", 0), ("tokens_unchunked", "token", 0), ("zero2", "token", 0), ("micro_batch", "micro", 1)],
)
def test_eval_loss_is_weighted_by_tokens_over_the_whole_eval_set(runs, name, normalization, which):
    (evaluation,) = read_metrics(str(runs["root"] / name), "eval")
    expected = runs[f"{normalization}_eval"][which]
    assert rel(evaluation["eval_loss"], expected) < REL_TOL, (evaluation["eval_loss"], expected)


def test_chunked_loss_trains_what_the_logits_path_trains(runs):
    """loss_chunk_tokens=48 against the same run with the logits (loss_chunk_tokens=0): the same losses,
    eval loss and weights (< 1e-6 relative); both equal the reference (the tests above)."""
    chunked, unchunked = (str(runs["root"] / name) for name in ("tokens", "tokens_unchunked"))
    losses = [(c["loss"], u["loss"]) for c, u in zip(read_metrics(chunked), read_metrics(unchunked))]
    assert len(losses) == STEPS
    loss_diff = max(rel(c, u) for c, u in losses)
    (chunked_eval,), (unchunked_eval,) = read_metrics(chunked, "eval"), read_metrics(unchunked, "eval")
    eval_diff = rel(chunked_eval["eval_loss"], unchunked_eval["eval_loss"])
    weights = trained_weights(unchunked, runs["config"])
    diff = sum(((w - weights[k]) ** 2).sum() for k, w in trained_weights(chunked, runs["config"]).items()).sqrt()
    weight_diff = (diff / sum((w**2).sum() for w in weights.values()).sqrt()).item()
    print(f"chunked vs unchunked: loss {loss_diff:.2e}, eval loss {eval_diff:.2e}, weights {weight_diff:.2e} relative")
    assert loss_diff < REL_TOL and eval_diff < REL_TOL and weight_diff < REL_TOL


def test_a_1f1b_checkpoint_resumes_under_dualpipev(runs, tmp_path):
    """The chunked pipe 2 x data 2 run's step-3 checkpoint resumed with pipeline_schedule=dualpipev (stage 1's
    specs split between the two ranks: optimizer states read per parameter), rows fed whole: steps 4 and 5, the
    eval loss and the final weights as the uninterrupted 1F1B run's (parity tolerance: reductions reordered)."""
    root, out = runs["root"], tmp_path / "dualpipev"
    shutil.copytree(root / "tokens", out)
    shutil.rmtree(out / "global_step5")
    (out / "latest").write_text("global_step3")
    args = sft_train_args(
        runs["ckpt"],
        str(root / "train.jsonl"),
        str(root / "eval.jsonl"),
        str(out),
        num_stages=2,
        gradient_accumulation_steps=4,
        ds_config="zero1",
        loss_chunk_tokens=48,
        pipeline_schedule="dualpipev",
        **{"data.pad_to_multiple_of": 0},
    )
    proc = train_run(tmp_path, "dualpipev", 4, args)
    assert "was saved on another layout (pipeline_schedule '1f1b' -> 'dualpipev')" in proc.stdout
    straight = {m["step"]: m["loss"] for m in read_metrics(str(root / "tokens"))}
    resumed = [m for m in read_metrics(str(out)) if m["step"] > 3]
    assert [m["step"] for m in resumed] == [4, 5] and all(
        rel(m["loss"], straight[m["step"]]) < REL_TOL for m in resumed
    )
    assert rel(read_metrics(str(out), "eval")[-1]["eval_loss"], runs["token_eval"][0]) < REL_TOL
    weight_diff = max_rel_weight_diff(trained_weights(str(out), runs["config"]), runs["token_model"])
    assert weight_diff < REL_TOL, weight_diff
