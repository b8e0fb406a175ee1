"""GRPO through the pipeline against TRL's GRPOTrainer: the same tiny model, prompts, global batch and sampling.

    python benchmarks/bench_grpo.py                 # CPU: 4 ranks, pipe 2 x data 2, fp32; about 2 minutes
    python benchmarks/bench_grpo.py --quick         # 2 steps, completions of 8 tokens (the smoke test's)

The random Llama of tests/support/models.py (models/tiny.py's tiny_config: hidden 64, 4 layers, vocabulary 512, its
tokenizer trained on the offline corpus) and 40 short prompts. ``pipeline``: train.py train_objective=grpo on pipe
--stages x data (--gpus / --stages), micro-batch --micro-batch, --grad-accum micro-batches, generation on the
pipeline's stages (KV cache). ``TRL``: GRPOTrainer in one process with its own ``model.generate``,
per_device_train_batch_size = micro, gradient_accumulation_steps = grad-accum x data: the same completions per step
(one generation per step), num_generations, max_completion_length, temperature 1, --precision, beta 0, its default loss.
The reward is the share of the letter 'e' (``letter_share``). Per setup: completion tokens generated per second of
generation (train.py's generation_s, TRL's ``_generate_single_turn`` timed), the median step time after --warmup
steps, the mean completion length and peak memory (host RSS on CPU, per rank for the pipeline; the allocator's peak
on a GPU). Then the pipeline's generation cost per completion token at each of --lengths: flat when the KV cache
keeps the total cost linear in the length. The random model rarely emits EOS: completions run to the limit, and the
counts are the completions' real lengths.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import harness  # noqa: E402
from benchmarks.harness import measure_train, per_rank_text, run_overrides  # noqa: E402

WORDS = ["apple", "river", "stone", "green", "light", "music", "table", "cloud"]
REWARD = "benchmarks.bench_grpo:letter_share"
TRL_FLAG = "--trl-worker"


def letter_share(prompts, completions, **kwargs):
    """The share of a completion's characters that are the letter 'e' (0 for an empty completion)."""
    return [c.count("e") / len(c) if c else 0.0 for c in completions]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=4, help="the pipeline's ranks (CPU processes here, GPUs elsewhere)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--ds", default="zero1")
    p.add_argument("--micro-batch", type=int, default=2, help="completions per micro-batch")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--generations", type=int, default=4, help="grpo.num_generations")
    p.add_argument("--completion", type=int, default=16, help="max_completion_length of the pipeline/TRL rows")
    p.add_argument("--lengths", default="16,32,64", help="max_completion_length of the pipeline's cost rows")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1, help="steps left out of the medians")
    p.add_argument("--work-dir", default=None, help="where the model and runs go (default: a temporary directory)")
    p.add_argument("--quick", action="store_true", help="2 steps, 8-token completions, one run each (smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.completion, args.lengths = 2, 8, "8"
    args.lengths = [int(n) for n in args.lengths.split(",")]
    args.seq = 32 + max(args.lengths + [args.completion])  # the prompts are under 16 tokens
    return args


def write_model_and_prompts(work: str) -> tuple[str, str]:
    """tests/support/models.py's tiny Llama with its tokenizer, and 40 prompts (as /tmp/g/setup.py made them)."""
    import torch

    from models.tiny import save_random_model, tiny_config, train_tokenizer

    model = os.path.join(work, "hf")
    if not os.path.exists(os.path.join(model, "config.json")):
        train_tokenizer(model, vocab_size=512)
        save_random_model(tiny_config(), model, seed=0, dtype=torch.float32)
    prompts = os.path.join(work, "prompts.jsonl")
    with open(prompts, "w") as f:
        for i in range(40):
            record = {"prompt": f"Write about the {WORDS[i % 8]} and the {WORDS[i * 3 % 8]}", "target": WORDS[i % 8]}
            f.write(json.dumps(record) + "\n")
    return model, prompts


def pipeline_run(args, model: str, prompts: str, work: str, length: int) -> dict:
    """train.py GRPO on the pipeline; medians after --warmup steps of its metrics.jsonl."""
    out = os.path.join(work, f"pipeline_{length}")
    overrides = run_overrides(args, model, prompts, work, out)
    overrides += [
        "data=grpo",
        f"num_stages={args.stages}",
        f"gradient_accumulation_steps={args.grad_accum}",
        f"grpo.num_generations={args.generations}",
        f"grpo.max_completion_length={length}",
        f"grpo.reward_funcs=[{REWARD}]",
    ]
    result = measure_train(args.gpus, overrides, out, args.warmup, f"pipeline, completions of {length}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if r["kind"] == "train"]
    rows = args.micro_batch * args.grad_accum * (args.gpus // args.stages)
    return {**step_figures(steps[args.warmup :] or steps, rows), "peak": result["peak"], "kind": result["peak_kind"]}


def step_figures(steps: list[dict], rows: int) -> dict:
    """Medians over ``steps`` (records with step_s, generation_s, completions/mean_length) of ``rows`` completions
    each: step time, generation time, mean length, generated tokens per second and seconds per token."""
    length = statistics.median(r["completions/mean_length"] for r in steps)
    generation = statistics.median(r["generation_s"] for r in steps)
    tokens = statistics.median(r["completions/mean_length"] * rows / r["generation_s"] for r in steps)
    return {
        "step_s": statistics.median(r["step_s"] for r in steps),
        "generation_s": generation,
        "length": length,
        "tokens_s": tokens,
        "ms_per_token": 1e3 / tokens,
    }


def trl_run(args, model: str, prompts: str, work: str) -> dict:
    """TRL's GRPOTrainer in a process of its own (its peak memory its own), one thread per process as the ranks."""
    out = os.path.join(work, "trl.json")
    argv = [os.path.abspath(__file__), TRL_FLAG, out, model, prompts]
    argv += [str(v) for v in (args.micro_batch, args.grad_accum * (args.gpus // args.stages), args.generations)]
    argv += [str(args.completion), str(args.steps), args.precision]
    proc = harness.run_python(argv)
    if proc.returncode:
        raise SystemExit(f"TRL: GRPOTrainer failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    with open(out) as f:
        record = json.load(f)
    rows = args.micro_batch * args.grad_accum * (args.gpus // args.stages)
    figures = step_figures(record["steps"][args.warmup :] or record["steps"], rows)
    return {**figures, "peak": [record["peak_mib"]], "kind": record["kind"]}


def trl_worker(out, model, prompts, micro, grad_accum, generations, completion, steps, precision) -> None:
    """GRPOTrainer on ``model`` for ``steps`` steps; writes per step its wall time, the time in
    ``_generate_single_turn`` and the mean completion length, and the process's peak memory, to ``out``."""
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    generation_s, step_s = [], []

    class Timed(GRPOTrainer):
        def _generate_single_turn(self, *a, **k):
            start = time.perf_counter()
            try:
                return super()._generate_single_turn(*a, **k)
            finally:
                if cuda:
                    torch.cuda.synchronize()
                generation_s.append(time.perf_counter() - start)

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            step_s.append(time.perf_counter() - self.start)

    with open(prompts) as f:
        records = [json.loads(line) for line in f]
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=int(micro),
            gradient_accumulation_steps=int(grad_accum),
            max_steps=int(steps),
            learning_rate=3e-4,  # train.py's default optim.lr
            num_generations=int(generations),
            max_completion_length=int(completion),
            temperature=1.0,
            use_cpu=not cuda,
            bf16=precision == "bf16",
            gradient_checkpointing=False,  # TRL's default recomputes; train.py does not here
            report_to="none",
            logging_steps=1,
            save_strategy="no",
            seed=0,
        )
        trainer = Timed(
            model=AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="sdpa"),
            reward_funcs=[letter_share],
            args=config,
            train_dataset=Dataset.from_list(records),
            processing_class=AutoTokenizer.from_pretrained(model),
            callbacks=[StepTimes()],
        )
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    lengths = [e["completions/mean_length"] for e in trainer.state.log_history if "completions/mean_length" in e]
    if not len(lengths) == len(step_s) == len(generation_s) == int(steps):
        raise RuntimeError(
            f"{steps} steps, but {len(step_s)} step times, {len(generation_s)} generations, "
            f"{len(lengths)} logged lengths: one generation per step expected"
        )
    peak = (
        torch.cuda.max_memory_allocated() / 2**20 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    steps_out = [
        {"step_s": s, "generation_s": g, "completions/mean_length": n}
        for s, g, n in zip(step_s, generation_s, lengths, strict=True)
    ]
    with open(out, "w") as f:
        json.dump({"steps": steps_out, "peak_mib": peak, "kind": "GPU" if cuda else "host RSS"}, f)


def main(argv=None) -> None:
    args = parse_args(argv)
    work = args.work_dir or tempfile.mkdtemp(prefix="bench_grpo-")
    os.makedirs(work, exist_ok=True)
    model, prompts = write_model_and_prompts(work)
    dp = args.gpus // args.stages
    rows = args.micro_batch * args.grad_accum * dp
    pipeline = {n: pipeline_run(args, model, prompts, work, n) for n in sorted(set(args.lengths + [args.completion]))}
    trl = trl_run(args, model, prompts, work)
    print(
        f"tiny Llama (hidden 64, 4 layers, vocab 512), {args.precision}; {rows} completions per step (micro "
        f"{args.micro_batch} x grad_acc {args.grad_accum} x dp {dp}; TRL: per-device {args.micro_batch} x grad_acc "
        f"{args.grad_accum * dp}), num_generations {args.generations}, temperature 1; {args.steps} steps, medians "
        f"after {args.warmup}"
    )
    kind = trl["kind"]
    print(f"\nmax_completion_length {args.completion}:\n")
    print(f"| setup | generation tokens/s | generation s/step | s/step | mean length | peak {kind} (MiB) |")
    print("|---|---|---|---|---|---|")
    for name, r in ((f"train.py, pipe {args.stages} x data {dp}", pipeline[args.completion]), ("TRL generate", trl)):
        print(
            f"| {name} | {r['tokens_s']:.0f} | {r['generation_s']:.3f} | {r['step_s']:.3f} | {r['length']:.1f} "
            f"| {per_rank_text(r['peak'])} |"
        )
    print(f"\ntrain.py's generation against max_completion_length (pipe {args.stages} x data {dp}):\n")
    print("| max_completion_length | mean length | generation s/step | ms per completion token | s/step |")
    print("|---|---|---|---|---|")
    for n in args.lengths:
        r = pipeline[n]
        print(f"| {n} | {r['length']:.1f} | {r['generation_s']:.3f} | {r['ms_per_token']:.2f} | {r['step_s']:.3f} |")


if __name__ == "__main__":
    if TRL_FLAG in sys.argv:
        trl_worker(*sys.argv[sys.argv.index(TRL_FLAG) + 1 :])
    else:
        main()
