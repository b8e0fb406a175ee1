"""train.py's start-up announcement, printed from rank 0 once the engine is built and resumed: the engine, the
model, the batch and loss, the data and the steps to train, then per rank its stage, weights and data."""

from __future__ import annotations

import torch.distributed as dist

from data.checks import default_packing
from models.families import family_of, moe_spec
from parallel.stage import axis_plans
from training.configuration.schema import Resolved
from training.data_setup import RankData
from training.observation.logs import log0
from training.resilience.all_ranks import on_all_ranks

PADDING_HINT = 0.10  # padding share of unpacked rows above which the start-up line suggests packing


def announce(
    resolved: Resolved,
    engine,
    init_reports: list[dict],
    lora_reports: list[str],
    data_reports: list[dict],
    data: RankData,
    start_step: int,
    total_steps: int,
    steps_per_epoch: float,
) -> None:
    """Print, from rank 0, what was built: engine, per rank its stage, specs, parameters, weights and data."""
    engine_lines(resolved, engine)
    model_lines(resolved)
    batch_line(resolved)
    data_lines(resolved, data, start_step, total_steps, steps_per_epoch)
    rank_lines(init_reports, lora_reports, data_reports)


def engine_lines(resolved: Resolved, engine) -> None:
    """The engine, its ZeRO stage, gradient path, optimizer and precision; the axes' own lines (DualPipeV's
    deferred layers)."""
    cfg = resolved.cfg
    offload = resolved.ds_json.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    stage = engine.zero_optimization_stage()
    # DeepSpeed's ZeRO-1/2 gradient path (training/optim.py sets both off on CPU): say which one runs.
    grads = (
        f", reduce-scatter {engine.zero_reduce_scatter()}, contiguous gradients {engine.zero_contiguous_gradients()}"
        if stage in (1, 2)
        else ""
    )
    log0(
        f"engine: {type(engine).__name__}, ZeRO stage {stage}{grads}, optimizer "
        f"{type(engine.basic_optimizer).__name__} (offload: {offload}), precision {cfg.precision}"
    )
    for plan in axis_plans(resolved.layout):
        for line in plan.announce(engine, on_all_ranks):
            log0(line)


def model_lines(resolved: Resolved) -> None:
    """The model's family, depth, partitioning and activation checkpointing; LoRA's settings."""
    cfg = resolved.cfg
    model, every = resolved.model_config, cfg.activation_checkpoint_interval
    log0(
        f"model: {family_of(model).causal_lm.__name__}'s layers (model_type {model.model_type}), "
        f"{model.num_hidden_layers} decoder layers | partition_method={cfg.partition_method}"
        + (f" | activation checkpointing every {every} decoder layer(s)" if every else "")
    )
    line = moe_line(model, f"{cfg.model_name_or_path}/config.json" if cfg.model_name_or_path else "model.architecture")
    if line:
        log0(line)
    if resolved.lora:
        p = cfg.peft
        log0(
            f"peft: {'QLoRA' if p.quantize == 'nf4' else 'LoRA'} r={p.r} alpha={p.alpha:g}"
            f"{' (rsLoRA)' if p.use_rslora else ''}{' DoRA' if p.use_dora else ''} "
            f"dropout={p.dropout:g} on {', '.join(p.target_modules)}"
            + (f"; trained fully: {', '.join(p.modules_to_save)}" if p.modules_to_save else "")
            + " | base frozen: no gradients, no optimizer state, not saved in checkpoints"
            + ("; its decoder linear layers quantised to NF4 (bitsandbytes)" if p.quantize == "nf4" else "")
        )


# The MoE families whose Hugging Face model adds no router loss to its cross entropy (models/families.py's moe_spec)
NO_ROUTER_LOSS = {
    "llama4_text": "Llama4ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
}


def moe_line(config, source: str) -> str:
    """A Mixture-of-Experts model's routing and whether its loss adds the router's load-balancing loss, with the
    coefficient in use (both from ``source``, the model's config); "" for a dense model."""
    moe = moe_spec(config)
    if moe is None:
        return ""
    routing = (
        f"moe: {moe.num_experts} experts per MoE layer, top {moe.top_k}, {len(moe.moe_layers)} of "
        f"{config.num_hidden_layers} layers routed"
    )
    if config.model_type in NO_ROUTER_LOSS:
        return (
            f"{routing} | no router loss ({NO_ROUTER_LOSS[config.model_type]} adds none, whatever "
            "output_router_logits says)"
        )
    if moe.router_loss:
        return (
            f"{routing} | router loss on (output_router_logits true in {source}): loss = cross entropy + "
            f"router_aux_loss_coef {moe.router_aux_loss_coef:g} x the load-balancing loss"
        )
    return (
        f"{routing} | router loss off (output_router_logits false in {source}): loss = cross entropy; "
        f"router_aux_loss_coef {moe.router_aux_loss_coef:g} unused"
    )


def batch_line(resolved: Resolved) -> None:
    """The world as its axes, the batch and row length, and what the loss is averaged over."""
    cfg, layout = resolved.cfg, resolved.layout
    rows = "at most" if cfg.data.pad_to_multiple_of else "padding included, rows of"
    if cfg.train_objective == "dpo":
        dpo = cfg.dpo
        loss = (
            f"DPO loss ({dpo.loss_type}, beta {dpo.beta:g}"
            + (f", label smoothing {dpo.label_smoothing:g}" if dpo.label_smoothing else "")
            + ") averaged over the global batch's pairs; a sample is a pair, fed as its chosen and rejected rows"
        )
    elif cfg.train_objective == "grpo":
        g = cfg.grpo
        loss = (
            f"GRPO loss ({g.loss_type}, epsilon {g.epsilon:g}"
            + (f"/{g.epsilon_high:g}" if g.epsilon_high is not None else "")
            + f", beta {g.beta:g}) on completions generated on the stages: a sample is a completion, "
            f"{g.num_generations} per prompt, at most {g.max_completion_length} tokens"
        )
    else:
        per = "label token of the global batch" if cfg.loss_normalization == "tokens" else "micro-batch"
        loss = f"loss normalised per {per} (loss_normalization={cfg.loss_normalization})"
    log0(f"world {layout.world_size} = {layout.axes()} | {layout.batch_line()} ({rows} {layout.seq_len}) | {loss}")


def data_lines(resolved: Resolved, data: RankData, start_step: int, total_steps: int, steps_per_epoch: float) -> None:
    """The rows' padding (with a hint where packing or a pad multiple would save much), the samples and the steps
    to train, a mixture's sources."""
    cfg, layout = resolved.cfg, resolved.layout
    if dist.get_rank() == 0 and cfg.train_objective != "grpo":  # the rank that prints; a first stage: it reads data
        padding = 1 - data.train.total_tokens() / (len(data.train) * layout.rows_per_sample * cfg.data.max_seq_length)
        many = not default_packing(cfg.data) and padding >= PADDING_HINT
        if cfg.data.pad_to_multiple_of:
            fed = f"each micro-batch cut to its longest row, up to a multiple of {cfg.data.pad_to_multiple_of}"
            hint = " (data.group_by_length=true pads less)" if many and not cfg.data.group_by_length else ""
        else:
            # only what this run could take: DPO refuses packing, DualPipeV a pad multiple
            cures = [
                c
                for c, ok in (
                    ("data.packing=true", cfg.train_objective != "dpo"),
                    ("data.pad_to_multiple_of=8", layout.schedule != "dualpipev"),
                )
                if ok
            ]
            fed, hint = "every row fed whole", f" (consider {' or '.join(cures)})" * (many and bool(cures))
        log0(f"data: rows of {cfg.data.max_seq_length} tokens, {100 * padding:.1f}% padding; {fed}{hint}")
    if not resolved.resume_tag and total_steps == 0:
        plan = "no step to train (max_steps=0): the weights are loaded and checked only"
    elif start_step >= total_steps:
        plan = (
            f"{resolved.resume_tag} is at step {start_step} >= {total_steps} steps to train: nothing to train "
            "(raise max_steps)"
        )
    else:
        plan = f"steps {start_step + 1}..{total_steps}" + (
            f" (resumed from {resolved.resume_tag})" if start_step else ""
        )
    evals = ", ".join(f"{e.samples}{f' ({e.name})' if e.name else ''}" for e in data.evals) or "0"
    if cfg.train_objective == "grpo":
        log0(f"data: {len(data.train)} prompts, {evals} eval prompts | {plan}")
    else:
        samples = f"{len(data.train)} training samples ({steps_per_epoch:.1f} steps/epoch), {evals} eval samples"
        log0(f"data: {samples} | {plan}")
    if data.sources and dist.get_rank() == 0:  # a first stage: it holds the mixture
        mix = data.train
        log0(
            "data: a mixture of "
            + ", ".join(
                f"{name} (weight {w:g}: {n} of each epoch's {len(mix)} samples, {size} rows)"
                for name, w, n, size in zip(mix.names, mix.weights, mix.counts, mix.sizes)
            )
        )


def rank_lines(init_reports: list[dict], lora_reports: list[str], data_reports: list[dict]) -> None:
    """Per rank: its stage, specs and parameters, where its weights came from, its LoRA, its data role, and its
    peak RSS at each point (training/build.py's reports)."""
    for rank, (info, d) in enumerate(zip(init_reports, data_reports)):
        log0(
            f"rank {rank}: stage {info['stage']} specs {spec_ranges(info['specs'])} "
            f"({len(info['specs'])} specs, {info['params'] / 1e6:.2f} M params) | {info['source']} in "
            f"{info['seconds']:.2f} s "
            f"| peak RSS at load {info['peak_rss_mib']:.0f} MiB (before building the stage "
            f"{info['rss_before_model_mib']:.0f} MiB, stage parameters {info['param_mib']:.0f} MiB)"
        )
        if lora_reports:
            log0(f"rank {rank}: LoRA {lora_reports[rank]}")
        log0(f"rank {rank}: data {d['role']} | peak RSS after data {d['peak_rss_mib']:.0f} MiB")


def spec_ranges(specs: list[int]) -> str:
    """``0..3``, or ``0..1, 6..7`` for the two pieces of a DualPipeV rank (``2`` for a piece of one spec)."""
    runs = [[specs[0], specs[0]]]
    for i in specs[1:]:
        if i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}..{b}" if b > a else str(a) for a, b in runs)
