"""models/grpo.py's GRPO math trains what TRL 1.16's GRPOTrainer trains: loss, metrics, advantages and weights.

TRL route: GRPOTrainer on the tiny random Llama (fp32, SGD lr 0.5, constant, no gradient clipping, temperature 0.7),
completions handed in by a ``rollout_func`` (prompts of equal length, completions of 3-8 tokens, so the masks differ),
two reward functions (one leaves some completions unscored) weighted 1 and 0.5, 2 prompts x 4 generations per
generation batch, micro-batches of 4, gradient accumulation 2, 3 optimizer steps, the generation batch not shuffled.
Our route: the same model loaded by Hugging Face, the same rows in the same order, ``group_advantages``,
``rewards_total``, ``token_logps_and_entropy`` and ``grpo_loss``. Each micro-batch's loss, the logged metrics and the
advantages within 1e-5 relative, the final weights within 1e-5 of TRL's update, for each loss type, beta 0 and 0.04,
num_iterations 1 and 2 (ratios then clipped), scale_rewards group, batch and none. ``dapo`` normalised per sequence
or by the micro-batch's own tokens, or the KL without TRL's importance-ratio factor, lands far outside. TRL's
``_compute_loss`` itself, on a stand-in trainer, gives our loss, gradient and metrics for each loss type with
``delta``, ``epsilon_high`` and an empty row; the tempered log-probabilities and entropies are TRL's.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from models.grpo import dapo_normalizer, group_advantages, grpo_loss, nanstd, rewards_total, token_logps_and_entropy

NUM_GEN, MICRO, GRAD_ACC, STEPS, LR, TEMP, PROMPT_LEN = 4, 4, 2, 3, 0.5, 0.7, 6
RTOL, ATOL = 1e-5, 1e-7  # ATOL: grpo's loss is a mean of advantages, ~0 when the ratio is 1
CASES = [  # loss_type, beta, num_iterations, scale_rewards
    ("dapo", 0.0, 1, "group"),
    ("dapo", 0.04, 2, "group"),
    ("grpo", 0.04, 1, "batch"),
    ("bnpo", 0.0, 2, "none"),
    ("dr_grpo", 0.04, 2, "group"),
]
MAX_COMPLETION = 8


def _prompt_table(num_prompts: int = 6):
    """Per prompt: its text, ids and NUM_GEN completions of 3-8 random tokens (ids above the special tokens)."""
    g = torch.Generator().manual_seed(0)
    table = {}
    for p in range(num_prompts):
        ids = torch.randint(3, 512, (PROMPT_LEN,), generator=g).tolist()
        lengths = torch.randint(3, MAX_COMPLETION + 1, (NUM_GEN,), generator=g).tolist()
        completions = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]
        table[f"prompt {p}"] = (ids, completions)
    return table


TABLE = _prompt_table()


def reward_length(completion_ids, **kwargs):
    return [len(ids) / MAX_COMPLETION for ids in completion_ids]


def reward_first_token(completion_ids, **kwargs):
    return [None if len(ids) == 5 else float(ids[0] % 7) for ids in completion_ids]


WEIGHTS = [1.0, 0.5]


def _rollout(prompts, trainer):
    seen: dict[str, int] = {}
    prompt_ids, completion_ids = [], []
    for p in prompts:
        k = seen[p] = seen.get(p, -1) + 1
        prompt_ids.append(TABLE[p][0])
        completion_ids.append(TABLE[p][1][k])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def _run_trl(hf_dir, tmp_path, loss_type, beta, num_iterations, scale_rewards):
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer import grpo_trainer

    class Recording(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            self.record["advantages"].append(out["advantages"].clone())
            self.record["frac_reward_zero_std"].append(self._metrics["train"]["frac_reward_zero_std"][-1])
            return out

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            metrics = {k: v[-1] for k, v in self._metrics["train"].items() if k in METRIC_NAMES}
            self.record["steps"].append((loss.item(), metrics))
            return loss

    config = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=GRAD_ACC,
        num_generations=NUM_GEN,
        max_completion_length=MAX_COMPLETION,
        max_steps=STEPS,
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        temperature=TEMP,
        loss_type=loss_type,
        beta=beta,
        num_iterations=num_iterations,
        scale_rewards=scale_rewards,
        reward_weights=WEIGHTS,
        shuffle_dataset=False,
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        save_strategy="no",
        logging_steps=1,
        seed=0,
        model_init_kwargs={"dtype": torch.float32},
    )
    trainer = Recording(
        model=hf_dir,
        reward_funcs=[reward_length, reward_first_token],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": list(TABLE)}),
        processing_class=AutoTokenizer.from_pretrained(hf_dir),
        rollout_func=_rollout,
    )
    trainer.record = {"advantages": [], "frac_reward_zero_std": [], "steps": []}
    # TRL shuffles the rows of a generation batch before cutting micro-batches; the same order on both sides
    original = grpo_trainer.shuffle_sequence_dict
    grpo_trainer.shuffle_sequence_dict = lambda d: d
    try:
        trainer.train()
    finally:
        grpo_trainer.shuffle_sequence_dict = original
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return trainer.record, weights


METRIC_NAMES = (
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
)


def _generation_batches(num_iterations):
    """The prompts of each generation batch in TRL's order (2 prompts, each NUM_GEN times), one per
    ``num_iterations`` optimizer steps."""
    names = list(TABLE)
    per_batch = MICRO * GRAD_ACC // NUM_GEN
    count = math.ceil(STEPS / num_iterations)
    return [[n for n in names[b * per_batch : (b + 1) * per_batch] for _ in range(NUM_GEN)] for b in range(count)]


def _rows(prompts):
    """Input ids [N, P + C], attention mask and completion mask [N, C] as TRL pads them (completions on the right)."""
    out = _rollout(prompts, None)
    width = max(len(c) for c in out["completion_ids"])
    ids, cmask = [], []
    for p, c in zip(out["prompt_ids"], out["completion_ids"]):
        ids.append(p + c + [2] * (width - len(c)))  # pad = eos (the tiny tokenizer has no pad token)
        cmask.append([1] * len(c) + [0] * (width - len(c)))
    cmask = torch.tensor(cmask)
    attention = torch.cat([torch.ones(len(ids), PROMPT_LEN, dtype=torch.long), cmask], dim=1)
    return torch.tensor(ids), attention, cmask, out["completion_ids"]


def _logps(model, ids, attention, width):
    logits = model(input_ids=ids, attention_mask=attention).logits[:, -width - 1 : -1]
    logps, entropy = token_logps_and_entropy(logits, ids[:, -width:], TEMP)
    mask = attention[:, -width:].bool()
    return logps.masked_fill(~mask, 0.0), entropy.masked_fill(~mask, 0.0)


def _run_ours(hf_dir, loss_type, beta, num_iterations, scale_rewards, change=None):
    """The same steps with models/grpo.py; ``change``: other arguments of ``grpo_loss`` (to show they matter)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32) if beta else None
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    record = {"advantages": [], "frac_reward_zero_std": [], "steps": []}
    step = 0
    for prompts in _generation_batches(num_iterations):
        ids, attention, cmask, completions = _rows(prompts)
        width = cmask.shape[1]
        per_func = list(zip(reward_length(completions), reward_first_token(completions)))
        adv, _, frac = group_advantages(rewards_total(per_func, WEIGHTS), NUM_GEN, scale_rewards)
        record["advantages"].append(adv)
        record["frac_reward_zero_std"].append(frac.item())
        with torch.no_grad():
            old = _logps(model, ids, attention, width)[0] if num_iterations > 1 else None
            ref_logps = _logps(ref, ids, attention, width)[0] if beta else None
        normalizer = dapo_normalizer(cmask.sum(), 1, GRAD_ACC, GRAD_ACC)
        for _ in range(num_iterations):
            if step == STEPS:
                break
            for m in range(GRAD_ACC):
                rows = slice(m * MICRO, (m + 1) * MICRO)
                logps, entropy = _logps(model, ids[rows], attention[rows], width)
                args = dict(
                    old_per_token_logps=None if old is None else old[rows],
                    ref_per_token_logps=None if ref_logps is None else ref_logps[rows],
                    entropies=entropy,
                    beta=beta,
                    loss_type=loss_type,
                    max_completion_length=MAX_COMPLETION,
                    normalizer=normalizer,
                    gradient_accumulation_steps=GRAD_ACC,
                )
                loss, metrics = grpo_loss(logps, adv[rows], cmask[rows], **{**args, **(change or {})})
                loss.backward()
                record["steps"].append((loss.item(), {k: v.item() for k, v in metrics.items()}))
            opt.step()
            opt.zero_grad()
            step += 1
    return record, {k: v.detach() for k, v in model.state_dict().items()}


_TRL_RUNS: dict = {}


@pytest.fixture()
def trl_run(tiny_hf, tmp_path):
    def get(case):
        if case not in _TRL_RUNS:
            _TRL_RUNS[case] = _run_trl(tiny_hf, tmp_path, *case)
        return _TRL_RUNS[case]

    return get


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), ATOL / RTOL)


def _loss_gap(ours, trl) -> float:
    return max(_rel(a[0], b[0]) for a, b in zip(ours["steps"], trl["steps"], strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_steps_equal_trl(tiny_hf, trl_run, case):
    trl, trl_weights = trl_run(case)
    ours, our_weights = _run_ours(tiny_hf, *case)
    assert len(trl["steps"]) == len(ours["steps"]) == STEPS * GRAD_ACC
    assert _loss_gap(ours, trl) <= RTOL, [(a[0], b[0]) for a, b in zip(ours["steps"], trl["steps"])]
    for (_, mine), (_, theirs) in zip(ours["steps"], trl["steps"]):
        assert set(mine) == set(theirs), (sorted(mine), sorted(theirs))
        for k in mine:
            assert _rel(mine[k], theirs[k]) <= RTOL, (k, mine[k], theirs[k])
    for a, b in zip(ours["advantages"], trl["advantages"], strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    assert ours["frac_reward_zero_std"] == trl["frac_reward_zero_std"]
    assert _weight_gap(our_weights, trl_weights, _initial_weights(tiny_hf)) <= RTOL


def _weight_gap(ours, trl, initial) -> float:
    """How far our final weights are from TRL's, relative to the size of TRL's update (all tensors together)."""
    gap = sum(((ours[k] - w) ** 2).sum() for k, w in trl.items())
    update = sum(((w - initial[k]) ** 2).sum() for k, w in trl.items())
    return math.sqrt(gap / update)


def _initial_weights(hf_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


WRONG = {  # what a plausible slip changes -> the case it is shown on
    "dapo per sequence": ({"loss_type": "grpo"}, CASES[0]),
    "dapo over the micro-batch's tokens": ({"loss_type": "bnpo"}, CASES[0]),
    "KL without TRL's bias correction": ({"use_bias_correction_kl": False}, CASES[1]),
}


@pytest.mark.slow
@pytest.mark.parametrize("wrong", list(WRONG))
def test_a_slip_breaks_the_tolerance(tiny_hf, trl_run, wrong):
    change, case = WRONG[wrong]
    trl, trl_weights = trl_run(case)
    ours, our_weights = _run_ours(tiny_hf, *case, change=change)
    gaps = _loss_gap(ours, trl), _weight_gap(our_weights, trl_weights, _initial_weights(tiny_hf))
    assert max(gaps) > 100 * RTOL, gaps


def test_advantages_equal_trl_formulas_in_each_scale_mode():
    from trl.trainer.utils import nanstd as trl_nanstd

    per_func = [[1.0, None], [None, None], [3.0, 2.0], [2.0, None], [2.0, None], [1.0, 2.0]]
    rewards = rewards_total(per_func, [1.0, 0.5])
    assert torch.isnan(rewards[1]) and rewards[:3:2].tolist() == [1.0, 4.0] and rewards[3:].tolist() == [2.0] * 3
    first = torch.tensor([1.0, 4.0])
    group, std, frac = group_advantages(rewards, 3, "group")
    assert group[1].item() == 0.0  # unscored: no signal
    assert group[0].item() == pytest.approx(((1.0 - 2.5) / (first.std() + 1e-4)).item(), rel=1e-6)
    assert group[3:].tolist() == [0.0] * 3 and frac.item() == 0.5  # second group: std 0
    batch, std, frac = group_advantages(rewards, 3, "batch")
    assert std[0].item() == pytest.approx(trl_nanstd(rewards).item(), rel=1e-6)
    assert std[0].item() == pytest.approx(torch.tensor([1.0, 4.0, 2.0, 2.0, 2.0]).std().item(), rel=1e-6)
    assert batch[0].item() == pytest.approx((-1.5 / (std[0] + 1e-4)).item(), rel=1e-6) and frac.item() == 0.0
    none, _, frac = group_advantages(rewards, 3, "none")
    assert none.tolist() == [-1.5, 0.0, 1.5, 0.0, 0.0, 0.0] and frac.item() == 0.5
    x = torch.tensor([[1.0, math.nan, 4.0], [2.0, math.nan, math.nan]])
    torch.testing.assert_close(nanstd(x, dim=1), trl_nanstd(x, dim=1), equal_nan=True)


def test_logps_divide_logits_by_temperature_as_trl():
    from trl.trainer.utils import selective_log_softmax_and_entropy

    g = torch.Generator().manual_seed(1)
    logits, ids = torch.randn(2, 5, 11, generator=g), torch.randint(0, 11, (2, 5), generator=g)
    logps, entropy = token_logps_and_entropy(logits, ids, TEMP)
    ref_logps, ref_entropy = selective_log_softmax_and_entropy(logits, ids, temperature=TEMP)
    torch.testing.assert_close(logps, ref_logps, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-6, atol=1e-6)


def test_settings_refused_with_their_values():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError) as e:
        grpo_loss(x, torch.zeros(1), x, loss_type="cispo", importance_sampling_level="sequence", beta=0.1)
    assert str(e.value) == (
        "loss_type='cispo' is not one of grpo, bnpo, dr_grpo, dapo; importance_sampling_level='sequence': only "
        "'token' is implemented; beta=0.1 needs ref_per_token_logps (or set beta=0)"
    )
    with pytest.raises(ValueError, match="scale_rewards='std'"):
        group_advantages(torch.zeros(4), 2, "std")


def _trl_compute_loss(logps, entropies, inputs, **settings):
    """TRL's ``GRPOTrainer._compute_loss`` itself, on a stand-in trainer whose model returns ``logps``: one process."""
    from collections import defaultdict
    from types import SimpleNamespace

    from trl import GRPOTrainer

    one_process = SimpleNamespace(
        num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x, gather_for_metrics=lambda x: x
    )
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logps, entropies, None),
        accelerator=one_process,
        args=SimpleNamespace(
            use_bias_correction_kl=settings["use_bias_correction_kl"],
            delta=settings["delta"],
            steps_per_generation=settings["gradient_accumulation_steps"],
        ),
        model=SimpleNamespace(training=True),
        beta=settings["beta"],
        loss_type=settings["loss_type"],
        epsilon_low=settings["epsilon"],
        epsilon_high=settings["epsilon_high"],
        max_completion_length=settings["max_completion_length"],
        current_gradient_accumulation_steps=settings["gradient_accumulation_steps"],
        importance_sampling_level="token",
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=False,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list)},
    )
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta,delta,bias_correction", [(0.0, None, True), (0.1, 1.3, True), (0.1, None, False)])
def test_loss_and_metrics_equal_trl_compute_loss(loss_type, beta, delta, bias_correction):
    """Off-policy rows (ratios past both clip edges), a row with no active token, epsilon_high != epsilon."""
    g = torch.Generator().manual_seed(2)
    rows, width = 8, 7
    mask = (torch.rand(rows, width, generator=g) > 0.3).long()
    mask[2] = 0
    logps = (-torch.rand(rows, width, generator=g) * 3).requires_grad_()
    old = (logps + 0.6 * torch.randn(rows, width, generator=g)).detach()
    ref = (logps + 0.3 * torch.randn(rows, width, generator=g)).detach()
    entropies = torch.rand(rows, width, generator=g) * 5
    advantages = torch.randn(rows, generator=g)
    settings = dict(
        beta=beta,
        delta=delta,
        use_bias_correction_kl=bias_correction,
        loss_type=loss_type,
        epsilon=0.2,
        epsilon_high=0.28,
        max_completion_length=10,
        gradient_accumulation_steps=2,
    )
    inputs = {
        "prompt_ids": torch.zeros(rows, 2, dtype=torch.long),
        "prompt_mask": torch.ones(rows, 2, dtype=torch.long),
        "completion_ids": torch.zeros(rows, width, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum() * 3,  # the generation batch: this micro-batch and others
    }
    if beta:
        inputs["ref_per_token_logps"] = ref
    trl_loss, trl_metrics = _trl_compute_loss(logps, entropies, inputs, **settings)
    (trl_grad,) = torch.autograd.grad(trl_loss, logps)
    normalizer = dapo_normalizer(inputs["num_items_in_batch"], 1, 2, 2)
    loss, metrics = grpo_loss(
        logps, advantages, mask, old_per_token_logps=old, ref_per_token_logps=ref if beta else None,
        entropies=entropies, normalizer=normalizer, **settings,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, logps)
    assert loss.item() == pytest.approx(trl_loss.item(), rel=1e-6)
    torch.testing.assert_close(grad, trl_grad, rtol=1e-6, atol=1e-9)
    assert {k: v.item() for k, v in metrics.items()} == pytest.approx(trl_metrics, rel=1e-6)
    assert 0 < trl_metrics["clip_ratio/low_mean"] and 0 < trl_metrics["clip_ratio/high_mean"]
