"""Run as `deepspeed --num_gpus N tests/ds_scripts/generate_on_stages.py OUT_JSON CASES_JSON`.

CASES_JSON: a list of cases, each {"name", "ckpt": a converted directory, "hf": its Hugging Face directory (the
config), "stages", "partition": the partition_method, "replicas": one {"prompts", "greedy_eos", "sampled_eos"} per
data-parallel replica, "max_new_tokens", "seed", "sampling": {temperature, top_k, top_p}, "micro_batches": a list}.
For each case every rank builds its stage of a pipe x data topology (train.py's build_pipeline_model, its layer files
loaded with load_stage_weights) and calls parallel.pipeline_generation.generate_on_stages with its replica's prompts,
greedy and then sampled with a torch.Generator seeded ``seed``, with the default micro_batches and then each of the
list. Each rank writes OUT_JSON.<rank>: {name: {"stage", "replica", "specs", "greedy": [[ids, truncated], ...],
"sampled": [...], "chunked": {micro_batches: {"greedy": ..., "sampled": ...}}}}. On 4 ranks also "refused" (the
refusals' messages) and "tensor_parallel": the first case on pipe 2 x tensor 2 with its first replica's prompts (the
same keys, and "tp_rank").
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

from models.families import load_config  # noqa: E402
from models.files.pipeline_dir import load_stage_weights  # noqa: E402
from parallel.layout import Layout  # noqa: E402
from parallel.pipeline_generation import generate_on_stages  # noqa: E402
from parallel.stage import build_pipeline_model, pipeline_topology  # noqa: E402

out_path, cases_path = sys.argv[1], sys.argv[2]
with open(cases_path) as f:
    cases = json.load(f)
deepspeed.init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()


def rows(completions) -> list:
    return [[c.ids, c.truncated] for c in completions]


def run_case(model, case, mine) -> dict:
    """This rank's completions of its replica's prompts ``mine``: greedy, sampled, and each micro_batches."""

    def greedy(micro_batches=None):
        return rows(
            generate_on_stages(
                model, mine["prompts"], case["max_new_tokens"], mine["greedy_eos"], micro_batches=micro_batches
            )
        )

    def sampled(micro_batches=None):
        generator = torch.Generator().manual_seed(case["seed"])
        return rows(
            generate_on_stages(
                model,
                mine["prompts"],
                case["max_new_tokens"],
                mine["sampled_eos"],
                do_sample=True,
                generator=generator,
                micro_batches=micro_batches,
                **case["sampling"],
            )
        )

    return {
        "stage": model.stage_id,
        "replica": model._grid.data_parallel_id,
        "specs": list(range(model._local_start, model._local_stop)),
        "greedy": greedy(),
        "sampled": sampled(),
        "chunked": {m: {"greedy": greedy(m), "sampled": sampled(m)} for m in case["micro_batches"]},
    }


results = {}
for case in cases:
    config = load_config(case["hf"])
    topology = PipeDataParallelTopology(num_pp=case["stages"], num_dp=world // case["stages"])
    model = build_pipeline_model(config, topology, partition_method=case["partition"])
    load_stage_weights(model, config, case["ckpt"])
    model.eval()
    results[case["name"]] = run_case(model, case, case["replicas"][model._grid.data_parallel_id])


def refusal(model, *args, **kwargs) -> str:
    try:
        generate_on_stages(model, *args, **kwargs)
    except ValueError as e:
        return str(e)
    return "not refused"


if world == 4:  # what is refused, the same message on every rank of a pipeline
    config = load_config(cases[0]["hf"])
    model = build_pipeline_model(config, PipeDataParallelTopology(num_pp=2, num_dp=2))
    prompts = cases[0]["replicas"][0]["prompts"]
    refused = {
        "other_prompts": refusal(model, prompts[::-1] if model.stage_id == 1 else prompts, 4, 2),
        "no_tokens": refusal(model, prompts, 0, 2, temperature=0.0, do_sample=True),
    }
    layout = Layout(stages=2, dp=2, schedule="dualpipev")
    refused["dualpipev"] = refusal(build_pipeline_model(config, pipeline_topology(layout), layout), prompts, 4, 2)
    results["refused"] = refused
    # pipe 2 x tensor 2, data 1: the first case's model and first replica's prompts, on every rank
    layout = Layout(stages=2, tp=2)
    model = build_pipeline_model(config, pipeline_topology(layout), layout, partition_method=cases[0]["partition"])
    load_stage_weights(model, config, cases[0]["ckpt"])
    model.eval()
    results["tensor_parallel"] = run_case(model, cases[0], cases[0]["replicas"][0]) | {
        "tp_rank": model._grid.get_slice_parallel_rank()
    }
with open(f"{out_path}.{rank}", "w") as f:
    json.dump(results, f)
dist.barrier()
dist.destroy_process_group()
