"""train_objective=dpo trains what TRL's DPOTrainer trains.

Unit tier: pairs tokenized as DPOTrainer tokenizes them (plain and conversational), per-sequence log-probabilities
from the chunked head equal to the whole logits' (values and gradients), the loss and metrics TRL's formulas
give, the collated micro-batch (chosen rows, then rejected), bad rows named by file and line, and the settings
refused before start.

Multi-rank: pipe 2 x data 2 (micro-batches of 2 pairs, grad_acc 2: a global batch of 8 pairs), five fp32 steps,
constant lr, no clipping, samples in order, against DPOTrainer on the same pairs in one process (per-device batch
8): full fine-tuning on plain-text pairs and LoRA on conversational ones. Per-step loss within 1e-5 relative and
rewards/margins within 1e-5 of the log-probability terms they are differences of, the exported weights and
adapter equal to TRL's model. A single-process loop that equals TRL shows that a per-token mean instead of a sum,
or no reference, lands far outside that tolerance. The full run resumes
from its step-3 checkpoint on another layout (pipe 2 x data 1, grad_acc 4) with the reference read from the run's
copy, and ends where TRL ends.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from data.cache import DataSettings, TokenBlocks
from data.preference_pairs import PairBlocks
from data.records import DataError, SourceStats
from data.render import read_examples
from data.sampling import collate_pairs
from models.loss import IGNORE_INDEX, PreferenceLoss, sequence_logps
from models.tiny import write_preference_pairs
from tests.support.models import make_hf_dir
from tests.support.parity import parity_args
from tests.support.ranks import run_deepspeed
from tests.support.runs import read_metrics
from tests.support.scripts import load_entry_point

SEQ, MICRO, STEPS, PAIRS, GLOBAL = 64, 2, 5, 40, 8
REL_TOL = 1e-5
# Final weights, all as one vector: DPO's gradient is a difference of two sequences' gradients, so fp32 summation
# order moves them more than SFT's; DPOTrainer against itself with its batch of 8 as 4 accumulated micro-batches
# of 2 differs by 2.4e-5 here (5 steps at LR)
WEIGHT_TOL = 1e-4
# Margins far from the fp32 noise of the log-probability sums they are differences of (a few 1e-7 absolute)
LR, LORA_LR = 5e-3, 1e-2
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def chat_hf(tmp_path_factory, tokenizer_dir) -> str:
    """The tiny untied Llama with a tokenizer that has a chat template."""
    from transformers import AutoTokenizer

    hf_dir = make_hf_dir(tmp_path_factory.mktemp("dpo_hf"), tokenizer_dir, "tiny")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(hf_dir)
    return hf_dir


@pytest.fixture(scope="module")
def pairs_files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("dpo_data")
    files = {}
    for name, n, seed, chat in (("plain", PAIRS, 0, False), ("chat", PAIRS, 1, True), ("eval", GLOBAL, 2, False)):
        files[name] = str(root / f"{name}.jsonl")
        # LoRA's margins grow slower: a preference it learns keeps them far from zero (and from fp32 noise)
        write_preference_pairs(files[name], n, seed=seed, conversational=chat, shorter_chosen=chat)
    return files


def dpo_trainer(hf_dir: str, data: str, out: str, model=None, eval_data: str | None = None, lr: float = LR, **args):
    """TRL's DPOTrainer on ``data`` in file order: one process, fp32, the global batch as its per-device batch, constant
    lr, AdamW with this project's defaults (betas 0.9/0.95, eps 1e-8), no clipping; each training step's loss and
    rewards/margins recorded as computed (Trainer's logged loss is rounded)."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    class Recording(DPOTrainer):
        steps: list = []

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if model.training:
                self.steps.append((loss.item(), self._metrics["train"]["rewards/margins"][-1]))
            return loss

    config = DPOConfig(
        output_dir=out,
        per_device_train_batch_size=GLOBAL,
        per_device_eval_batch_size=GLOBAL,
        gradient_accumulation_steps=1,
        max_steps=STEPS,
        learning_rate=lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        optim="adamw_torch",
        max_grad_norm=0.0,
        max_length=SEQ,
        train_sampling_strategy="sequential",
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        seed=0,
        bf16=False,  # TRL's default is bf16 autocast, on CPU too
        gradient_checkpointing=False,  # TRL's default is on: the same numbers, recomputed
        **args,
    )
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")
    trainer = Recording(
        model=model,
        args=config,
        train_dataset=load_dataset("json", data_files=data, split="train"),
        eval_dataset=load_dataset("json", data_files=eval_data, split="train") if eval_data else None,
        processing_class=AutoTokenizer.from_pretrained(hf_dir),
    )
    trainer.steps = []
    trainer.train()
    return trainer


# ---------- unit tier ----------


@pytest.mark.parametrize("name", ["plain", "chat"])
def test_pairs_are_tokenized_as_dpo_trainer_tokenizes_them(chat_hf, pairs_files, tmp_path, name):
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(chat_hf)
    short = 24  # some sequences truncated (keep_start), as TRL's collator truncates them
    stats = SourceStats()
    ours = list(read_examples(pairs_files[name], "dpo", tok, short, 512, False, stats))
    trainer = DPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(chat_hf),
        args=DPOConfig(output_dir=str(tmp_path), max_length=short, report_to="none", use_cpu=True),
        train_dataset=load_dataset("json", data_files=pairs_files[name], split="train"),
        processing_class=tok,
    )
    rows = list(trainer.train_dataset)
    # pairs whose prompt fills the row dropped as TRL drops them, others truncated (keep_start)
    assert len(ours) == 2 * len(rows) and stats.dropped_no_trainable == PAIRS - len(rows) > 0 and stats.truncated > 0
    for i, row in enumerate(rows):
        prompt = len(row["prompt_ids"])
        for k, completion in enumerate((row["chosen_ids"], row["rejected_ids"])):
            ids = (row["prompt_ids"] + completion)[:short]
            assert ours[2 * i + k].input_ids == ids
            assert ours[2 * i + k].labels == [IGNORE_INDEX] * prompt + ids[prompt:]


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "a", "chosen": "b"}, "plain.jsonl:2: missing field(s) 'rejected' of a preference row"),
        (
            {"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}], "rejected": "c"},
            "plain.jsonl:2: 'prompt', 'chosen' and 'rejected' must all be strings (plain text) or all lists",
        ),
    ],
)
def test_bad_pairs_are_named_by_file_and_line(chat_hf, tmp_path, row, message):
    from transformers import AutoTokenizer

    path = tmp_path / "plain.jsonl"
    path.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n" + json.dumps(row) + "\n")
    tok = AutoTokenizer.from_pretrained(chat_hf)
    with pytest.raises(DataError, match="skip_bad_lines") as e:
        list(read_examples(str(path), "dpo", tok, SEQ, 512, False, SourceStats()))
    assert message in str(e.value)
    stats = SourceStats()
    assert len(list(read_examples(str(path), "dpo", tok, SEQ, 512, True, stats))) == 2 and stats.skipped_bad_lines == 1


def test_a_pair_whose_prompt_fills_the_row_is_dropped_and_counted(chat_hf, tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / "long.jsonl"
    rows = [{"prompt": "word " * 80, "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b", "rejected": "c"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats = SourceStats()
    examples = list(read_examples(str(path), "dpo", AutoTokenizer.from_pretrained(chat_hf), SEQ, 512, False, stats))
    assert len(examples) == 2 and stats.dropped_no_trainable == 1


def test_pairs_collate_chosen_rows_then_rejected_with_their_reference(chat_hf, pairs_files, tmp_path):
    from data.cache import build_or_reuse

    settings = DataSettings(
        format="dpo", max_seq_length=SEQ, packing=False, skip_bad_lines=False, pad_id=0, vocab_size=512
    )
    entry, meta = build_or_reuse(pairs_files["plain"], settings, chat_hf, str(tmp_path), lambda m: None)
    rows = TokenBlocks(entry)
    pairs = PairBlocks(rows)
    assert meta["num_samples"] == 2 * PAIRS and len(pairs) == PAIRS
    (ids, _), (labels, ids_of_pairs, reference) = collate_pairs([pairs[3], pairs[7]], pad_multiple=8)
    assert torch.isnan(reference).all()  # no reference attached: the loss refuses it (below)
    assert ids_of_pairs.tolist() == [3, 7] and ids.shape[0] == 4 and ids.shape[1] % 8 == 0
    for row, source in enumerate((6, 14, 7, 15)):  # chosen 3, chosen 7, rejected 3, rejected 7
        assert torch.equal(ids[row], rows[source]["input_ids"][: ids.shape[1]])
    table = torch.arange(2 * PAIRS, dtype=torch.float32).view(PAIRS, 2).numpy()
    pairs.attach_reference(table)
    split = pairs.subset(torch.tensor([7, 3]).numpy())
    _, (_, ids_of_pairs, reference) = collate_pairs([split[0], split[1]])
    assert ids_of_pairs.tolist() == [7, 3] and reference.tolist() == [14.0, 6.0, 15.0, 7.0]
    assert len(split) == 2 and split.lengths().shape == (2,)


def test_chunked_sequence_logps_equal_the_whole_logits(chat_hf):
    torch.manual_seed(0)
    hidden = torch.randn(4, 16, 32, dtype=torch.float64, requires_grad=True)  # [R,S,H]
    weight = torch.randn(50, 32, dtype=torch.float64, requires_grad=True)  # [V,H]
    labels = torch.randint(0, 50, (4, 16))
    labels[:, :5] = IGNORE_INDEX
    labels[1, 12:] = IGNORE_INDEX
    whole = sequence_logps(hidden @ weight.t(), labels)  # [R]
    expected = torch.stack(
        [
            torch.log_softmax((hidden[r] @ weight.t())[:-1], -1)
            .gather(1, labels[r, 1:].clamp(min=0)[:, None])[:, 0]
            .masked_fill(labels[r, 1:] == IGNORE_INDEX, 0)
            .sum()
            for r in range(4)
        ]
    )
    chunked = sequence_logps((hidden, weight), labels, chunk_tokens=7)
    assert torch.allclose(whole.double(), expected, rtol=1e-6) and torch.allclose(chunked, whole, rtol=1e-6)
    mix = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    grads = [torch.autograd.grad((out.double() * mix).sum(), (hidden, weight)) for out in (whole, chunked)]
    assert all((a - b).abs().max() < 1e-6 * a.abs().max() for a, b in zip(*grads))  # fp32 logits per chunk


def dpo_formula(chosen, rejected, ref_c, ref_r, beta, loss_type, smoothing=0.0, counts=None):
    """TRL 1.16's sigmoid and ipo (dpo_trainer.py), and conservative DPO (TRL 0.x's sigmoid with label smoothing)."""
    import torch.nn.functional as F

    delta = (chosen - ref_c) - (rejected - ref_r)
    if loss_type == "ipo":
        delta = (chosen - ref_c) / counts[0] - (rejected - ref_r) / counts[1]
        return ((delta - 1 / (2 * beta)) ** 2).mean()
    return (-F.logsigmoid(beta * delta) * (1 - smoothing) - F.logsigmoid(-beta * delta) * smoothing).mean()


@pytest.mark.parametrize("loss_type, smoothing", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0)])
def test_the_loss_and_metrics_are_trls(loss_type, smoothing):
    torch.manual_seed(1)
    logits = torch.randn(6, 10, 20)  # 3 pairs: rows 0-2 chosen, 3-5 rejected
    labels = torch.randint(0, 20, (6, 10))
    labels[:, :4] = IGNORE_INDEX
    labels[4, 7:] = IGNORE_INDEX
    reference = torch.randn(6, dtype=torch.float64) * 3 - 20
    loss_fn = PreferenceLoss(0, beta=0.3, loss_type=loss_type, label_smoothing=smoothing)
    loss = loss_fn(logits, (labels, torch.arange(3), reference))
    logps = sequence_logps(logits, labels)
    counts = (labels != IGNORE_INDEX).sum(1).float()
    expected = dpo_formula(*logps.chunk(2), *reference.chunk(2), 0.3, loss_type, smoothing, counts.chunk(2))
    assert torch.allclose(loss.double(), expected, rtol=1e-6)
    stats = loss_fn.take_stats()
    rewards = [0.3 * (lp - ref) for lp, ref in zip(logps.chunk(2), reference.chunk(2))]
    assert stats[0] == 3 and torch.allclose(stats[1:3], torch.stack([r.sum() for r in rewards]))
    assert stats[3] == (rewards[0] > rewards[1]).sum() and torch.allclose(stats[5], logps[:3].sum())
    assert loss_fn.take_stats().abs().sum() == 0  # taken: the next step starts from zero
    with pytest.raises(RuntimeError, match="without its reference"):
        loss_fn(logits, (labels, torch.arange(3), torch.full((6,), float("nan"), dtype=torch.float64)))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(train_objective="sft"), "train_objective=sft with data.format=dpo"),
        (dict(packing=True), "data.packing=true with train_objective=dpo"),
        (dict(beta=0.0), "dpo.beta 0.0 must be > 0"),
        (dict(loss_type="ipo", label_smoothing=0.1), "dpo.label_smoothing 0.1 smooths the sigmoid loss"),
        (dict(loss_normalization="micro_batch"), "loss_normalization=micro_batch: normalises the next-token loss"),
    ],
)
def test_dpo_settings_are_checked_before_start(tmp_path, chat_hf, pairs_files, change, message):
    from training.configuration.schema import ConfigError, DataConfig, DPOConfig, TrainConfig
    from training.configuration.validate import resolve

    cfg = TrainConfig(
        model_name_or_path=_converted(chat_hf, tmp_path),
        output_dir=str(tmp_path / "out"),
        train_objective=change.get("train_objective", "dpo"),
        data=DataConfig(train_file=pairs_files["plain"], format="dpo", packing=change.get("packing", False)),
        dpo=DPOConfig(**{k: v for k, v in change.items() if k in ("beta", "loss_type", "label_smoothing")}),
        loss_normalization=change.get("loss_normalization", "tokens"),
    )
    with pytest.raises(ConfigError) as e:
        resolve(cfg, world_size=1)
    assert message in str(e.value)


def test_dpo_settings_without_dpo_are_refused(tmp_path, chat_hf, pairs_files):
    from training.configuration.schema import ConfigError, DataConfig, DPOConfig, TrainConfig
    from training.configuration.validate import resolve

    cfg = TrainConfig(
        model_name_or_path=_converted(chat_hf, tmp_path),
        output_dir=str(tmp_path / "out"),
        data=DataConfig(train_file=pairs_files["plain"], format="sft"),
        dpo=DPOConfig(beta=0.5),
    )
    with pytest.raises(ConfigError, match="dpo.beta=0.5: DPO settings, but train_objective is sft"):
        resolve(cfg, world_size=1)


def _converted(hf_dir: str, tmp_path) -> str:
    from models.files.hf_convert import hf_to_stages

    out = str(tmp_path / "ckpt")
    if not os.path.isdir(out):
        hf_to_stages(hf_dir, out)
    return out


# ---------- multi-rank: pipe 2 x data 2 against DPOTrainer ----------


def train_args(ckpt: str, data: str, out: str, lr: float = LR, **overrides) -> list[str]:
    optim = dict(lr=lr, max_grad_norm=0.0)
    return ["data=dpo", *parity_args(ckpt, data, out, SEQ, MICRO, STEPS, optim, **overrides)]


def pair_batches(cache: str, source: str) -> list[list[dict]]:
    """The pairs of each global batch train.py trains on (shuffle off): its cache entry's pairs 8s .. 8s + 7."""
    for entry in os.listdir(cache):
        meta = os.path.join(cache, entry, "meta.json")
        if os.path.isfile(meta) and json.load(open(meta))["source"] == os.path.abspath(source):
            pairs = PairBlocks(TokenBlocks(os.path.join(cache, entry)))
            return [[pairs[i] for i in range(s * GLOBAL, (s + 1) * GLOBAL)] for s in range(STEPS)]
    raise FileNotFoundError(source)


def own_dpo_losses(hf_dir: str, batches: list[list[dict]], aggregate: str, reference: bool) -> list[float]:
    """A plain single-process DPO loop (HF model, AdamW as above): per-sequence ``sum`` (TRL's) or ``mean`` over the
    completion tokens, with the reference model's log-probabilities or none (zeros)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")
    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    def logps(m, samples) -> torch.Tensor:
        (ids, pos), (labels, _, _) = collate_pairs(samples)
        out = sequence_logps(m(input_ids=ids, position_ids=pos).logits, labels)
        return out / (labels[:, 1:] != IGNORE_INDEX).sum(1) if aggregate == "mean" else out

    losses = []
    for samples in batches:
        with torch.no_grad():
            ref_logps = logps(ref, samples) if reference else torch.zeros(2 * len(samples))
        loss = dpo_formula(*logps(model, samples).chunk(2), *ref_logps.chunk(2), 0.1, "sigmoid")
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def margin_err(record: dict, theirs: float, prefix: str = "") -> float:
    """A margin's error relative to what it is the difference of: beta x (policy - reference log-probabilities) of
    the chosen and the rejected sums (~100 each), whose fp32 noise (a few 1e-7 of them) a margin near 0 keeps whole
    (step 5's 0.050 missed by 1.3e-5 of itself, 2.7e-8 of its terms)."""
    scale = 0.1 * (abs(record[f"{prefix}logps/chosen"]) + abs(record[f"{prefix}logps/rejected"]))
    return abs(record[f"{prefix}rewards/margins"] - theirs) / scale


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, chat_hf, pairs_files):
    """Full fine-tuning, pipe 2 x data 2, checkpoints at steps 3 and 5, eval on pairs; and DPOTrainer."""
    from models.files.hf_convert import hf_to_stages

    root = tmp_path_factory.mktemp("dpo_full")
    ckpt, out = str(root / "ckpt"), str(root / "run")
    hf_to_stages(chat_hf, ckpt)
    args = train_args(
        ckpt,
        pairs_files["plain"],
        out,
        num_stages=2,
        gradient_accumulation_steps=2,
        save_steps=3,
        save_async="true",  # step 3's checkpoint, resumed below, written in the background
        **{"data.eval_file": pairs_files["eval"]},
    )
    proc = run_deepspeed(4, "train.py", args, str(root / "run.log"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    trainer = dpo_trainer(chat_hf, pairs_files["plain"], str(root / "trl"), eval_data=pairs_files["eval"])
    return dict(root=root, ckpt=ckpt, out=out, args=args, log=proc.stdout, trl=trainer)


@pytest.mark.multirank
def test_full_fine_tuning_trains_what_dpo_trainer_trains(full_run, chat_hf, pairs_files):
    run, trl = full_run, full_run["trl"]
    metrics = read_metrics(run["out"])
    loss_diffs = [rel(m["loss"], loss) for m, (loss, _) in zip(metrics, trl.steps)]
    margin_diffs = [margin_err(m, margin) for m, (_, margin) in zip(metrics, trl.steps)]
    print(f"DPO full FT vs DPOTrainer: loss {max(loss_diffs):.2e}, rewards/margins {max(margin_diffs):.2e}")
    assert len(metrics) == len(trl.steps) == STEPS
    assert max(loss_diffs) < REL_TOL and max(margin_diffs) < REL_TOL
    assert all(name in metrics[-1] for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies"))
    assert "reference: forward-only pass of the starting model over 48 pairs" in run["log"]
    assert "| rewards/margins " in run["log"] and "eval_rewards/margins" in run["log"]
    # eval on pairs: DPOTrainer's evaluate on the same 8 pairs with the trained model
    ours = read_metrics(run["out"], "eval")[-1]
    theirs = trl.evaluate()
    assert rel(ours["eval_loss"], theirs["eval_loss"]) < REL_TOL
    assert margin_err(ours, theirs["eval_rewards/margins"], "eval_") < REL_TOL
    # the exported Hugging Face model is TRL's trained model
    export = str(run["root"] / "hf_export")
    assert load_entry_point("convert2ckpt.py").main(["--to-hf", "--input", run["out"], "--output", export]) == 0
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).state_dict()
    reference, start = trl.model.state_dict(), AutoModelForCausalLM.from_pretrained(chat_hf).state_dict()
    # all weights as one vector (tests/test_sft_parity.py's measure: per element, Adam amplifies fp32 noise where
    # a gradient is near eps)
    norm = lambda d: sum(((d[k] - reference[k]) ** 2).sum() for k in reference).sqrt().item()  # noqa: E731
    scale = sum((reference[k] ** 2).sum() for k in reference).sqrt().item()
    weight_diff, moved = norm(exported) / scale, norm(start) / scale
    print(f"DPO full FT: exported weights vs DPOTrainer's: {weight_diff:.2e} (moved {moved:.2e})")
    assert weight_diff < WEIGHT_TOL < moved / 100
    # the wrong aggregation or no reference: far outside the tolerance; the plain loop equals TRL
    batches = pair_batches(os.path.join(os.path.dirname(run["out"]), "cache"), pairs_files["plain"])
    ours_losses = [m["loss"] for m in metrics]
    for aggregate, with_reference, equal in (("sum", True, True), ("mean", True, False), ("sum", False, False)):
        losses = own_dpo_losses(chat_hf, batches, aggregate, with_reference)
        worst = max(rel(a, b) for a, b in zip(ours_losses, losses))
        print(f"DPO per-sequence {aggregate}, reference {with_reference}: {worst:.2e} from the pipeline's losses")
        assert worst < REL_TOL if equal else worst > 100 * REL_TOL


@pytest.mark.multirank
def test_dpo_resumes_on_another_layout_from_the_runs_reference_copy(full_run, pairs_files):
    """Step 3's checkpoint, resumed on pipe 2 x data 1 with grad_acc 4 (the same global batch), the cache's
    reference removed: the run's copy is read (never recomputed from the trained weights), and steps 4-5 are TRL's."""
    run = full_run
    resumed = str(run["root"] / "resumed")
    shutil.copytree(run["out"], resumed, ignore=shutil.ignore_patterns("global_step5"))
    with open(os.path.join(resumed, "latest"), "w") as f:
        f.write("global_step3")
    cache = os.path.join(os.path.dirname(run["out"]), "cache")
    for entry in os.listdir(cache):
        for name in os.listdir(os.path.join(cache, entry)):
            if name.startswith("reference-"):
                os.remove(os.path.join(cache, entry, name))
    args = [a for a in run["args"] if not a.startswith(("output_dir=", "gradient_accumulation_steps="))]
    args += [f"output_dir={resumed}", "gradient_accumulation_steps=4"]
    proc = run_deepspeed(2, "train.py", args, str(run["root"] / "resumed.log"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "reference: log-probabilities of every pair read from the cache" in proc.stdout
    assert "saved on another layout" in proc.stdout
    metrics = read_metrics(resumed)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5] and metrics[-1]["layout"]["data"] == 1
    diffs = [rel(m["loss"], loss) for m, (loss, _) in zip(metrics[3:], run["trl"].steps[3:])]
    print(f"DPO resumed on pipe 2 x data 1: steps 4-5 loss vs DPOTrainer {max(diffs):.2e}")
    assert max(diffs) < REL_TOL


@pytest.mark.multirank
def test_lora_trains_the_adapters_dpo_trainer_trains(tmp_path_factory, chat_hf, pairs_files):
    """Conversational pairs, LoRA from the same initial adapter (B != 0: peft.init_from, a PeftModel for TRL). The
    reference is the starting model in both: TRL copies a pretrained adapter as its "ref" adapter."""
    from peft import get_peft_model_state_dict

    from models.files.hf_convert import hf_to_stages
    from tests.test_lora import overrides, peft_settings, reference_adapter

    root = tmp_path_factory.mktemp("dpo_lora")
    settings = peft_settings()
    hf_to_stages(chat_hf, str(root / "ckpt"))
    model = reference_adapter(chat_hf, settings, str(root / "init"))
    args = train_args(
        str(root / "ckpt"),
        pairs_files["chat"],
        str(root / "run"),
        lr=LORA_LR,
        num_stages=2,
        gradient_accumulation_steps=2,
        **overrides(settings, str(root / "init")),
    )
    proc = run_deepspeed(4, "train.py", args, str(root / "run.log"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    trl = dpo_trainer(chat_hf, pairs_files["chat"], str(root / "trl"), model=model, lr=LORA_LR)
    metrics = read_metrics(str(root / "run"))
    loss_diffs = [rel(m["loss"], loss) for m, (loss, _) in zip(metrics, trl.steps)]
    margin_diffs = [margin_err(m, margin) for m, (_, margin) in zip(metrics, trl.steps)]
    print(f"DPO LoRA vs DPOTrainer: loss {max(loss_diffs):.2e}, rewards/margins {max(margin_diffs):.2e}")
    assert len(metrics) == STEPS and max(loss_diffs) < REL_TOL and max(margin_diffs) < REL_TOL
    export = str(root / "adapter")
    assert load_entry_point("convert2ckpt.py").main(["--to-hf", "--input", str(root / "run"), "--output", export]) == 0
    ours = load_file(os.path.join(export, "adapter_model.safetensors"))
    initial = load_file(str(root / "init" / "adapter_model.safetensors"))
    reference = get_peft_model_state_dict(trl.model)
    assert set(ours) == set(reference)
    diff = max((ours[k] - reference[k]).abs().max().item() for k in ours)
    moved = max((reference[k] - initial[k]).abs().max().item() for k in ours)
    print(f"DPO LoRA: exported adapter vs DPOTrainer's: max abs {diff:.2e} (moved {moved:.2e})")
    assert diff < 1e-5 and moved > 1e-3
