"""train_objective=grpo: each step's completions generated on the pipeline's own stages, scored, and trained on with
TRL 1.16 GRPOTrainer's loss (models/grpo.py), in one DeepSpeed engine step as SFT's.

A step's batch counts completions, as TRL's does: micro_batch_size x gradient_accumulation_steps x dp of them,
``num_generations`` consecutive ones per prompt, the prompts taken in the data's order, or with data.shuffle (TRL's
shuffle_dataset) in a seeded permutation per pass (TRL's RepeatSampler: whole generations of prompts per pass over
the data, the remainder left out). Data-parallel rank r holds the rows [r n, (r + 1) n) of the step's completions
(n = micro_batch_size x gradient_accumulation_steps), its micro-batch j the rows [j micro, (j + 1) micro) of those.
With num_iterations k a generation serves k steps (steps 1, k + 1, 2k + 1, ... generate); the steps between reuse
it, its old log-probabilities taken once.

A generation step, on every rank in this order:

    prompts    the first stage of each pipeline (which reads the data) broadcasts its rows' prompt ids to its stages
    generate   parallel/pipeline_generation.py on the stages, sampling seeded from (seed, step, dp rank): a resumed
               run generates what the uninterrupted run generated
    score      the last stage's first tensor-parallel rank calls the reward functions on its rows (TRL's arguments)
    gather     every rank gets every row's rewards, lengths and truncation (one all_gather_object); advantages of the
               whole batch, as TRL gathers them, then each rank keeps its rows'
    old, ref   with num_iterations > 1 a forward-only pass records the policy's log-probabilities (TRL's old), with
               beta > 0 one with the starting weights swapped in (the reference; no second model is built)

then the engine step: the first stage feeds prompt + completion ids, the last stage's GRPOLoss reads (labels,
advantages, old, reference). Rank 0 writes every completion to ``output_dir/completions.jsonl``.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from data.order_guard import OrderGuard
from data.prompts import Prompt, count_lengths, length_report, prompt_budget, read_prompts, within_budget
from data.records import DataError, SourceStats
from data.rewards import RewardError, RewardSet, load_reward_functions
from data.sampling import PlaceholderDataset
from data.tokenize_settings import tokenizer_dir
from models.generation import Completion
from models.grpo import GRPO_METRICS, GRPOLoss, dapo_normalizer, group_advantages
from models.loss import IGNORE_INDEX
from parallel.pipeline_generation import generate_on_stages
from training.configuration.schema import Resolved
from training.data_setup import EvalSet, RankData, split_eval
from training.observation.logs import log0
from training.resilience.all_ranks import StartupError, TrainingStopped, counted_sum, on_all_ranks, writing
from training.step import router_metrics

COMPLETIONS_FILE = "completions.jsonl"
SHOWN = ("reward", "reward_std", "completions/mean_length")  # on the progress line; every metric in metrics.jsonl


@dataclass
class Rows:
    """This rank's rows of one generation, what the engine step feeds: [n,S] each (S the padded length)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor  # IGNORE_INDEX off the completion tokens that train
    advantages: torch.Tensor  # [n] fp32
    old: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [n,S] fp32 with num_iterations > 1
    reference: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [n,S] fp32 with beta > 0

    def micro_batches(self, micro: int, recording: bool = False):
        """((input_ids, position_ids), (labels, advantages, old, reference)) per micro-batch, in row order."""
        empty = torch.zeros(0)
        for start in range(0, self.labels.shape[0], micro):
            rows = slice(start, start + micro)
            old = empty if recording or not self.old.numel() else self.old[rows]
            ref = empty if recording or not self.reference.numel() else self.reference[rows]
            yield (self.input_ids[rows], self.position_ids[rows]), (self.labels[rows], self.advantages[rows], old, ref)


@dataclass
class Generation:
    """One generation batch on this rank: its rows (reading ranks), the global counts, and the metrics it logs."""

    index: int
    rows: Rows | None
    active_tokens: int  # completion tokens that train, all ranks: dapo's normaliser
    counts: list[int]  # real tokens (prompt + completion), completion tokens, tokens computed: all ranks
    metrics: dict[str, float]
    size: int  # completions, all ranks


class GRPOData:
    """This rank's GRPO data: the prompts (the first and last stage read them; None in the middle), the tokenizer
    and reward functions (the last stage scores), the generation being trained on, and the position for checkpoints.
    The loop keeps it as ``RankData.iterator`` (its ``state_dict`` is saved with every checkpoint)."""

    def __init__(self, prompts: list[Prompt] | None, num_prompts: int, tokenizer, rewards: RewardSet, place: tuple):
        self.prompts, self.num_prompts, self.tokenizer, self.rewards = prompts, num_prompts, tokenizer, rewards
        self.place = list(place)  # (world size, rank): a buffered generation is this rank's rows
        self.generation: Generation | None = None
        self.restored: dict | None = None
        self.reference: ReferenceWeights | None = None  # grpo.beta > 0 (keep_reference)
        self.evals: list[Prompt] | None = None  # the eval prompts (reading ranks)
        self.num_evals = 0

    def state_dict(self) -> dict:
        """The buffered generation (its rows, old and reference log-probabilities): a run resumed between two steps
        that share a generation trains on it again, as the uninterrupted run does."""
        g = self.generation
        if g is None:
            return {"generation": None, "consumed": 0}
        consumed = (g.index + 1) * g.size  # completions generated so far (every rank's)
        state = {"generation": g.index, "consumed": consumed, "place": self.place, "active_tokens": g.active_tokens}
        state |= {"counts": g.counts, "metrics": g.metrics, "size": g.size}
        if g.rows is not None:
            state["rows"] = {k: (v.tolist(), str(v.dtype)) for k, v in vars(g.rows).items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.restored = state if state and state.get("generation") is not None else None

    def take_restored(self, index: int) -> Generation | None:
        state, self.restored = self.restored, None
        if state is None or state["generation"] != index or state["place"] != self.place:
            return None  # another generation, or saved by another rank of another layout: generated anew
        rows = None
        if "rows" in state:
            rows = Rows(**{k: _tensor(v, dtype) for k, (v, dtype) in state["rows"].items()})
        return Generation(index, rows, state["active_tokens"], state["counts"], state["metrics"], state["size"])

    def generation_prompts(self, index: int, count: int, shuffle_seed: int | None) -> list[Prompt]:
        """The ``count`` prompts of generation ``index``: whole generations per pass over the data (the rest left out,
        as TRL's RepeatSampler does), in the data's order or, with ``shuffle_seed``, in a permutation per pass."""
        per_pass = self.num_prompts // count
        order = np.arange(self.num_prompts)
        if shuffle_seed is not None:
            order = np.random.default_rng([shuffle_seed, index // per_pass]).permutation(self.num_prompts)
        start = (index % per_pass) * count
        return [self.prompts[i] for i in order[start : start + count]]


def _tensor(values: list, dtype: str) -> torch.Tensor:
    return torch.tensor(values, dtype=getattr(torch, dtype.removeprefix("torch.")))


def prepare_grpo_data(resolved: Resolved, coord, layout) -> tuple[GRPOData, list[str]]:
    """Collective. The prompts of data.train_file on the reading stages (those over the budget left out, said once),
    the reward functions loaded and called once on the first prompts (problems raised on every rank, before start).
    Returns this rank's data and the lines to announce."""
    cfg, g = resolved.cfg, resolved.cfg.grpo
    reads = coord.pipe in layout.reading_stages
    budget = prompt_budget(cfg.data.max_seq_length, g.max_completion_length)
    fields = {"prompt": cfg.data.prompt_field}

    def source(spec: str, tokenizer) -> tuple[list[Prompt], str, str]:
        """(the prompts within the budget, error, warning) of one file."""
        stats = SourceStats()
        prompts = list(read_prompts(spec, tokenizer, cfg.data.skip_bad_lines, stats, fields))
        lengths = count_lengths(prompts, budget)
        error, warning = length_report(spec, lengths)
        if stats.skipped_bad_lines:  # data.skip_bad_lines=true
            warning += f"{'; ' if warning else ''}{stats.skipped_bad_lines} bad records of {spec} skipped"
        return list(within_budget(prompts, type(lengths)(budget))), error, warning

    def read() -> dict:
        if not reads:
            return {"prompts": None}
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(cfg))
        try:
            train, error, warning = source(cfg.data.train_file, tokenizer)
            evals, eval_error, eval_warning = (
                source(cfg.data.eval_file, tokenizer) if cfg.data.eval_file else ([], "", "")
            )
        except DataError as e:
            return {"prompts": 0, "error": str(e), "warning": "", "evals": 0}
        if cfg.data.eval_fraction > 0:  # a split of data.train_file, as for SFT
            kept, held = split_eval(len(train), cfg.data.eval_fraction)
            train, evals = [train[i] for i in kept], [train[i] for i in held]
        local.update(prompts=train, evals=evals, tokenizer=tokenizer)
        error = "\n".join(e for e in (error, eval_error) if e)
        warning = "; ".join(w for w in (warning, eval_warning) if w)
        return {"prompts": len(train), "error": error, "warning": warning, "evals": len(evals)}

    local: dict = {}
    reports = on_all_ranks("reading the prompts", read)
    first = next(r for r in reports if r["prompts"] is not None)
    if first["error"]:
        raise StartupError(first["error"])
    per_generation = layout.global_batch // g.num_generations
    if first["prompts"] < per_generation:
        raise StartupError(
            f"{cfg.data.train_file} has {first['prompts']} prompts within the budget, and a step's generation takes "
            f"{per_generation} (micro_batch_size x gradient_accumulation_steps x dp {layout.global_batch} completions "
            f"/ grpo.num_generations {g.num_generations}): give more prompts or a smaller batch"
        )
    scorer = reads and coord.pipe == layout.stages - 1
    rewards = load_reward_functions(list(g.reward_funcs), None if g.reward_weights is None else list(g.reward_weights))

    def dry_run() -> list[str]:
        if not scorer or not local.get("prompts"):
            return []
        rows = [{"prompt": p.prompt, **p.columns} for p in local["prompts"][: max(1, g.num_generations)]]
        problems, warnings = rewards.dry_run(rows)
        return [f"error: {p}" for p in problems] + [f"warning: {w}" for w in warnings]

    said = [line for lines in on_all_ranks("calling the reward functions once", dry_run) for line in lines]
    said = list(dict.fromkeys(said))
    problems = [line[len("error: ") :] for line in said if line.startswith("error: ")]
    if problems:
        raise StartupError(
            "the reward functions fail on the first prompts (an empty completion each):\n  " + "\n  ".join(problems)
        )
    lines = [f"grpo: {first['prompts']} prompts of {cfg.data.train_file}, {per_generation} per generation"]
    lines += [w for w in [first["warning"]] if w] + [
        line[len("warning: ") :] for line in said if line[:8] == "warning:"
    ]
    place = (dist.get_world_size(), dist.get_rank())
    data = GRPOData(local.get("prompts"), first["prompts"], local.get("tokenizer"), rewards, place)
    data.evals, data.num_evals = local.get("evals"), first["evals"]
    return data, lines


def grpo_rank_data(resolved: Resolved, coord) -> RankData:
    """Collective. This rank's view of the data for train_objective=grpo (training/data_setup.py's RankData): the
    GRPOData as its iterator (on every rank: each keeps the generation it trains on), no order check (every rank of
    a pipeline gets its prompts from the first stage); the eval prompts (data.eval_file or data.eval_fraction) as
    the one eval set."""
    layout = resolved.layout
    data, lines = prepare_grpo_data(resolved, coord, layout)
    for line in lines:
        log0(line)
    reads = coord.pipe in layout.reading_stages
    return RankData(
        train=PlaceholderDataset(data.num_prompts),
        evals=[EvalSet("", data.evals, data.num_evals, 0)] if data.num_evals else [],
        iterator=data,
        guard=OrderGuard(None, 0, layout.stages, coord.data, coord.pipe),
        role="reads prompts" if reads else "prompt ids from the first stage",
        micro_batch_size=resolved.cfg.micro_batch_size,
        dp_rank=coord.data,
        dp_size=layout.dp,
        pad_multiple=resolved.cfg.data.pad_to_multiple_of,
        sources=[],
    )


def keep_reference(resolved: Resolved, engine, data: RankData) -> None:
    """grpo.beta > 0: this stage's starting weights kept as the reference, before a resume replaces them
    (training/build.py's init_weights loads them on a resume too); under LoRA the base, its adapters off."""
    if resolved.cfg.train_objective != "grpo" or resolved.cfg.grpo.beta == 0:
        return
    if resolved.lora:
        data.iterator.reference = AdaptersOff(engine.module)
        return
    if resolved.reshard:
        raise StartupError(
            f"resuming {resolved.resume_tag} on another layout ({resolved.reshard}) with grpo.beta "
            f"{resolved.cfg.grpo.beta:g}: the reference weights are read on the checkpoint's layout only; resume on it"
        )
    data.iterator.reference = ReferenceWeights(engine.module)


class ReferenceWeights:
    """With grpo.beta > 0: this stage's starting weights, kept beside the trained ones (the planner counts them) and
    swapped in for the reference pass (each parameter's storage exchanged: nothing copied)."""

    def __init__(self, module: torch.nn.Module):
        self.params = [p for p in module.parameters()]
        self.saved = [p.detach().clone() for p in self.params]

    def swap(self) -> None:
        for p, saved in zip(self.params, self.saved, strict=True):
            p.data, saved.data = saved.data, p.data


class AdaptersOff:
    """With grpo.beta > 0 under LoRA: the reference is the frozen base, the adapters switched off for its pass
    (PEFT's ``enable_adapters``), as TRL's reference is the model with its adapters disabled; nothing is kept."""

    def __init__(self, module: torch.nn.Module):
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
        self.on = True

    def swap(self) -> None:
        self.on = not self.on
        for layer in self.layers:
            layer.enable_adapters(self.on)


def generation_seed(seed: int, step: int, dp_rank: int, stream: int = 0) -> int:
    """The sampling seed of a generation: a function of (seed, step, data-parallel rank, stream) alone."""
    return int(np.random.SeedSequence([seed, step, dp_rank, stream]).generate_state(1)[0])


class GRPOStep:
    """The step of train_objective=grpo (module docstring); ``reference`` with beta > 0."""

    def __init__(self, resolved: Resolved, engine, data: GRPOData, loss_fn: GRPOLoss, start_step: int):
        self.resolved, self.engine, self.data, self.loss_fn = resolved, engine, data, loss_fn
        self.reference = data.reference
        self.cfg, self.g = resolved.cfg, resolved.cfg.grpo
        self.grid = engine.grid
        self.stage, self.stages = engine.stage_id, engine.num_stages
        self.dp_rank = resolved.layout.data_coord(engine.grid._topo.get_coord(dist.get_rank())).data
        self.rows_per_rank = self.cfg.micro_batch_size * self.cfg.gradient_accumulation_steps
        # the last stage's first tensor-parallel rank of each pipeline scores its rows
        last = self.stage == self.stages - 1
        self.scorer = data.prompts is not None and last and self.grid.get_slice_parallel_rank() == 0
        self.eos, self.pad = self._special_ids()
        self.completions_path = os.path.join(self.cfg.output_dir, COMPLETIONS_FILE)
        if dist.get_rank() == 0:
            keep_completions_until(self.completions_path, start_step)

    def _special_ids(self) -> tuple[list[int], int]:
        config = self.resolved.model_config
        eos = config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if not eos:
            raise StartupError("the model config has no eos_token_id: generation could not stop; set it in config.json")
        pad = config.pad_token_id if config.pad_token_id is not None else eos[0]
        return eos, pad

    def train_step(self, step: int) -> tuple[float, list[int]]:
        """One optimizer step at ``step`` (1-based): generate when the step opens a generation, then train."""
        index = (step - 1) // self.g.num_iterations
        if self.data.generation is None or self.data.generation.index != index:
            self.data.generation = self.data.take_restored(index) or self.generate(index, step)
        gen = self.data.generation
        gas = self.cfg.gradient_accumulation_steps
        normalizer = dapo_normalizer(gen.active_tokens, self.resolved.layout.dp)
        self.loss_fn.set_step_normalizer(normalizer, gas)
        batches = gen.rows.micro_batches(self.cfg.micro_batch_size) if gen.rows is not None else None
        loss = self.resolved.layout.engine.train_batch(self.engine, batches, self.loss_fn)
        return loss, list(gen.counts)

    def metrics(self) -> tuple[dict[str, float], dict[str, float]]:
        """(shown, written): the step's TRL metrics; the loss's are a collective on every rank."""
        stats = self.loss_fn.take_stats()
        counts = self.resolved.layout.engine.counts_labels(self.engine)
        metrics = dict(self.data.generation.metrics) | loss_metrics(stats, counts, self.cfg.gradient_accumulation_steps)
        if self.g.beta == 0:
            metrics.pop("kl")  # TRL logs kl only with a reference
        if self.loss_fn.router is not None:  # a MoE model's routing (training/step.py)
            metrics |= router_metrics(self.loss_fn, counts)
        shown = {k: metrics[k] for k in SHOWN if k in metrics}
        return shown, {k: v for k, v in metrics.items() if k not in shown}

    # -- a generation -----------------------------------------------------------------------------------------------

    def generate(self, index: int, step: int) -> Generation:
        prompts = self._rank_prompts(index)
        prompt_ids, completions, scored = self._rollout(prompts, self._generator(step, 0), step - 1, f"step {step}")
        rewards = torch.tensor([r for p in scored for r in p["rewards"]], dtype=torch.float32)  # [N,F]
        lengths = torch.tensor([n for p in scored for n in p["lengths"]], dtype=torch.float32)  # [N]
        truncated = torch.tensor([t for p in scored for t in p["truncated"]], dtype=torch.bool)  # [N]
        total = self.data.rewards.total(rewards)  # [N]
        advantages, _, frac_zero = group_advantages(total, self.g.num_generations, str(self.g.scale_rewards))
        trains = ~truncated if self.g.mask_truncated_completions else torch.ones_like(truncated)
        active = int(lengths[trains].sum())
        mine = slice(self.dp_rank * self.rows_per_rank, (self.dp_rank + 1) * self.rows_per_rank)
        rows = None
        if prompts is not None:
            rows = self._rows(prompt_ids, completions, advantages[mine], self.g.mask_truncated_completions)
        computed = sum(p["width"] * len(p["lengths"]) for p in scored)
        counts = [int(sum(p["prompt_tokens"] for p in scored) + lengths.sum()), active, computed]
        metrics = self.data.rewards.metrics(rewards) | completion_metrics(lengths, truncated)
        metrics["frac_reward_zero_std"] = float(frac_zero)
        metrics["generation_s"] = max(p["generation_s"] for p in scored)  # on the stages, the slowest pipeline
        for name in dict.fromkeys(k for p in scored for k in p["logged"]):
            values = [v for p in scored for v in p["logged"].get(name, [])]
            metrics[name] = sum(values) / len(values)
        if rows is not None and (self.g.num_iterations > 1 or self.reference is not None):
            self._record(rows)
        self._write_completions(step, scored, rewards, total, advantages)
        return Generation(index, rows, active, counts, metrics, len(lengths))

    def _rollout(self, prompts: list[Prompt] | None, generator, done: int, when: str) -> tuple[list, list, list[dict]]:
        """This rank's rows generated on the stages and scored (the reward functions see ``done`` optimizer steps as
        TRL's ``trainer_state.global_step``); every scorer's rows (its payload of ``_score``, in data-parallel order)
        on every rank. A reward function's failure stops training on every rank."""
        prompt_ids = self._broadcast_prompt_ids([p.ids for p in prompts] if prompts is not None else None)
        start = time.time()
        completions = self._generate(prompt_ids, generator)
        generation_s = time.time() - start
        local = (
            self._score(prompts, prompt_ids, completions, done) | {"generation_s": generation_s}
            if self.scorer
            else None
        )
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
        scored = sorted((p for p in parts if p is not None), key=lambda p: p["dp_rank"])
        errors = [p["error"] for p in scored if p["error"]]
        if errors:
            raise TrainingStopped(f"{when}: " + "\n".join(errors) + self._last_checkpoint())
        return prompt_ids, completions, scored

    def _last_checkpoint(self) -> str:
        from training.checkpoints.save_restore import LATEST_FILE

        latest = os.path.join(self.cfg.output_dir, LATEST_FILE)
        if not os.path.isfile(latest):
            return f"\nno checkpoint in {self.cfg.output_dir} yet"
        with open(latest) as f:
            return f"\nthe last checkpoint, {os.path.join(self.cfg.output_dir, f.read().strip())}, is intact"

    def _generator(self, step: int, stream: int) -> torch.Generator:
        """The last stage's sampling generator of ``step`` (stream 0 trains, 1 evaluates), seeded alike on the
        tensor-parallel peers."""
        device = next(self.engine.module.parameters()).device
        seed = generation_seed(self.cfg.seed, step, self.dp_rank, stream)
        return torch.Generator(device=device).manual_seed(seed)

    def evaluate(self, step: int, evaluation: EvalSet, logger) -> None:
        """The eval prompts' completions (num_generations each, every data-parallel rank a share, sampled as in
        training) scored: the mean reward and each function's, logged as eval_reward, eval_rewards/<f>/mean."""
        start, g = time.time(), self.g.num_generations
        total = evaluation.samples * g
        per_rank = -(-total // self.resolved.layout.dp)
        mine = [(self.dp_rank * per_rank + i) for i in range(per_rank)]  # past total: wrapped round, not counted
        rewards, valid = [], []
        generator = self._generator(step, 1)
        for start_row in range(0, per_rank, self.rows_per_rank):
            rows = mine[start_row : start_row + self.rows_per_rank]
            prompts = None if evaluation.dataset is None else [evaluation.dataset[(r % total) // g] for r in rows]
            _, _, scored = self._rollout(prompts, generator, step, f"eval at step {step}")
            rewards += [r for p in scored for r in p["rewards"]]
            valid += [p["dp_rank"] * per_rank + start_row + i < total for p in scored for i in range(len(p["lengths"]))]
        kept = torch.tensor(rewards, dtype=torch.float32)[torch.tensor(valid)]  # [E*g, F]
        metrics = {"eval_reward": torch.nanmean(self.data.rewards.total(kept)).item()}
        for i, name in enumerate(self._names()):
            metrics[f"eval_rewards/{name}/mean"] = torch.nanmean(kept[:, i]).item()
        logger.log_eval(step, None, time.time() - start, evaluation.name, metrics)

    def _rank_prompts(self, index: int) -> list[Prompt] | None:
        if self.data.prompts is None:
            return None
        g = self.g.num_generations
        per_generation = self.resolved.layout.global_batch // g
        shuffle = self.cfg.seed if self.cfg.data.shuffle else None  # data.shuffle: TRL's shuffle_dataset
        prompts = self.data.generation_prompts(index, per_generation, shuffle)
        first = self.dp_rank * self.rows_per_rank
        return [prompts[row // g] for row in range(first, first + self.rows_per_rank)]

    def _broadcast_prompt_ids(self, ids: list[list[int]] | None) -> list[list[int]]:
        """The first stage's prompt ids on every stage of its pipeline (a middle stage reads no data)."""
        box = [ids]
        dist.broadcast_object_list(box, src=self.grid.stage_to_global(0), group=self.grid.get_pipe_parallel_group())
        return box[0]

    def _generate(self, prompt_ids: list[list[int]], generator: torch.Generator) -> list[Completion]:
        was_training = self.engine.module.training
        self.engine.module.eval()
        try:
            return generate_on_stages(
                self.engine.module,
                prompt_ids,
                self.g.max_completion_length,
                self.eos,
                do_sample=True,
                temperature=self.g.temperature,
                top_p=self.g.top_p,
                top_k=self.g.top_k,
                generator=generator,
                pad_token_id=self.pad,
                micro_batches=self.g.generation_micro_batches or None,
            )
        finally:
            self.engine.module.train(was_training)

    def _score(self, prompts: list[Prompt], prompt_ids, completions: list[Completion], done: int) -> dict:
        """This rank's rows scored (TRL's reward arguments), with what the gather and completions.jsonl need."""
        texts = self.data.tokenizer.batch_decode([c.ids for c in completions], skip_special_tokens=True)
        conversational = prompts[0].conversational
        shown = [[{"role": "assistant", "content": t}] if conversational else t for t in texts]
        columns = {name: [p.columns.get(name) for p in prompts] for name in prompts[0].columns}
        error, rewards = None, None
        try:
            from transformers import TrainerState  # transformers.trainer: seconds to import, on the scorers only

            state = TrainerState(global_step=done, max_steps=self.cfg.max_steps)
            ids = [c.ids for c in completions]
            rewards = self.data.rewards.score([p.prompt for p in prompts], shown, ids, columns, state)
        except RewardError as e:
            where = list(dict.fromkeys(p.where for p in prompts))
            error = f"data-parallel rank {self.dp_rank}: {e} (prompts: {', '.join(where[:4])})"
        n = len(completions)
        logged = {name: list(values) for name, values in self.data.rewards.logged_metrics.items()}
        self.data.rewards.logged_metrics.clear()  # a reward function's log_metric values: logged with the step
        return {
            "logged": logged,
            "dp_rank": self.dp_rank,
            "error": error,
            "rewards": rewards.tolist() if rewards is not None else [[math.nan]] * n,
            "lengths": [len(c.ids) for c in completions],
            "truncated": [c.truncated for c in completions],
            "prompt_tokens": sum(len(ids) for ids in prompt_ids),
            "width": self._width(prompt_ids, completions),
            "records": [
                {"prompt": p.prompt, "completion": t, "prompt_ids": ids, "completion_ids": c.ids}
                for p, t, ids, c in zip(prompts, texts, prompt_ids, completions, strict=True)
            ],
        }

    def _names(self) -> list[str]:
        return self.data.rewards.names

    def _rows(self, prompt_ids, completions: list[Completion], advantages: torch.Tensor, mask_truncated: bool) -> Rows:
        """Prompt + completion per row, right-padded to max_seq_length (or the longest row rounded up to
        data.pad_to_multiple_of); labels on the completion tokens (none on a truncated one with
        mask_truncated_completions)."""
        width = self._width(prompt_ids, completions)
        n = len(completions)
        input_ids = torch.full((n, width), self.pad, dtype=torch.int64)  # [n,S]
        labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.int64)  # [n,S]
        for i, (p, c) in enumerate(zip(prompt_ids, completions, strict=True)):
            row = p + c.ids
            input_ids[i, : len(row)] = torch.tensor(row)
            if not (mask_truncated and c.truncated):
                labels[i, len(p) : len(row)] = torch.tensor(c.ids)
        position_ids = torch.arange(width, dtype=torch.int64).expand(n, width).contiguous()  # [n,S]
        return Rows(input_ids, position_ids, labels, advantages.clone())

    def _width(self, prompt_ids, completions: list[Completion]) -> int:
        """The rows' padded length: max_seq_length, or the longest row rounded up to data.pad_to_multiple_of."""
        longest = max(len(p) + len(c.ids) for p, c in zip(prompt_ids, completions, strict=True))
        width, multiple = self.cfg.data.max_seq_length, self.cfg.data.pad_to_multiple_of
        return min(width, -(-longest // multiple) * multiple) if multiple else width

    def _record(self, rows: Rows) -> None:
        """The old (num_iterations > 1) and reference (beta > 0) log-probabilities of this rank's rows, by
        forward-only passes through the pipeline; on the last stage they join the rows."""
        if self.g.num_iterations > 1:
            rows.old = self._recording_pass(rows)
        if self.reference is not None:
            self.reference.swap()
            try:
                rows.reference = self._recording_pass(rows)
            finally:
                self.reference.swap()

    def _recording_pass(self, rows: Rows) -> torch.Tensor:
        self.loss_fn.recording = []
        try:
            micro = rows.micro_batches(self.cfg.micro_batch_size, recording=True)
            self.resolved.layout.engine.eval_batch(
                self.engine, micro, self.cfg.gradient_accumulation_steps, self.loss_fn
            )
        finally:
            recorded, self.loss_fn.recording = self.loss_fn.recording, None
        return torch.cat(recorded) if recorded else torch.zeros(0)

    def _write_completions(self, step, scored, rewards, total, advantages) -> None:
        if dist.get_rank() != 0:
            return
        names = self._names()
        records = [r for p in scored for r in p["records"]]
        with writing(self.completions_path), open(self.completions_path, "a") as f:
            for i, record in enumerate(records):
                values = {n: (None if math.isnan(v) else v) for n, v in zip(names, rewards[i].tolist(), strict=True)}
                reward = total[i].item()
                line = {"step": step, **record, "rewards": values}
                line |= {"reward": None if math.isnan(reward) else reward, "advantage": advantages[i].item()}
                f.write(json.dumps(line) + "\n")


def keep_completions_until(path: str, step: int) -> None:
    """A resumed run's completions.jsonl keeps the lines of the steps up to the checkpoint's (a stopped run may
    have written later ones: they are generated again); a new run starts it empty."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        kept = [line for line in f if step and json.loads(line)["step"] <= step]
    with writing(path), open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


def completion_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """TRL's completion metrics of a batch's completion lengths [N] and whether each was cut [N] (its reward metrics
    are data/rewards.py's ``RewardSet.metrics``)."""
    metrics: dict[str, float] = {}
    metrics["completions/mean_length"] = lengths.mean().item()
    metrics["completions/min_length"] = lengths.min().item()
    metrics["completions/max_length"] = lengths.max().item()
    metrics["completions/clipped_ratio"] = truncated.float().mean().item()
    ended = lengths[~truncated]
    metrics["completions/mean_terminated_length"] = ended.mean().item() if ended.numel() else 0.0
    return metrics


def loss_metrics(stats: torch.Tensor, counts: bool, micro_batches: int) -> dict[str, float]:
    """TRL's loss metrics of the step's micro-batches (GRPOLoss stats rows, every counting rank's summed, each
    micro-batch index's figure over all ranks, then averaged over the micro-batches). A collective."""
    if not counts or stats.shape[0] != micro_batches:
        stats = torch.zeros(micro_batches, len(GRPO_METRICS), dtype=torch.float64)
    summed = counted_sum(torch.nan_to_num(stats[:, :-2]).reshape(-1), counts).view(micro_batches, -1)
    low = _extreme(stats[:, -2], counts, dist.ReduceOp.MIN)
    high = _extreme(stats[:, -1], counts, dist.ReduceOp.MAX)
    tokens = summed[:, 0].clamp(min=1.0)
    out = {name: (summed[:, 1 + i] / tokens).mean().item() for i, name in enumerate(GRPO_METRICS[1:-2])}
    out["clip_ratio/low_min"], out["clip_ratio/high_max"] = low.nanmean().item(), high.nanmean().item()
    return out


def _extreme(values: torch.Tensor, counts: bool, op) -> torch.Tensor:
    """Each micro-batch's min (or max) over the counting ranks, NaN where none had a completion token (TRL's nanmin)."""
    from deepspeed.accelerator import get_accelerator

    fill = math.inf if op == dist.ReduceOp.MIN else -math.inf
    values = torch.where(torch.isnan(values) | (not counts), torch.full_like(values, fill), values)
    values = values.to(get_accelerator().current_device_name())
    dist.all_reduce(values, op=op)
    values = values.cpu()
    return torch.where(torch.isinf(values), torch.full_like(values, math.nan), values)
