"""deepspeed train.py trains Qwen3.5, Gemma 3 and Gemma 4 (text) exactly as Hugging Face would: pipe 2 x data 2 on 4
CPU ranks, five fp32 steps of packed SFT rows, loss and final weights within 1e-6 of a single-process
``<Family>ForCausalLM`` + torch AdamW loop, each cut putting the family's own layers on both stages; the trained runs
export back to Hugging Face with the reference's loss. (A Gemma 4 value dropped at the cut breaking the tolerance:
tests/test_family_gemma4.py.)

Packed rows equal their documents apart is proved per family in one process (tests/test_family_qwen3_5.py,
tests/test_family_gemma3.py, tests/test_family_gemma4.py); here the runs (specs 0-2 on stage 0: the embedding, layers
0-1; stage 1: layers 2-3, the norm and the head):

- qwen3_5: layers linear, full, linear, full (a Gated DeltaNet and a full-attention layer per stage); ZeRO-1;
           ``partition_method=parameters``. Hugging Face's torch DeltaNet runs its state on across documents, so the
           reference trains on each document as a row of its own (the stages restart it per document).
- gemma3:  sliding (window 8, shorter than most documents) and global layers alternating, scaled tied embeddings;
           ZeRO-0; ``partition_method=type:DecoderLayerPipe``.
- gemma4:  layers 2-3 reuse the keys and values of layers 0-1 (across the cut, with their gradients back), per-layer
           inputs of 8 per layer on the wire, tied embeddings; ZeRO-1; ``partition_method=memory``.

AdamW runs at lr 3e-4 and eps 1e-6 (not SFT_OPTIM's 1e-3 and 1e-8): there two exact Hugging Face loops already part
by more than 1e-6 in these families' weights (figures at ``OPTIM``).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoModelForCausalLM

from models.attention import find_documents
from models.families import load_config
from models.family_gemma4 import carries_per_layer_inputs, kv_source, pairs_on_wire
from models.files.hf_convert import hf_to_stages, stages_to_hf
from models.loss import IGNORE_INDEX, label_tokens
from models.tiny import write_uneven_sft
from tests.support.models import make_hf_dir
from tests.support.parity import (
    MICRO,
    SFT_OPTIM,
    STEPS,
    cached_rows,
    global_batches,
    hf_loss,
    max_rel_weight_diff,
    parity_args,
    rel,
    sft_reference_run,
    trained_weights,
)
from tests.support.ranks import train_run
from tests.support.runs import read_metrics

REL_TOL = 1e-6  # fp32, as tests/test_family_training.py
SEQ, GAS, DP = 128, 2, 2  # packed rows of 128 tokens; global batch = micro 2 x grad_acc 2 x dp 2
WINDOW = 8  # tiny_config's sliding window of Gemma 3 and 4
CUT = 3  # first spec of stage 1: every run's method splits the 7 specs 0-2 | 3-6
LINEAR, FULL = "linear_attention", "full_attention"
FAMILY_RUNS = {
    # name: (model_type, config overrides, train.py overrides)
    "qwen3_5": (
        "qwen3_5_text",
        dict(layer_types=[LINEAR, FULL, LINEAR, FULL]),
        dict(partition_method="parameters", ds_config="zero1"),
    ),
    "gemma3": (
        "gemma3_text",
        dict(tie_word_embeddings=True),
        dict(partition_method="type:DecoderLayerPipe", ds_config="zero0"),
    ),
    "gemma4": ("gemma4_text", dict(tie_word_embeddings=True), dict(partition_method="memory", ds_config="zero1")),
}
# AdamW: at SFT_OPTIM's lr 1e-3 and eps 1e-8, two exact Hugging Face loops (sdpa against eager attention) end 1.5e-6
# (Qwen3.5), 2.3e-6 (Gemma 3) and 8e-6 (Gemma 4) apart in the weights: fp32 rounding grown over five large steps, and
# single weights whose gradient is near eps (an update's sensitivity ~ lr / 4 eps). At lr 3e-4 and eps 1e-6 those
# floors are <= 4e-7, 2e-7 and 6e-8 (Gemma 4's q norms damped, below), under the 1e-6 asked, each run still learning.
OPTIM = dict(SFT_OPTIM, lr=3e-4, eps=1e-6)
# Gemma 4 scales no scores (its q/k norms do): q norms of 1 give scores of tens, where the rounding of any two
# attention kernels parts by more (tests/test_family_gemma4.py damps them too).
Q_NORM_SCALE = {"gemma4": 0.3}
APART = {"qwen3_5"}  # the families whose reference trains on each document as a row of its own


def documents_apart(batch):
    """A micro-batch ((input_ids, position_ids), labels) of packed rows as one row per document with labels, right-
    padded (ignored labels): what a causal model computes per document, whatever it does at document boundaries.
    A document's first label is ignored in the packed rows (a prompt token), so the loss and its token count hold."""
    (input_ids, position_ids), labels = batch
    docs = [
        (input_ids[r, a:b], labels[r, a:b])
        for r, row in enumerate(find_documents(position_ids).spans)
        for a, b in row
        if (labels[r, a:b] != IGNORE_INDEX).any()
    ]
    assert all(doc_labels[0] == IGNORE_INDEX for _, doc_labels in docs)
    ids = pad_sequence([d for d, _ in docs], batch_first=True)
    apart_labels = pad_sequence([lab for _, lab in docs], batch_first=True, padding_value=IGNORE_INDEX)
    assert label_tokens(apart_labels) == label_tokens(labels)
    return (ids, torch.arange(ids.shape[1]).expand_as(ids)), apart_labels


def scale_q_norms(hf_dir: str, scale: float) -> None:
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("q_norm.weight"):
                p.mul_(scale)
    model.save_pretrained(hf_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("families_2026")
    data = str(root / "train.jsonl")
    write_uneven_sft(data, 200, seed=0)
    out = {"root": root}
    for name, (model_type, config_overrides, train_overrides) in FAMILY_RUNS.items():
        hf_dir = make_hf_dir(root, tokenizer_dir, f"{name}-hf", model_type=model_type, **config_overrides)
        if name in Q_NORM_SCALE:
            scale_q_norms(hf_dir, Q_NORM_SCALE[name])
        hf_to_stages(hf_dir, str(root / f"{name}-ckpt"))
        args = parity_args(str(root / f"{name}-ckpt"), data, str(root / name), SEQ, MICRO, STEPS, OPTIM)
        overrides = dict(num_stages=2, gradient_accumulation_steps=GAS, **train_overrides)
        train_run(
            root, name, 4, args + [f"{k}={v}" for k, v in overrides.items()] + ["data.format=sft", "data.packing=true"]
        )
        out[name] = hf_dir
    steps, *_ = global_batches(cached_rows(str(root / "cache"), data), dp=DP, gas=GAS, steps=STEPS)
    out["steps"] = steps
    for name in FAMILY_RUNS:
        family_steps = [[documents_apart(mb) for mb in step] for step in steps] if name in APART else steps
        out[f"{name}_steps"] = family_steps
        out[f"{name}_ref"] = sft_reference_run(out[name], family_steps, "tokens", **OPTIM)
    return out


@pytest.mark.multirank  # starts DeepSpeed ranks
def test_packed_rows_hold_several_documents_longer_than_the_window(runs):
    positions = torch.cat([position_ids for (_, position_ids), _ in runs["steps"][0]])  # [rows of step 1, S]
    restarts = (positions[:, 1:] == 0).sum().item()
    assert restarts >= len(positions) // 2 and positions.max().item() >= 2 * WINDOW, positions


@pytest.mark.multirank
@pytest.mark.parametrize("name", sorted(FAMILY_RUNS))
def test_family_training_equals_its_hugging_face_loop(runs, name):
    losses, model = runs[f"{name}_ref"]
    expected = {"qwen3_5": "Qwen3_5", "gemma3": "Gemma3", "gemma4": "Gemma4"}[name] + "ForCausalLM"
    assert type(model).__name__ == expected
    metrics = read_metrics(str(runs["root"] / name))
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    loss_diff = max(rel(m["loss"], r) for m, r in zip(metrics, losses))
    weight_diff = max_rel_weight_diff(trained_weights(str(runs["root"] / name), load_config(runs[name])), model)
    print(f"{name}: vs {expected} loop: loss {loss_diff:.2e} relative, weights {weight_diff:.2e} relative L2")
    assert loss_diff < REL_TOL and weight_diff < REL_TOL
    assert losses[-1] < losses[0] - 0.05  # the run learns: the comparison is not over a frozen model


@pytest.mark.multirank
def test_each_cut_puts_the_familys_own_layers_on_both_stages(runs):
    """The log's stage specs are 0-2 | 3-6 on every rank, with the method asked for: decoder layers 0-1 on stage 0 and
    2-3 on stage 1, which hold a linear and a full layer each (Qwen3.5), a sliding and a global one each (Gemma 3 and
    4), and Gemma 4's reusing layers 2-3 read layers 0-1's keys and values across the cut, the per-layer inputs too."""
    for name, (model_type, _, overrides) in FAMILY_RUNS.items():
        log = (runs["root"] / f"{name}.log").read_text()
        assert f"(model_type {model_type}), 4 decoder layers | partition_method={overrides['partition_method']}" in log
        for rank in range(4):
            stage = rank // 2  # pipe x data: ranks 0-1 hold stage 0
            specs = "0..2" if stage == 0 else "3..6"
            assert f"rank {rank}: stage {stage} specs {specs} " in log, name
        config = load_config(runs[name])
        kinds = {LINEAR, FULL} if name == "qwen3_5" else {"sliding_attention", FULL}
        assert set(config.layer_types[:2]) == set(config.layer_types[2:]) == kinds, name
        assert name == "qwen3_5" or config.sliding_window == WINDOW
    config = load_config(runs["gemma4"])
    assert config.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    assert [kv_source(config, i) for i in (2, 3)] == [0, 1] and pairs_on_wire(config, CUT - 2) == [0, 1]
    assert carries_per_layer_inputs(config, CUT - 2) and config.hidden_size_per_layer_input == 8
    key = "model.embed_tokens_per_layer.weight"  # trained (and equal to the reference's, above)
    initial = AutoModelForCausalLM.from_pretrained(runs["gemma4"], dtype=torch.float32).state_dict()[key]
    assert not torch.equal(trained_weights(str(runs["root"] / "gemma4"), config)[key], initial)


@pytest.mark.multirank
@pytest.mark.parametrize("name", sorted(FAMILY_RUNS))
def test_trained_run_exports_to_hugging_face(runs, name, tmp_path):
    """stages_to_hf of the final checkpoint loads as the family's model, whose loss on a micro-batch is the reference
    model's."""
    stages_to_hf(str(runs["root"] / name), str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32, attn_implementation="sdpa"
    )
    _, model = runs[f"{name}_ref"]
    assert type(exported) is type(model)
    batch = runs[f"{name}_steps"][-1][0]
    with torch.no_grad():
        ours, ref = hf_loss(exported, batch).item(), hf_loss(model, batch).item()
    print(f"{name}: exported loss {ours:.6f}, reference {ref:.6f}, {rel(ours, ref):.1e} relative")
    assert rel(ours, ref) < REL_TOL
