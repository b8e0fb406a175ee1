"""The TRL reference of GRPO parity (tests/support/grpo_reference.py) trains what a plain loop of models/grpo.py trains.

Made-up completions (random ids of 1-8 tokens, some ending with EOS, some cut at max_completion_length=8, prompts
of different lengths, plain and conversational) written as a run's completions.jsonl and read back, two reward
functions (one leaves some completions unscored) weighted 1 and 0.5, temperature 0.7, AdamW as train.py builds it
(weight decay, warm-up, clipping). Against one process with the Hugging Face model, torch AdamW and models/grpo.py's
functions, contiguous micro-batches: the loss of each step and the final weights (relative to TRL's update) within
1e-5, the logged metrics and TRL's advantages too, for each loss type with beta 0, beta 0.04 and num_iterations 2.
bnpo normalised by the whole batch's tokens, or micro-batches taken strided, lands far outside. The reader of
completions.jsonl takes lines at generation steps only or at every step, and refuses a reuse step with other ids.
"""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch

from models.grpo import dapo_normalizer, group_advantages, grpo_loss, rewards_total, token_logps_and_entropy
from models.tiny import EOS_ID
from tests.support.grpo_reference import read_generations, trl_grpo_reference
from training.configuration.schema import OptimConfig, TrainConfig
from training.optim import lr_lambda, param_groups

MAX_COMPLETION, TEMP, LR, RTOL = 8, 0.7, 1e-2, 1e-5
# eps 1e-5, not train.py's 1e-8: Adam turns the fp32 noise of gradient elements near eps (embedding rows of tokens
# seen once) into weight differences; at 1e-8 the two routes' weights differ by 1.5-4e-5 of TRL's update (the embedding
# at most), at 1e-5 by ~1.5e-6, while a slip below moves them by half the update
OPTIM = dict(weight_decay=0.1, max_grad_norm=0.5, warmup_steps=2, eps=1e-5)
WEIGHTS = [1.0, 0.5]
WORDS = "the cat sat on a mat while two dogs ran over green hills toward old town gates".split()
# name: settings (micro x gas rows a step: 2 prompts x num_generations)
CASES = {  # grpo's on-policy loss is 0 (per-sequence means of the advantages): its weights tell
    "grpo": dict(loss_type="grpo", num_generations=2, micro=2, gas=2, steps=3),
    "bnpo-mask-truncated": dict(loss_type="bnpo", num_generations=4, micro=2, gas=4, mask_truncated_completions=True),
    "dr_grpo-batch-scale": dict(loss_type="dr_grpo", num_generations=2, micro=2, gas=2, scale_rewards="batch"),
    "dapo-chat": dict(loss_type="dapo", num_generations=4, micro=2, gas=4, chat=True),
    "dapo-beta": dict(loss_type="dapo", num_generations=2, micro=2, gas=2, beta=0.04),
    "bnpo-2-iterations": dict(loss_type="bnpo", num_generations=4, micro=2, gas=4, num_iterations=2, epsilon_high=0.28),
}
COMPARED_METRICS = ("entropy", "kl", "clip_ratio/region_mean", "reward", "reward_std", "frac_reward_zero_std")


def reward_length(completion_ids, **kwargs):
    return [len(ids) / MAX_COMPLETION for ids in completion_ids]


def reward_first_token(completion_ids, **kwargs):
    return [None if len(ids) == 3 else float(ids[0] % 5) for ids in completion_ids]


def settings(name: str) -> dict:
    case = {"steps": 3, "num_iterations": 1, "beta": 0.0, "scale_rewards": "group", "chat": False, **CASES[name]}
    case.setdefault("epsilon_high", None)
    case.setdefault("mask_truncated_completions", False)
    return case


def made_up_run(tokenizer, case: dict, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(the data records, a run's completions.jsonl lines): 2 prompts a generation, each num_generations times."""
    g = torch.Generator().manual_seed(seed)
    n_gen, generations = case["num_generations"], math.ceil(case["steps"] / case["num_iterations"])
    data, lines = [], []
    for i in range(2 * generations):
        text = " ".join(WORDS[j] for j in torch.randint(0, len(WORDS), (2 + i % 4,), generator=g).tolist())
        data.append({"prompt": [{"role": "user", "content": text}] if case["chat"] else text, "id": i})
    for step in range(case["num_iterations"] * generations):
        generation = step // case["num_iterations"]
        if step % case["num_iterations"]:
            continue  # a reuse step: no lines
        for record in data[2 * generation : 2 * generation + 2]:
            text = record["prompt"][0]["content"] if case["chat"] else record["prompt"]
            prompt_ids = tokenizer(text)["input_ids"]
            for _ in range(n_gen):
                length = int(torch.randint(1, MAX_COMPLETION + 1, (1,), generator=g))
                ids = torch.randint(3, tokenizer.vocab_size, (length,), generator=g).tolist()
                if length < MAX_COMPLETION or torch.rand(1, generator=g) < 0.3:
                    ids[-1] = EOS_ID  # stopped at EOS; else cut at max_completion_length
                lines.append(
                    dict(
                        step=step + 1,
                        prompt=record["prompt"],
                        completion=tokenizer.decode(ids),
                        prompt_ids=prompt_ids,
                        completion_ids=ids,
                    )
                )
    return data, lines


def write_lines(path, lines: list[dict]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    return str(path)


@functools.cache
def trl_run(hf_dir: str, name: str, tmp: str):
    from transformers import AutoTokenizer

    case = settings(name)
    data, lines = made_up_run(AutoTokenizer.from_pretrained(hf_dir), case)
    generations = read_generations(write_lines(f"{tmp}/{name}.jsonl", lines), case["num_iterations"])
    scored = []
    losses, state, metrics = trl_grpo_reference(
        hf_dir,
        data,
        generations,
        reward_funcs=[reward_length, reward_first_token],
        reward_weights=WEIGHTS,
        num_generations=case["num_generations"],
        max_completion_length=MAX_COMPLETION,
        temperature=TEMP,
        beta=case["beta"],
        epsilon_high=case["epsilon_high"],
        loss_type=case["loss_type"],
        scale_rewards=case["scale_rewards"],
        num_iterations=case["num_iterations"],
        mask_truncated_completions=case["mask_truncated_completions"],
        steps=case["steps"],
        per_device_train_batch_size=case["micro"],
        gradient_accumulation_steps=case["gas"],
        lr=LR,
        scored=scored,
        **OPTIM,
    )
    return generations, losses, state, metrics, scored


@pytest.fixture(scope="module")
def trl(tiny_hf, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("grpo_reference"))
    return lambda name: trl_run(tiny_hf, name, tmp)


def row_logps(model, records: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities and entropies [B, T] of each record's completion, one unpadded row at a time."""
    width = max(len(r["completion_ids"]) for r in records)
    logps, entropies = torch.zeros(len(records), width), torch.zeros(len(records), width)
    for i, r in enumerate(records):
        p, c = r["prompt_ids"], r["completion_ids"]
        logits = model(input_ids=torch.tensor([p + c])).logits[:, len(p) - 1 : len(p) + len(c) - 1]
        lp, ent = token_logps_and_entropy(logits, torch.tensor([c]), TEMP)
        logps = logps.index_put((torch.tensor(i), torch.arange(len(c))), lp[0])
        entropies[i, : len(c)] = ent[0].detach()
    return logps, entropies


def plain_loop(hf_dir: str, generations: list[list[dict]], case: dict, slip: str | None = None):
    """models/grpo.py in one process: (losses, state dict, metrics per step, advantages per generation)."""
    from transformers import AutoModelForCausalLM

    def load():
        return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")

    model, ref = load(), load() if case["beta"] else None
    cfg = TrainConfig(optim=OptimConfig(lr=LR, **OPTIM))
    opt = torch.optim.AdamW(
        param_groups(model, cfg.optim.weight_decay), lr=LR, betas=cfg.optim.betas, eps=cfg.optim.eps
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, case["steps"]))
    micro, gas = case["micro"], case["gas"]
    losses, metrics, advantages_seen = [], [], []
    for step in range(case["steps"]):
        records = generations[step // case["num_iterations"]]
        if step % case["num_iterations"] == 0:
            ids = [r["completion_ids"] for r in records]
            per_func = list(zip(reward_length(ids), reward_first_token(ids)))
            rewards = rewards_total(per_func, WEIGHTS)
            advantages, _, frac = group_advantages(rewards, case["num_generations"], case["scale_rewards"])
            advantages_seen.append(advantages)
            mask = torch.zeros(len(records), max(map(len, ids)))
            for i, c in enumerate(ids):
                mask[i, : len(c)] = 0.0 if case["mask_truncated_completions"] and c[-1] != EOS_ID else 1.0
            with torch.no_grad():
                old = row_logps(model, records)[0] if case["num_iterations"] > 1 else None
                reference = row_logps(ref, records)[0] if ref is not None else None
            normalizer = dapo_normalizer(mask.sum(), 1, gas, gas)
            step_metrics = {"reward": rewards.nanmean().item(), "frac_reward_zero_std": frac.item()}
            step_metrics["reward_std"] = rewards[~rewards.isnan()].std().item()
        else:
            step_metrics = {}
        total, micro_metrics = 0.0, []
        for m in range(gas):
            rows = list(range(m, len(records), gas)) if slip == "strided" else list(range(m * micro, (m + 1) * micro))
            logps, entropies = row_logps(model, [records[i] for i in rows])
            loss, got = grpo_loss(
                logps,
                advantages[rows],
                mask[rows, : logps.shape[1]],
                old_per_token_logps=None if old is None else old[rows, : logps.shape[1]],
                ref_per_token_logps=None if reference is None else reference[rows, : logps.shape[1]],
                entropies=entropies,
                epsilon_high=case["epsilon_high"],
                beta=case["beta"],
                loss_type="dapo" if slip == "whole batch" else case["loss_type"],
                max_completion_length=MAX_COMPLETION,
                normalizer=normalizer,
                gradient_accumulation_steps=gas,
            )
            loss.backward()
            total += loss.item()
            micro_metrics.append({k: v.item() for k, v in got.items()})
        step_metrics["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["max_grad_norm"]).item()
        opt.step()
        schedule.step()
        opt.zero_grad()
        losses.append(total)
        for k in micro_metrics[0]:
            step_metrics[k] = sum(x[k] for x in micro_metrics) / gas
        metrics.append(step_metrics)
    return losses, {k: v.detach() for k, v in model.state_dict().items()}, metrics, advantages_seen


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-6)


def weight_gap(ours: dict, theirs: dict, hf_dir: str) -> float:
    """||ours - TRL's|| / ||TRL's update||, all tensors as one vector."""
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    gap = sum(((ours[k] - w) ** 2).sum() for k, w in theirs.items())
    return math.sqrt(gap / sum(((w - initial[k]) ** 2).sum() for k, w in theirs.items()))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_the_reference_trains_what_models_grpo_trains(tiny_hf, trl, name):
    case = settings(name)
    generations, trl_losses, trl_state, trl_metrics, scored = trl(name)
    ends = [r["completion_ids"][-1] == EOS_ID for records in generations for r in records]
    assert any(ends) and not all(ends)  # some stopped at EOS, some cut at max_completion_length
    losses, state, metrics, advantages = plain_loop(tiny_hf, generations, case)
    loss_gap, weights = max(map(rel, losses, trl_losses)), weight_gap(state, trl_state, tiny_hf)
    print(f"{name}: losses {trl_losses}, loss gap {loss_gap:.1e}, weights {weights:.1e} of TRL's update")
    assert len(losses) == len(trl_losses) == case["steps"]
    assert loss_gap < RTOL and weights < RTOL, (losses, trl_losses, weights)
    for step, (mine, theirs) in enumerate(zip(metrics, trl_metrics, strict=True)):
        for key in [k for k in COMPARED_METRICS if k in mine or k in theirs] + ["grad_norm"]:
            assert rel(mine[key], theirs[key]) < RTOL, (step, key, mine[key], theirs[key])
    assert len(scored) == len(advantages) == len(generations)
    for ours, theirs in zip(advantages, scored):
        torch.testing.assert_close(ours, torch.tensor(theirs["advantages"]), rtol=RTOL, atol=1e-6)
    assert any(m["grad_norm"] > OPTIM["max_grad_norm"] for m in metrics)  # clipping takes part


SLIPS = {  # a slip -> the case it shows on
    "whole batch": "bnpo-mask-truncated",  # bnpo divided by the generation batch's tokens, not the micro-batch's
    "strided": "bnpo-2-iterations",  # micro-batch m holding rows m, m + gas, ... (a rank-strided split)
}


@pytest.mark.slow
@pytest.mark.parametrize("slip", list(SLIPS))
def test_a_wrong_normalisation_breaks_the_tolerance(tiny_hf, trl, slip):
    name = SLIPS[slip]
    generations, trl_losses, trl_state, _, _ = trl(name)
    losses, state, _, _ = plain_loop(tiny_hf, generations, settings(name), slip=slip)
    gaps = max(map(rel, losses, trl_losses)), weight_gap(state, trl_state, tiny_hf)
    print(f"{slip} on {name}: loss gap {gaps[0]:.1e}, weights {gaps[1]:.1e} of TRL's update")
    assert min(gaps) > 100 * RTOL, gaps


def test_completions_are_read_with_or_without_reuse_lines(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer

    case = {**settings("bnpo-2-iterations"), "steps": 4}
    _, lines = made_up_run(AutoTokenizer.from_pretrained(tokenizer_dir), case)
    sparse = read_generations(write_lines(tmp_path / "a.jsonl", lines), 2)
    reused = [{**line, "step": line["step"] + 1} for line in lines]
    every = read_generations(write_lines(tmp_path / "b.jsonl", sorted(lines + reused, key=lambda x: x["step"])), 2)
    assert len(sparse) == 2 and every == sparse and [len(g) for g in sparse] == [8, 8]
    wrong = [{**line, "completion_ids": [5]} if line["step"] == 2 else line for line in lines + reused]
    with pytest.raises(ValueError, match="step 2 reuses step 1's generation, but its lines hold other"):
        read_generations(write_lines(tmp_path / "c.jsonl", wrong), 2)
    with pytest.raises(ValueError, match="step 3 generates .num_iterations=2. but has no lines"):
        read_generations(write_lines(tmp_path / "d.jsonl", [line for line in lines if line["step"] != 3] + reused), 2)
