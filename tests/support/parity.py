"""What the parity tests share: the fp32 runs' settings, their train.py arguments and the single-process
Hugging Face references they are checked against. Two kinds of run:

- random tokens (tests/test_train_parity.py; LoRA, tensor parallelism, multi-node, hang, preemption and
  signal tests reuse it): fixed rows of SEQ random tokens, mean of per-micro-batch losses, clipping and
  warm-up (OPTIM), against ``reference_run``;
- uneven SFT (tests/test_sft_parity.py; DualPipeV, sequence parallelism and the family runs reuse it):
  response lengths alternating 1-3 and 20-30 words in rows of SFT_SEQ tokens, no clipping (SFT_OPTIM),
  the step's loss normalised as Trainer does, against ``sft_reference_run``.
"""

from __future__ import annotations

import json
import os

import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from data.cache import TokenBlocks
from data.sampling import MicroBatchIterator
from models.files.pipeline_dir import load_layer_file, read_tag
from models.llama_pipe import layer_file_name, spec_layout
from models.loss import label_tokens
from training.configuration.schema import OptimConfig, TrainConfig
from training.optim import lr_lambda, param_groups

# Relative loss difference allowed, fp32. The issue asks for < 1e-4; all layouts measure ~8e-8, and a
# real bug (DeepSpeed clipping by stage 0's gradient norm only) showed as 9e-6, which 1e-4 would miss.
# The SFT runs use the same; there the two normalisations differ by > 1e-3 (asserted).
REL_TOL = 1e-6
STEPS, MICRO = 5, 2


def parity_args(ckpt: str, data: str, out, seq: int, micro: int, steps: int, optim: dict, **overrides) -> list[str]:
    """train.py overrides of an fp32 parity run: fixed data order, the tokenized cache beside ``out``."""
    args = {
        "model_name_or_path": ckpt,
        "output_dir": out,
        "data.train_file": data,
        "data.max_seq_length": seq,
        "data.shuffle": "false",
        "data.cache_dir": os.path.join(os.path.dirname(out), "cache"),
        "micro_batch_size": micro,
        "max_steps": steps,
        "precision": "fp32",
        **{f"optim.{k}": v for k, v in optim.items()},
        **overrides,
    }
    return [f"{k}={v}" for k, v in args.items()]


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


# -- random tokens (tests/test_train_parity.py) ---------------------------------------------------------

SEQ, NUM_SAMPLES = 32, 64
DATA_PARALLEL_CONFIGS = ("zero2", "zero2_offload", "zero3", "zero3_offload")
# Every ds_configs/ entry these runs train (tests/test_config.py checks that each config is either here
# or refused before training with its reason).
TRAINED_CONFIGS = ("zero0", "zero1", "zero1_offload", *DATA_PARALLEL_CONFIGS)
OPTIM = dict(lr=1e-3, weight_decay=0.1, max_grad_norm=1.0, warmup_steps=2)
# The pipe 2 x data 2 run (conftest's parity_pipe): global batch 8 = micro 2 x grad_acc 2 x dp 2.
PIPE = dict(num_stages=2, gradient_accumulation_steps=2, ds_config="zero1")

# Trained weights against the reference's: Adam turns fp32 reduction-order noise into weight differences
# where a gradient element is near eps (update sensitivity ~ lr / 4 eps), so almost every weight agrees
# within 5% of one step's lr and a rare element (a rarely seen token's embedding) by up to a step's lr.
WEIGHT_BOUND = 0.05 * OPTIM["lr"]


def beyond_bound(state: dict, ref_state: dict) -> tuple[float, int, int]:
    """(largest difference, weights differing by more than WEIGHT_BOUND, weights) of ``state`` against ``ref_state``."""
    diffs = torch.cat([(state[k] - ref_state[k]).abs().flatten() for k in ref_state])
    return diffs.max().item(), int((diffs > WEIGHT_BOUND).sum()), diffs.numel()


def train_args(ckpt: str, data: str, out: str, **overrides) -> list[str]:
    return parity_args(ckpt, data, out, SEQ, MICRO, STEPS, OPTIM, **overrides)


def reference_run(hf_dir: str, samples: list[list[int]], global_batch: int, model=None, **optim_overrides):
    """Plain Hugging Face loop: mean of per-micro-batch losses, AdamW, clipping, warm-up schedule.
    Returns per step the losses, the learning rates and the pre-clip gradient norms (the whole model's,
    and the LM head's alone, 0 where it is frozen), and the trained model: ``hf_dir``'s, or ``model`` (a
    PEFT model, whose trainable parameters AdamW trains)."""
    torch.manual_seed(0)
    if model is None:
        model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")
    cfg = TrainConfig(optim=OptimConfig(**{**OPTIM, **optim_overrides}))
    opt = torch.optim.AdamW(
        param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, STEPS))
    losses, lrs, norms = [], [], []
    for step in range(STEPS):
        batch = torch.tensor(samples[step * global_batch : (step + 1) * global_batch])
        micro_losses = [model(input_ids=mb, labels=mb).loss for mb in batch.split(MICRO)]
        loss = torch.stack(micro_losses).mean()
        loss.backward()
        head_grad = model.get_output_embeddings().weight.grad
        head = 0.0 if head_grad is None else head_grad.norm().item()
        max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf")
        trained = [p for p in model.parameters() if p.requires_grad]
        norms.append((torch.nn.utils.clip_grad_norm_(trained, max_norm).item(), head))
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, lrs, norms, model


# -- uneven SFT (tests/test_sft_parity.py) --------------------------------------------------------------

SFT_SEQ = 128
GLOBAL_BATCH = 16  # micro 2 x grad_acc 4 x dp 2, and micro 2 x grad_acc 2 x dp 4
SFT_OPTIM = dict(lr=1e-3, weight_decay=0.1, max_grad_norm=0.0)  # no clipping: every difference reaches the weights


def sft_train_args(ckpt: str, data: str, eval_data: str, out: str, **overrides) -> list[str]:
    return parity_args(
        ckpt,
        data,
        out,
        SFT_SEQ,
        MICRO,
        STEPS,
        SFT_OPTIM,
        **{"data.eval_file": eval_data, "data.format": "sft"},
        **overrides,
    )


def cached_rows(cache_dir: str, source: str) -> TokenBlocks:
    """The tokenized rows train.py trained on (its cache entry for ``source``)."""
    for entry in os.listdir(cache_dir):
        with open(os.path.join(cache_dir, entry, "meta.json")) as f:
            if json.load(f)["source"] == os.path.abspath(source):
                return TokenBlocks(os.path.join(cache_dir, entry))
    raise FileNotFoundError(source)


def global_batches(rows: TokenBlocks, dp: int, gas: int, steps: int) -> tuple[list[list], list[int], list[int]]:
    """Per step, the micro-batches every data-parallel rank trains on (shuffle off), rank by rank, as
    whole rows of SFT_SEQ tokens (the reference runs on those: train.py cuts each micro-batch's common padding
    off, which must not change the loss), the real (non-padding) tokens among them, and the tokens train.py
    computes on (each micro-batch cut to its longest row, a multiple of 8: data.pad_to_multiple_of)."""
    iterators = [MicroBatchIterator(rows, MICRO, r, dp, shuffle=False, seed=0) for r in range(dp)]
    cut = [MicroBatchIterator(rows, MICRO, r, dp, False, 0, pad_multiple=8) for r in range(dp)]
    batches, tokens, fed = [], [], []
    for _ in range(steps):
        before = sum(it.tokens_read for it in iterators)
        batches.append([next(it) for it in iterators for _ in range(gas)])
        tokens.append(sum(it.tokens_read for it in iterators) - before)
        fed.append(sum(next(it)[1].numel() for it in cut for _ in range(gas)))
    return batches, tokens, fed


def hf_loss(model, batch, num_items_in_batch=None) -> torch.Tensor:
    return hf_forward(model, batch, num_items_in_batch).loss


def hf_forward(model, batch, num_items_in_batch=None, **kwargs):
    """``<Family>ForCausalLM`` on one micro-batch ((input_ids, position_ids), labels), its loss over
    ``num_items_in_batch`` label tokens when given; ``kwargs`` to the model (``output_router_logits``)."""
    (input_ids, position_ids), labels = batch
    return model(
        input_ids=input_ids,
        position_ids=position_ids,
        labels=labels,
        use_cache=False,
        num_items_in_batch=num_items_in_batch,
        **kwargs,
    )


def sft_reference_run(hf_dir: str, steps: list[list], normalization: str, norms: list | None = None, **optim):
    """Single process: the family's ForCausalLM (LlamaForCausalLM here; tests/test_family_training.py
    passes the others), torch AdamW, the step's loss normalised as Trainer (``tokens``:
    sum over the global batch / its label tokens, via ``num_items_in_batch``) or per micro-batch. ``optim``
    overrides SFT_OPTIM; with max_grad_norm > 0 the gradients are clipped (their pre-clip norms appended to
    ``norms``)."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")
    cfg = TrainConfig(optim=OptimConfig(**{**SFT_OPTIM, **optim}))
    opt = torch.optim.AdamW(
        param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, STEPS))
    losses = []
    for micro_batches in steps:
        if normalization == "tokens":
            n = sum(label_tokens(labels) for _, labels in micro_batches)
            loss = sum(hf_loss(model, mb, torch.tensor(n)) for mb in micro_batches)
        else:
            loss = torch.stack([hf_loss(model, mb) for mb in micro_batches]).mean()
        loss.backward()
        if cfg.optim.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm).item()
            if norms is not None:
                norms.append(norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


@torch.no_grad()
def eval_losses(model, rows: TokenBlocks, dp: int = 2) -> tuple[float, float]:
    """(mean over every label token of the eval set, mean of the per-micro-batch means of a dp 2 run)."""
    batches = global_batches(rows, dp, len(rows) // dp // MICRO, 1)[0][0]
    n = sum(label_tokens(labels) for _, labels in batches)
    token_mean = sum(hf_loss(model, b, torch.tensor(n)) for b in batches).item()
    return token_mean, torch.stack([hf_loss(model, b) for b in batches]).mean().item()


def trained_weights(out: str, config) -> dict[str, torch.Tensor]:
    """Hugging Face name -> tensor, from the final checkpoint's layer files."""
    tag = read_tag(out)
    return {
        info.hf_prefix + k: v
        for info in spec_layout(config)
        if info.owns_file
        for k, v in load_layer_file(os.path.join(out, tag, layer_file_name(info.index))).items()
    }


def max_rel_weight_diff(weights: dict[str, torch.Tensor], model) -> float:
    """Relative L2 difference of all weights taken as one vector: ||w - ref|| / ||ref||.

    Per element, Adam amplifies fp32 reduction-order noise where a gradient is near eps (one v_proj of
    the 39 tensors measured 1.6e-6 on its own, the others <= 2.6e-7); over the model it is 1e-7."""
    ref = model.state_dict()
    diff = sum(((w - ref[k]) ** 2).sum() for k, w in weights.items()).sqrt()
    return (diff / sum((ref[k] ** 2).sum() for k in weights).sqrt()).item()
