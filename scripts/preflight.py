"""Check a training command before booking the cluster: the same config validation train.py runs,
for a given world size, then the layout and the planner's per-GPU memory estimate for it.

    python scripts/preflight.py --world-size 16 model_name_or_path=CKPT_DIR num_stages=8 ds=zero1_offload \\
        micro_batch_size=1 gradient_accumulation_steps=16 data.train_file=train.jsonl data.max_seq_length=4096

Arguments after the options are train.py's Hydra overrides, unchanged. Exits 1 with train.py's error
message when the config is invalid. Nothing is started: no process group, no model, no data reading.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def check(world_size: int, overrides: list[str]) -> list[str]:
    """The report's lines for a valid config; raises ValueError with train.py's message otherwise."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from scripts.estimate_memory import shape_of, splitter
    from training.config import ConfigError, offloads, register_configs, resolve
    from training.memory_plan import GB, Layout, estimate

    register_configs()
    try:
        with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3"):
            dict_cfg = compose(config_name="config", overrides=overrides)
        resolved = resolve(OmegaConf.to_object(dict_cfg), world_size=world_size)
    except (ConfigError, HydraException, OmegaConfBaseException) as e:
        raise ValueError(str(e)) from e
    cfg, config = resolved.cfg, resolved.model_config
    lines = [f"warning: {w}" for w in resolved.warnings]
    zero = resolved.ds_json.get("zero_optimization", {})
    offload_opt, offload_par = offloads(zero)
    global_batch = cfg.micro_batch_size * cfg.gradient_accumulation_steps * resolved.dp
    engine = "pipeline engine" if resolved.uses_pipeline else "data-parallel engine"
    lines.append(f"config OK for {world_size} ranks: pipe {cfg.num_stages} x data {resolved.dp}, {engine}, "
                 f"ds_config {cfg.ds_config} (ZeRO-{resolved.zero_stage}), {cfg.precision}")
    lines.append(f"global batch {global_batch} = micro {cfg.micro_batch_size} x grad_acc {cfg.gradient_accumulation_steps} "
                 f"x dp {resolved.dp}; {global_batch * cfg.data.max_seq_length} tokens/step")
    layout = Layout(cfg.num_stages, resolved.dp, resolved.zero_stage, offload_opt, offload_par, cfg.micro_batch_size,
                    cfg.data.max_seq_length, cfg.gradient_accumulation_steps, cfg.activation_checkpoint_interval > 0,
                    "fp32" if cfg.precision == "fp32" else "bf16")
    params, layers = splitter(config, None, cfg.partition_method)(cfg.num_stages)
    e = estimate(params, layout, shape_of(config), layers)
    lines.append(f"planner (scripts/estimate_memory.py), most loaded GPU (stage {e.stage}, {params[e.stage] / 1e9:.2f} B "
                 f"params): model states {e.model_states / GB:.1f} GB + activations {e.activations / GB:.1f} GB = "
                 f"{e.total / GB:.1f} GB" + (f"; host {e.host / GB:.1f} GB per rank (offloaded)" if e.host else ""))
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, required=True, help="ranks the job will launch (nodes x GPUs per node)")
    p.add_argument("overrides", nargs="*", help="train.py's Hydra overrides")
    args = p.parse_args()
    try:
        lines = check(args.world_size, args.overrides)
    except ValueError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
