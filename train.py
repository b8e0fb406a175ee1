"""Train Llama with DeepSpeed pipeline parallelism (pipe x data), configured by Hydra.

    deepspeed --num_gpus 4 train.py model_name_or_path=CKPT_DIR num_stages=2 data.train_file=train.jsonl
    python train.py --cfg job            # print the resolved config and exit

``main`` reads like the table of contents: config -> topology -> pipeline model -> weights -> data ->
engine -> loop -> checkpoint. Each step is a short function below it.
"""

from __future__ import annotations

import os
import socket
import sys
import time

# The DeepSpeed launcher appends --local_rank=N to the arguments, which Hydra rejects as an override.
# The same value is in the LOCAL_RANK environment variable, so the argument is dropped before Hydra parses.
sys.argv = [a for a in sys.argv if not a.startswith("--local_rank")]

import deepspeed  # noqa: E402
import hydra  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from data.guard import OrderMismatchError  # noqa: E402
from models.checkpoint import copy_side_files, load_stage_weights, local_modules, peak_rss_mb  # noqa: E402
from models.llama_pipe import build_pipeline_model  # noqa: E402
from training.config import ConfigError, Resolved, TrainConfig, register_configs, resolve  # noqa: E402
from training.data_setup import RankData, prepare_rank_data  # noqa: E402
from training.distributed import StartupError, on_all_ranks  # noqa: E402
from training.metrics import StepLogger  # noqa: E402
from training.optim import build_lr_scheduler, fill_ds_config, param_groups  # noqa: E402

register_configs()


def log0(msg: str) -> None:
    """Print from global rank 0 only."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[train] {msg}", flush=True)


def resolve_config(dict_cfg: DictConfig) -> Resolved:
    """Typed config, validated before any process group exists (all problems reported together)."""
    cfg: TrainConfig = OmegaConf.to_object(dict_cfg)
    resolved = resolve(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    for warning in resolved.warnings:
        log0(f"warning: {warning}")
    return resolved


def init_topology(resolved: Resolved) -> PipeDataParallelTopology:
    """Start the process group and lay ranks out as pipe x data (pipe is the outer axis).

    ``python train.py`` without the launcher runs as a 1-rank job.
    """
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed.init_distributed()
    return PipeDataParallelTopology(num_pp=resolved.cfg.num_stages, num_dp=resolved.dp)


def build_model(resolved: Resolved, topology: PipeDataParallelTopology):
    """The pipeline module; this rank builds only its own stage's layers."""
    deepspeed.runtime.utils.set_random_seed(resolved.cfg.seed)
    return build_pipeline_model(resolved.model_config, topology, resolved.cfg.partition_method)


def load_weights(model, resolved: Resolved, rss_before_model_mib: float) -> list[dict]:
    """Read this stage's layer files only; returns every rank's load report, for the announcement."""

    def load() -> dict:
        start = time.time()
        report = load_stage_weights(model, resolved.model_config, resolved.cfg.model_name_or_path)
        params = [p for _, m in local_modules(model) for p in m.parameters()]
        return {
            "stage": model.stage_id,
            "specs": list(range(model._local_start, model._local_stop)),
            "params": sum(p.numel() for p in params),
            "param_mib": sum(p.numel() * p.element_size() for p in params) / 2**20,
            "rss_before_model_mib": rss_before_model_mib,
            "load_mib": report.bytes_read / 2**20,
            "load_s": time.time() - start,
            "peak_rss_mib": report.peak_rss_mb,
        }

    return on_all_ranks("loading stage weights", load)


def build_data(resolved: Resolved, topology: PipeDataParallelTopology) -> tuple[RankData, list[dict]]:
    """This rank's data (who tokenizes, who reads, placeholders: training/data_setup.py) and every
    rank's data report, for the announcement."""
    data = prepare_rank_data(resolved.cfg, resolved.model_config, topology.get_coord(dist.get_rank()), resolved.dp)
    reports = on_all_ranks("reporting data", lambda: {
        "role": data.role,
        "train": len(data.train),
        "eval": len(data.eval) if data.eval is not None else 0,
        "peak_rss_mib": peak_rss_mb(),
    })
    return data, reports


def build_engine(resolved: Resolved, model):
    """DeepSpeed's pipeline engine with AdamW and the LR schedule from the Hydra config."""
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, resolved.cfg.optim.weight_decay),
        config=fill_ds_config(resolved),
        lr_scheduler=build_lr_scheduler(resolved.cfg),
    )
    return engine


def announce(resolved: Resolved, load_reports: list[dict], data_reports: list[dict]) -> int:
    """Print, from rank 0, what was built: per rank its stage, specs, parameters, load cost and data."""
    cfg = resolved.cfg
    tokens_per_step = cfg.micro_batch_size * cfg.gradient_accumulation_steps * resolved.dp * cfg.data.max_seq_length
    log0(
        f"world {resolved.world_size} = pipe {cfg.num_stages} x data {resolved.dp} | "
        f"global batch {cfg.micro_batch_size * cfg.gradient_accumulation_steps * resolved.dp} samples = "
        f"micro {cfg.micro_batch_size} x grad_acc {cfg.gradient_accumulation_steps} x dp {resolved.dp} | "
        f"{tokens_per_step} tokens/step | {data_reports[0]['train']} training samples, {data_reports[0]['eval']} eval samples"
    )
    for rank, info in enumerate(load_reports):
        log0(
            f"rank {rank}: stage {info['stage']} specs {info['specs'][0]}..{info['specs'][-1]} "
            f"({len(info['specs'])} specs, {info['params'] / 1e6:.2f} M params) | loaded {info['load_mib']:.1f} MiB "
            f"in {info['load_s']:.2f} s | peak RSS at load {info['peak_rss_mib']:.0f} MiB "
            f"(before building the stage {info['rss_before_model_mib']:.0f} MiB, stage parameters {info['param_mib']:.0f} MiB)"
        )
    for rank, info in enumerate(data_reports):
        log0(f"rank {rank}: data {info['role']} | peak RSS after data {info['peak_rss_mib']:.0f} MiB")
    return tokens_per_step


def train_loop(resolved: Resolved, engine, data: RankData, tokens_per_step: int) -> None:
    """``max_steps`` optimizer steps; one line and one metrics.jsonl record per step from rank 0.

    After each of the first ``data.order_check_steps`` steps, the order guard checks that first and
    last stage loaded the same micro-batches (a collective on every rank).
    """
    cfg = resolved.cfg
    logger = StepLogger(cfg.output_dir, cfg.max_steps, tokens_per_step, active=dist.get_rank() == 0)
    for step in range(1, cfg.max_steps + 1):
        lr = engine.get_lr()[0]  # the rate this step uses; the scheduler advances inside train_batch
        loss = engine.train_batch(data_iter=data.iterator)  # mean over the global batch, on every rank
        data.guard.after_step(step)
        if data.guard.enabled and step == min(cfg.max_steps, data.guard.check_steps):
            log0(f"data order check passed: first and last stage of every pipeline loaded the same "
                 f"{data.guard.compared} micro-batches in steps 1..{step}")
        grad_norm = engine.get_global_grad_norm()  # a tensor, a float, or None when the optimizer keeps none
        logger.log(step, loss.item(), lr, None if grad_norm is None else float(grad_norm))
    logger.close()


def save_checkpoint(resolved: Resolved, engine) -> None:
    """DeepSpeed checkpoint plus model config, tokenizer and resolved config: a self-contained dir."""
    cfg = resolved.cfg
    engine.save_checkpoint(cfg.output_dir)
    if dist.get_rank() == 0:
        copy_side_files(cfg.model_name_or_path, cfg.output_dir, dtype=None)
        OmegaConf.save(OmegaConf.structured(cfg), os.path.join(cfg.output_dir, "train_config.yaml"))
    log0(f"saved checkpoint global_step{engine.global_steps} in {cfg.output_dir} (peak RSS {peak_rss_mb():.0f} MiB)")


# An absolute path: Hydra resolves a relative one against the calling module, which breaks imports of train.
@hydra.main(version_base="1.3", config_path=os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf"), config_name="config")
def main(dict_cfg: DictConfig) -> None:
    try:
        resolved = resolve_config(dict_cfg)
    except ConfigError as e:
        fail(str(e))
    topology = init_topology(resolved)
    try:
        on_all_ranks("creating output_dir", lambda: os.makedirs(resolved.cfg.output_dir, exist_ok=True))
        rss_before_model = peak_rss_mb()
        model = build_model(resolved, topology)
        load_reports = load_weights(model, resolved, rss_before_model)
        data, data_reports = build_data(resolved, topology)
        engine = build_engine(resolved, model)
        tokens_per_step = announce(resolved, load_reports, data_reports)
        train_loop(resolved, engine, data, tokens_per_step)
        if resolved.cfg.max_steps > 0:
            save_checkpoint(resolved, engine)
        else:
            log0("max_steps=0: weights and data loaded, nothing trained, no checkpoint written")
        dist.barrier()
    except (StartupError, OrderMismatchError) as e:  # raised on every rank alike
        fail(str(e))
    finally:
        # Every rank leaves the process group before exiting (DeepSpeed on CPU can abort at exit otherwise).
        if dist.is_initialized():
            dist.destroy_process_group()


def fail(message: str) -> None:
    """Report an error once per node (every rank saw the same one) and exit non-zero."""
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print(f"train.py: error: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


if __name__ == "__main__":
    main()
