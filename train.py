"""Train Llama with DeepSpeed pipeline parallelism (pipe x data), configured by Hydra.

    deepspeed --num_gpus 4 train.py model_name_or_path=CKPT_DIR num_stages=2 data.train_file=train.jsonl
    deepspeed --num_gpus 4 train.py model=tiny model.tokenizer=TOK_DIR num_stages=2 ...   # from scratch
    python train.py --cfg job            # print the resolved config and exit

``main`` is the table of contents: config -> layout (process group, topology) -> pipeline model -> weights ->
data -> engine -> resume -> loop (eval, checkpoints). Each line is one call: the start-up phases are in
training/build.py, the announcement in training/observation/announce.py, the loop in training/loop.py (a step in
training/step.py).
"""

from __future__ import annotations

import os
import sys

# The DeepSpeed launcher appends --local_rank=N to the arguments, which Hydra rejects as an override.
# The same value is in the LOCAL_RANK environment variable, so the argument is dropped before Hydra parses.
sys.argv = [a for a in sys.argv if not a.startswith("--local_rank")]

from training.observation.logs import argv_log_level, quiet_dependencies, set_log_level  # noqa: E402
from training.resilience.op_build_watch import use_venv_extensions_dir  # noqa: E402

# Before deepspeed is imported: its ops build into this virtualenv's own cache (training/resilience/op_build_watch.py),
# and the known-harmless lines of its import are filtered (training/observation/logs.py).
EXTENSIONS_DIR = use_venv_extensions_dir()
quiet_dependencies(argv_log_level(sys.argv))

import hydra  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from data.order_guard import OrderMismatchError  # noqa: E402
from models.host_memory import peak_rss_mb  # noqa: E402
from training.build import (  # noqa: E402
    add_lora,
    build_data,
    build_engine,
    build_loss,
    build_model,
    init_topology,
    init_weights,
    lock_output_dir,
    make_output_dir,
    resume_or_start,
)
from training.configuration.overrides import given_keys, override_key_problems, unknown_key_problems  # noqa: E402
from training.configuration.schema import ConfigError, Resolved, TrainConfig, register_configs  # noqa: E402
from training.configuration.validate import resolve  # noqa: E402
from training.dpo import prepare_reference  # noqa: E402
from training.grpo import keep_reference  # noqa: E402
from training.loop import check_axes_at_end, plan_steps, train  # noqa: E402
from training.observation.announce import announce  # noqa: E402
from training.observation.logs import log0  # noqa: E402
from training.optim import fill_ds_config  # noqa: E402
from training.resilience.all_ranks import (  # noqa: E402
    StartupError,
    TrainingStopped,
    WriteFailed,
    exit_finished_run,
    failure_text,
    on_all_ranks,
    release_cpu_comm_buffer,
)
from training.resilience.preemption import (  # noqa: E402
    PREEMPTED_EXIT_CODE,
    Preempted,
    exit_alone,
    exit_if_exiting,
    exit_if_peer_lost,
    mark_exiting,
    stop_at_once_on_signals,
)

register_configs()


def resolve_config(dict_cfg: DictConfig) -> Resolved:
    """Typed config, validated before any process group exists (all problems reported together)."""
    unknown = unknown_key_problems(OmegaConf.to_container(dict_cfg))  # to_object would drop them silently
    cfg: TrainConfig = OmegaConf.to_object(dict_cfg)
    given = given_keys(HydraConfig.get().overrides.task)
    resolved = resolve(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")), problems=unknown, given=given)
    for line in resolved.adapted:
        log0(f"adapted: {line}")
    for warning in resolved.warnings:
        log0(f"warning: {warning}")
    return resolved


def join_ranks(resolved: Resolved) -> PipeDataParallelTopology:
    """The process group and the ranks' topology (training/build.py), a master port already in use said so."""
    try:
        return init_topology(resolved, EXTENSIONS_DIR)
    except RuntimeError as e:  # torch's DistNetworkError is one
        if "EADDRINUSE" not in str(e) and "address already in use" not in str(e).lower():
            raise
        fail(
            f"the master port {os.environ['MASTER_PORT']} is in use (another job on this machine?): launch with "
            "another port, `deepspeed --master_port PORT ...` (MASTER_PORT=PORT for scripts/demo.sh, "
            "scripts/multinode/ and torchrun)"
        )


# An absolute path: Hydra resolves a relative one against the calling module, which breaks imports of train.
@hydra.main(
    version_base="1.3",
    config_path=os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf"),
    config_name="config",
)
def main(dict_cfg: DictConfig) -> None:
    try:
        resolved = resolve_config(dict_cfg)
    except ConfigError as e:
        fail(str(e))
    set_log_level(resolved.cfg.log_level)
    topology = join_ranks(resolved)
    lock, code = None, 0
    try:
        lock = lock_output_dir(resolved)
        on_all_ranks("creating output_dir", lambda: make_output_dir(resolved.cfg.output_dir))
        # from here a signal during start-up ends the job at once, said once (training/resilience/preemption.py)
        stop_at_once_on_signals(resolved.cfg.output_dir, dist.get_rank(), lock.release if lock else None)
        rss_before_model = peak_rss_mb()
        ds_config = fill_ds_config(resolved)  # the DeepSpeed config: a ZeRO-3 stack is built under it, the engine too
        loss_fn = build_loss(resolved)
        model = build_model(resolved, topology, loss_fn, ds_config)
        init_reports = init_weights(model, resolved, rss_before_model)
        lora_reports = add_lora(model, resolved)
        data, data_reports = build_data(resolved, topology)
        total_steps, steps_per_epoch = plan_steps(resolved, data)
        engine = build_engine(resolved, model, ds_config, total_steps)
        keep_reference(resolved, engine, data)  # grpo.beta > 0: the starting weights, before a resume replaces them
        start_step = resume_or_start(resolved, engine, data, total_steps)
        announce(
            resolved, engine, init_reports, lora_reports, data_reports, data, start_step, total_steps, steps_per_epoch
        )
        if resolved.cfg.train_objective == "dpo":
            prepare_reference(resolved, engine, data, loss_fn, log0)
        train(resolved, engine, data, loss_fn, start_step, total_steps)
        check_axes_at_end(model, resolved)
        dist.barrier()
    except (StartupError, OrderMismatchError, TrainingStopped) as e:  # raised on every rank alike
        fail(str(e))
    except Preempted as e:  # on every rank alike, the checkpoint complete
        log0(str(e))
        code = PREEMPTED_EXIT_CODE
    except WriteFailed as e:  # this rank alone: its peers wait in a collective
        exit_alone(str(e))
    except Exception as e:
        # a collective failing because the job's peers exited first (training/resilience/hang.py): quiet
        exit_if_exiting()
        exit_if_peer_lost(dist.get_rank(), e)  # a peer gone without a word (kill -9): one line for the job
        # a write not wrapped in training.resilience.all_ranks.writing
        if isinstance(e, OSError) and e.filename is not None:
            exit_alone(f"rank {dist.get_rank()}: {failure_text(e)}")
        mark_exiting()  # this rank's traceback follows; its peers, failing in a collective with it, stay quiet
        raise
    finally:
        if lock is not None:
            lock.release()
        # Every rank leaves the process group before exiting (DeepSpeed on CPU can abort at exit otherwise).
        if dist.is_initialized():
            dist.destroy_process_group()
        release_cpu_comm_buffer()
    if HydraConfig.get().mode != RunMode.MULTIRUN or code:  # a sweep's next job runs in this process
        exit_finished_run(code)  # reached only when the run finished or stopped saved: failures raised above


def fail(message: str) -> None:
    """Report an error once per job (every rank saw the same one: it was raised on all ranks alike, or
    found by the same validation) and exit non-zero."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"train.py: error: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


if __name__ == "__main__":
    typos = override_key_problems(sys.argv[1:])
    if typos:
        fail("invalid configuration:\n  " + "\n  ".join(typos))
    main()
