"""Run as `deepspeed --num_gpus 4 tests/ds_scripts/check_load.py OUT_JSON CKPT_DIR HF_DIR [CKPT_DIR HF_DIR ...]`.

For each checkpoint and for 1, 2 and 4 stages on the same 4 ranks: zero every parameter, load
CKPT_DIR through DeepSpeed's engine.load_checkpoint(load_module_only=True) and, on a fresh model,
through load_stage_weights; compare each loaded tensor with the Hugging Face original.
Each rank writes OUT_JSON.<rank>: {CKPT_DIR: {num_stages: {...}}}.
"""

import json
import os
import sys

sys.argv = [a for a in sys.argv if not a.startswith("--local_rank")]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from models.families import load_config  # noqa: E402
from models.files.pipeline_dir import load_stage_weights, local_modules  # noqa: E402
from models.llama_pipe import spec_layout  # noqa: E402
from parallel.stage import build_pipeline_model  # noqa: E402

out_path, pairs = sys.argv[1], sys.argv[2:]
deepspeed.init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
ds_config = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "steps_per_print": 10**9,
}


def zeroed_model(config, topology):
    model = build_pipeline_model(config, topology)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def compare(model, layout, reference) -> dict:
    """{spec index: all tensors bit-equal to the HF reference} for this rank's stage."""
    return {
        index: all(torch.equal(t, reference[layout[index].hf_prefix + k]) for k, t in module.state_dict().items())
        for index, module in local_modules(model)
    }


results = {}
for ckpt_dir, hf_dir in zip(pairs[::2], pairs[1::2]):
    config = load_config(hf_dir)
    layout = spec_layout(config)
    reference = load_file(os.path.join(hf_dir, "model.safetensors"))
    results[ckpt_dir] = {}
    for num_stages in (1, 2, 4):
        topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)
        engine, *_ = deepspeed.initialize(model=zeroed_model(config, topology), config=ds_config)
        engine.load_checkpoint(
            ckpt_dir, load_module_only=True, load_optimizer_states=False, load_lr_scheduler_states=False
        )
        ours = zeroed_model(config, topology)
        load_stage_weights(ours, config, ckpt_dir)
        results[ckpt_dir][num_stages] = {
            "stage": engine.module.stage_id,
            "specs": list(range(engine.module._local_start, engine.module._local_stop)),
            "parts": [int(p) for p in engine.module.parts],  # first spec of every stage (default partition_method)
            "deepspeed": compare(engine.module, layout, reference),
            "ours": compare(ours, layout, reference),
        }
with open(f"{out_path}.{rank}", "w") as f:
    json.dump(results, f)
dist.barrier()
dist.destroy_process_group()
