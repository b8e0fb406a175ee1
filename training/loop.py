"""The training loop: how many steps, each step (training/step.py) logged and checked, the saves and evals it
calls for, and the run's final figures (its last lines, and metrics.jsonl's last record)."""

from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from omegaconf import OmegaConf

from models.host_memory import peak_rss_mb
from models.llama_pipe import flops_per_token
from models.loss import CausalLMLoss
from parallel.stage import axis_plans
from training.checkpoints import save_restore
from training.checkpoints.async_save import BackgroundWriter
from training.compile import CompileLog
from training.configuration.schema import Resolved
from training.configuration.step_range import planned_steps, resumed_step, step_setting_problems
from training.data_setup import RankData
from training.grpo import GRPOStep
from training.moe_balance import BiasBalancer, load_imbalance
from training.observation.logs import log0
from training.observation.memory_census import CensusAtStep, StepPeak
from training.observation.metrics import StepLogger, device_peak_tflops, peak_basis, write_final_record
from training.observation.profiling import StepProfiler
from training.observation.straggler import ComputeClock
from training.resilience.all_ranks import StartupError, TrainingStopped, on_all_ranks
from training.resilience.hang import HangWatch
from training.resilience.preemption import PREEMPTED_EXIT_CODE, STOP_SIGNALS, Preempted, StopAndSave
from training.step import eval_label_count, evaluate, objective_metrics, train_step


def plan_steps(resolved: Resolved, data: RankData) -> tuple[int, float]:
    """(optimizer steps to train, steps per epoch): max_steps, or num_epochs passes, whichever is first. Where
    num_epochs decides, the settings that name steps are checked here, against the steps the data gives (with
    max_steps alone, training.configuration.validate.resolve checked them): every rank alike, a problem raised on all of
    them."""
    cfg = resolved.cfg
    steps, steps_per_epoch = planned_steps(cfg, resolved.dp, len(data.train), resumed_step(resolved.resume_tag))
    if cfg.num_epochs:
        problems, warnings = step_setting_problems(cfg, steps)
        if problems:
            raise StartupError("invalid configuration:\n  " + "\n  ".join(problems))
        for warning in warnings:
            log0(f"warning: {warning}")
    return steps.last, steps_per_epoch


def train(resolved: Resolved, engine, data: RankData, loss_fn: CausalLMLoss, start_step: int, total_steps: int) -> None:
    """Steps ``start_step + 1 .. total_steps``: train, check the data order, log, evaluate, save."""
    cfg = resolved.cfg
    fp8 = getattr(cfg, "fp8", None)  # an fp8 run's MFU divides by the bf16 dense peak, and its line says so
    peak = device_peak_tflops(cfg.precision, cfg.mfu_peak_tflops, fp8)
    six_n, attention = flops_per_token(resolved.model_config, resolved.layout.seq_len)
    l = resolved.layout
    axes = {"pipe": l.stages, "tensor": l.tp, "sequence": l.sp, "data": l.dp, "experts": l.ep}  # each record's "layout"
    logger = StepLogger(
        cfg.output_dir,
        total_steps,
        cfg.log_steps,
        dist.get_rank() == 0,
        start_step,
        flops_per_token=six_n + attention,
        peak_flops=peak * 1e12 * resolved.world_size if peak else None,
        layout=axes,
        sources=data.sources,
        sinks=[tracking_run(resolved, axes)] if cfg.monitor.wandb and dist.get_rank() == 0 else None,
        peak_basis=peak_basis(fp8, cfg.mfu_peak_tflops),
    )
    # train_objective=grpo: generation, rewards and the update (training/grpo.py)
    grpo = GRPOStep(resolved, engine, data.iterator, loss_fn, start_step) if cfg.train_objective == "grpo" else None
    eval_labels = [0 if grpo else eval_label_count(resolved, engine, data, e) for e in data.evals]
    last_saved = start_step if resolved.resume_tag else None
    stopper = StopAndSave(
        cfg.save_every_minutes,
        cfg.preempt_grace_s,
        dist.get_rank(),
        get_accelerator().current_device_name(),
        cfg.output_dir,
    )
    # the straggler view (training/observation/straggler.py): the compute instructions of the schedule timed
    clock = ComputeClock() if resolved.layout.engine.runs_instructions else None
    watch = HangWatch(cfg.output_dir, dist.get_rank(), dist.get_world_size(), cfg.hang_timeout_s, cfg.hang_action)
    census = CensusAtStep(engine)  # model-state bytes per rank, measured before the second optimizer step
    step_peak = StepPeak(start_step + 2, cfg.count_step_memory)  # what the second step allocates beyond the states
    profiler = StepProfiler(cfg.profile_steps, cfg.output_dir, dist.get_rank())
    compiled = CompileLog(cfg.compile, start_step + 1, log0)  # compile=true: compile time once, recompiles counted
    writer = BackgroundWriter()  # save_async: the checkpoint being written while training goes on
    skipped: list[int] = []  # steps whose update the optimizer skipped (non-finite), with nonfinite_loss=skip
    # moe.bias_update_speed > 0: DeepSeek-V3's router biases moved after each step (training/moe_balance.py)
    balancer = BiasBalancer.of(engine.module, resolved.model_config, cfg.moe.bias_update_speed)
    if balancer:
        log0(f"moe.bias_update_speed {cfg.moe.bias_update_speed:g}: the router biases move towards balance each step")
    if cfg.moe.sequence_balance_coef:  # added by the last stage's loss (models/family_deepseek_v3.py)
        coef = cfg.moe.sequence_balance_coef
        log0(
            f"moe.sequence_balance_coef {coef:g}: loss = cross entropy + {coef:g} x DeepSeek-V3's sequence-wise "
            "balance loss (per packed document, summed over the MoE layers), logged as sequence_balance_loss"
        )
    data.guard.resumed_after(start_step)
    try:
        for step in range(start_step + 1, total_steps + 1):
            lr = engine.get_lr()[0]  # the rate this step uses; the scheduler advances inside the step
            skipped_before = engine.skipped_steps
            step_peak.before(step)
            watch.step_started(step)
            with profiler.step(step):  # profile_steps: this step under torch.profiler, its trace written at the last
                loss, counts = grpo.train_step(step) if grpo else train_step(resolved, engine, data, loss_fn)
            if balancer:  # a collective, within the hang watch; a step the optimizer skipped moves no bias
                loads = balancer.after_step(applied=engine.skipped_steps == skipped_before)
            watch.step_ended()
            # every rank: signals, rank 0's save clock, each rank's compute seconds (one all-reduce)
            signalled, clock_due, compute, writing = stopper.after_step(clock.take() if clock else 0.0, writer.busy)
            step_peak.after(step)
            data.guard.after_step(step)
            if data.guard.enabled and step == min(total_steps, data.guard.last_step):
                log0(
                    f"data order check passed: first and last stage of every pipeline"
                    f"{' (and their tensor-parallel peers)' if resolved.layout.tp > 1 else ''} loaded the same "
                    f"{data.guard.compared} micro-batches in steps {start_step + 1}..{step}"
                )
            grad_norm = engine.get_global_grad_norm()  # a tensor, a float, or None when the optimizer keeps none
            norm = None if grad_norm is None else float(grad_norm)
            extra, written = grpo.metrics() if grpo else (objective_metrics(resolved, engine, loss_fn), {})
            compute = compute if clock else None
            fields = compiled.after_step(step)  # compile=true: recompiles, compile seconds
            if written:
                fields = {**(fields or {}), **written}
            if balancer:
                fields = {**(fields or {}), "expert_load_max": load_imbalance(loads)}
            logger.log(step, loss, lr, norm, *counts[:3], counts[3:], compute=compute, extra=extra, fields=fields)
            nonfinite = not math.isfinite(loss) or engine.skipped_steps > skipped_before  # the same on every rank
            with watch.saving():  # a hang exit (training/resilience/hang.py) waits for the save
                if writer.tag is not None and (not writing or nonfinite):  # every rank's files of it written
                    last_saved = save_restore.step_of(save_restore.publish(resolved, writer))
            check_finite(resolved, step, loss, engine.skipped_steps > skipped_before, last_saved, skipped)
            # the checkpoint first: an eval that fails (or a signal during it) never costs the steps trained
            with watch.saving():
                stop = save_if_due(resolved, engine, data, step, total_steps, stopper, signalled, clock_due, writer)
            if stop is not None and writer.tag is None:
                last_saved = step
            if data.evals and ((cfg.eval_steps and step % cfg.eval_steps == 0) or step == total_steps):
                for evaluation, labels in zip(data.evals, eval_labels):
                    if grpo:
                        grpo.evaluate(step, evaluation, logger)
                    else:
                        evaluate(resolved, engine, data, evaluation, step, logger, loss_fn, labels)
            if stop:  # after a stop signal, the step's eval done: a resume starts at the next step
                raise Preempted(stop)
        if writer.tag is not None:  # save_final=false: the last background save, published before the run ends
            last_saved = save_restore.step_of(save_restore.publish(resolved, writer, "the run ends"))
    finally:  # a stop signal (Preempted) or a failure: the W&B run and metrics.jsonl are closed too
        profiler.close()  # a run ended before profile_steps' last: the trace of the steps profiled
        logger.close()
    if last_saved is None and total_steps <= start_step:
        log0("no step to train (max_steps=0): nothing trained, no checkpoint written")
    elif not cfg.save_final and total_steps > start_step:
        log0(
            f"save_final=false: no checkpoint of step {total_steps}; "
            + (f"the last is global_step{last_saved}" if last_saved else "this run saved none")
        )
    report_final_figures(resolved, census, step_peak, max(start_step, total_steps))


def save_if_due(
    resolved: Resolved,
    engine,
    data: RankData,
    step: int,
    total_steps: int,
    stopper: StopAndSave,
    signalled: list[int],
    clock_due: bool,
    writer: BackgroundWriter,
) -> str | None:
    """Save after ``step`` when save_steps, the end (save_final), save_every_minutes or a stop signal says so (the
    ranks agreed on the last two after the step, training/resilience/preemption.py); with save_async, in the background
    unless it is the last step's or a signal's. Returns None when nothing was saved; else, after a signal before the
    last step, the line the job stops with (the caller raises it), or ""."""
    cfg = resolved.cfg
    at_end = step == total_steps and cfg.save_final
    if not ((cfg.save_steps and step % cfg.save_steps == 0) or at_end or clock_due or signalled):
        return None
    start = time.time()
    background = cfg.save_async and step < total_steps and not signalled
    stopper.saving(save_restore.tag_for(step))  # a second signal from here on asks whether it is complete
    tag = save_restore.save(resolved, engine, step, data.iterator, writer, background)
    why = f", {cfg.save_every_minutes:g} minutes since the last" if clock_due else ""
    if background:
        stopper.snapshot_taken()
        log0(
            f"checkpoint {tag}: copied to host memory in {writer.captured_s:.2f} s{why}; written in the background "
            "while training goes on (latest names it once every rank's files are written)"
        )
        return ""
    stopper.saved()
    save_restore.log_saved(resolved, tag, why)
    if signalled and step < total_steps:  # in the last step: the run is complete, exit 0
        return (
            f"stop signal ({'/'.join(STOP_SIGNALS)}) on rank(s) {signalled}: checkpoint {tag} saved after step {step} "
            f"of {total_steps} in {time.time() - start:.1f} s; exiting with code {PREEMPTED_EXIT_CODE}. The same "
            "command (resume=auto) continues from it exactly."
        )
    return ""


def tracking_run(resolved: Resolved, axes: dict):
    """Rank 0's W&B run (monitor.wandb): the resolved config and the parallel axes' sizes (as "layout") as its
    config."""
    from training.observation.tracking import WandbRun

    config = OmegaConf.to_container(OmegaConf.structured(resolved.cfg))
    return WandbRun(resolved.cfg.monitor, resolved.cfg.output_dir, {**config, "layout": axes})


def check_finite(
    resolved: Resolved, step: int, loss: float, update_skipped: bool, last_saved: int | None, skipped: list[int]
) -> None:
    """A non-finite loss (or gradient: the optimizer skipped the update) never passes silently.

    ``nonfinite_loss=stop`` raises on every rank (the loss and the optimizer's skip are the same on
    all ranks), naming the step and the last good checkpoint; ``skip`` logs the step and goes on,
    but only where the optimizer did skip the update: where it applied a non-finite one (ZeRO 0 in
    fp32 checks nothing), the weights are lost, and training stops either way. fp16's loss-scale
    overflows (finite loss, skipped update) are routine and pass.
    """
    cfg = resolved.cfg
    bad_loss = not math.isfinite(loss)
    if not bad_loss and (not update_skipped or cfg.precision == "fp16"):
        return
    what = (
        f"loss is {loss}"
        if bad_loss
        else f"loss {loss:.4f} but non-finite gradients (the optimizer skipped the update)"
    )
    if cfg.nonfinite_loss == "skip" and update_skipped:
        skipped.append(step)
        log0(
            f"warning: step {step}: {what}: update skipped (nonfinite_loss=skip; {len(skipped)} skipped: steps "
            f"{skipped})"
        )
        return
    if last_saved is not None:
        last = f"{os.path.join(cfg.output_dir, save_restore.tag_for(last_saved))} (resume=auto continues from it)"
    else:
        last = f"none in {cfg.output_dir} (start again from {cfg.model_name_or_path or 'scratch'})"
    if update_skipped:
        advice = (
            "The optimizer skipped this update; nothing after the last good checkpoint is saved. Lower optim.lr, "
            "raise optim.warmup_steps, check this step's data, or set nonfinite_loss=skip to skip such steps."
        )
    else:
        advice = (
            f"The optimizer applied this update (ZeRO stage {resolved.zero_stage} with {cfg.precision} checks no "
            f"overflow): the weights are no longer finite and are not saved. Lower optim.lr or raise "
            f"optim.warmup_steps (nonfinite_loss=skip needs an optimizer that skips such updates, e.g. ds=zero1)."
        )
    raise TrainingStopped(
        f"step {step}: {what}: training stopped (nonfinite_loss={cfg.nonfinite_loss}). "
        f"Last good checkpoint: {last}. {advice}"
    )


def report_final_figures(resolved: Resolved, census: CensusAtStep, step_peak: StepPeak, step: int) -> None:
    """The run's last lines, per rank: peak memory, the model states (where the census ran) and the second step's
    peak (count_step_memory, or a GPU); the same figures, unrounded, as metrics.jsonl's last record (kind "final",
    training/observation/metrics.py), for benchmarks and tests to read as numbers."""
    peaks = on_all_ranks("reporting memory", peak_memory_mib)
    log0("peak memory per rank (MiB): " + ", ".join(f"rank {r} {peak_memory_text(p)}" for r, p in enumerate(peaks)))
    figures: dict = {"peak_memory_mib": peaks}
    states = on_all_ranks("measuring model states", lambda: census.result)
    if all(states):
        log0(
            "model states per rank (MiB, tensors held: weights + grads + optimizer = total): "
            + ", ".join(
                f"rank {r} {s['weights'] / 2**20:.2f} + {s['grads'] / 2**20:.2f} + {s['optimizer'] / 2**20:.2f} = "
                f"{s['total'] / 2**20:.2f}"
                for r, s in enumerate(states)
            )
        )
        figures["model_states_mib"] = [{role: size / 2**20 for role, size in s.items()} for s in states]
    step_peaks = on_all_ranks("measuring the step's peak", lambda: step_peak.result_mib)
    if all(p is not None for p in step_peaks):
        where = "GPU allocator" if torch.cuda.is_available() else "tensors counted on CPU"
        log0(
            f"step {step_peak.at} peak of allocated tensors above its start per rank (MiB, {where}; gradients, "
            "activations, loss buffer, temporaries): "
            + ", ".join(f"rank {r} {p:.1f}" for r, p in enumerate(step_peaks))
        )
        figures.update(step_peak_at=step_peak.at, step_peak_mib=step_peaks)
    if dist.get_rank() == 0:
        write_final_record(resolved.cfg.output_dir, step, figures)


def peak_memory_mib() -> dict[str, float]:
    """This rank's peak host RSS, and its peak accelerator memory where there is one (MiB)."""
    peak = {"host": peak_rss_mb()}
    if torch.cuda.is_available():
        peak["gpu"] = torch.cuda.max_memory_allocated() / 2**20
    return peak


def peak_memory_text(peak: dict[str, float]) -> str:
    """``host 568``, or ``host 568 / GPU 9120``: one rank's entry of the peak memory line."""
    host = f"host {peak['host']:.0f}"
    if "gpu" in peak:
        return f"{host} / GPU {peak['gpu']:.0f}"
    return host


def check_axes_at_end(model, resolved: Resolved) -> None:
    """At the end of a run, each axis's own check (tensor parallelism: every replicated parameter is the same on
    the TP peers): a failed one stops the run."""
    for plan in axis_plans(resolved.layout):
        problem, passed = plan.end_check(model, on_all_ranks)
        if problem:
            raise TrainingStopped(problem)
        if passed:
            log0(passed)
