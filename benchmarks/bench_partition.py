"""Predicted per-GPU peak of every stage under each partition method (the planner, no GPU needed).

    python benchmarks/bench_partition.py

For the reference layouts (Llama-3-8B on 4 and 8 stages, Llama-2-70B on 8 stages with the optimizer
offloaded; sequence 4096 and 8192; bf16, micro-batch 1, grad_acc 16, activation checkpointing, the
loss chunk on and off): the largest and smallest stage peak and their ratio, for partition_method
compute, parameters and memory (parallel/memory_plan.py, the same functions train.py's split uses);
and the pipeline's compute balance, the most loaded stage's FLOPs over the mean (the step time of a
pipeline follows its slowest stage: 1.00 is perfect balance).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.llama_pipe import spec_weights  # noqa: E402
from parallel.layout import Layout  # noqa: E402
from parallel.memory_plan import GB, shape_of, stage_estimates  # noqa: E402
from parallel.partition import splitter, stage_boundaries  # noqa: E402
from training.configuration.model_source import model_group_config  # noqa: E402
from training.configuration.schema import TrainConfig  # noqa: E402

CASES = [  # (model, stages, dp, zero, optimizer offloaded)
    ("llama3-8b", 4, 2, 1, False),
    ("llama3-8b", 8, 2, 1, False),
    ("llama2-70b", 8, 2, 1, True),
]
METHODS = ("compute", "parameters", "memory")


def main() -> None:
    print(
        "| model | stages x dp | seq | loss chunk | "
        + " | ".join(f"{m}: max / min GB (ratio), FLOPs max/mean" for m in METHODS)
        + " |\n|---|---|---|---|"
        + "---|" * len(METHODS)
    )
    for model, stages, dp, zero, offload in CASES:
        config = model_group_config(model)
        work = spec_weights(config, "compute")  # FLOPs per token of each spec, up to a factor
        for seq in (4096, 8192):
            for chunk in (TrainConfig.loss_chunk_tokens, 0):
                layout = Layout(stages, dp, zero, offload, False, 1, seq, 16, True, "bf16", chunk)
                cells = []
                for method in METHODS:
                    params, layers = splitter(config, None, method)(layout)
                    totals = [e.total for e in stage_estimates(params, layout, shape_of(config), layers)]
                    parts = stage_boundaries(config, stages, method, layout)
                    flops = [sum(work[parts[p] : parts[p + 1]]) for p in range(stages)]
                    cells.append(
                        f"{max(totals) / GB:.1f} / {min(totals) / GB:.1f} ({max(totals) / min(totals):.2f}), "
                        f"{max(flops) * stages / sum(flops):.2f}"
                    )
                print(f"| {model} | {stages} x {dp} | {seq} | {chunk or 'off'} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
