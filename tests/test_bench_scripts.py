"""The benchmark scripts run end to end at tiny sizes, and their arithmetic is right (the numbers themselves are in
BENCHMARKS.md).

The scripts: benchmarks/bench_train.py, bench_convert.py, bench_load.py, bench_lora.py, bench_dpo.py,
bench_prepare.py, bench_padding.py, bench_attention.py, bench_long_context.py, bench_moe.py, bench_hf_start.py
--save, bench_grpo.py. About 20 s on the 2-core CPU machine (start-up of the subprocesses, mostly).
"""

from __future__ import annotations

import json

import pytest

from tests.support.ranks import run_deepspeed
from tests.support.scripts import load_entry_point, run_script

bench_load = load_entry_point("benchmarks/bench_load.py")
bench_train = load_entry_point("benchmarks/bench_train.py")

TINY = [
    "--vocab-size",
    "256",
    "--hidden-size",
    "64",
    "--intermediate-size",
    "176",
    "--num-hidden-layers",
    "2",
    "--num-attention-heads",
    "4",
    "--num-key-value-heads",
    "2",
    "--seq",
    "32",
]


def test_flops_per_token_counts_matmul_parameters_and_attention_as_torchtitan():
    from models.llama_pipe import flops_per_token, model_parameters
    from models.tiny import tiny_config

    for tied in (False, True):
        config = tiny_config(tie_word_embeddings=tied)
        (six_n, attn), total = flops_per_token(config, seq=128), model_parameters(config)
        embed = config.vocab_size * config.hidden_size
        # Every parameter but the input embedding, plus the LM head's matmul (a tied head shares the
        # embedding's weights).
        assert six_n == 6 * (total - embed + (embed if tied else 0))
        # torchtitan's 12 L H Q T: no discount for the causal mask
        assert attn == 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * 128
    windowed = tiny_config("mistral", sliding_window=32)  # every layer attends to 32 of the 128 tokens
    assert flops_per_token(windowed, seq=128)[1] == 12 * windowed.num_hidden_layers * windowed.hidden_size * 32


def test_ratios_pair_the_runs_of_each_round():
    run = lambda *steps: {"tokens": 100, "step_s": list(steps)}  # noqa: E731
    results = {
        "a": [run(1.0, 1.0), run(2.0, 2.0)],
        "b": [run(1.0), run(4.0)],
        "e": [run(2.0), run(2.0)],
        "c": [run(1.0), run(1.25)],
        "d": [run(1.0), run(1.0)],
    }
    rows = {
        case: (ref, per_round, ideal, target)
        for case, ref, per_round, ideal, target in bench_train.ratio_rows(results, micro=8)
    }
    assert rows["b"] == ("a", [1.0, 0.5], 1.0, 0.95)
    ref, per_round, ideal, target = rows["c"]
    assert (
        ref == "e"
        and per_round == [2.0, 1.6]
        and ideal == pytest.approx(16 / 9)
        and target == pytest.approx(0.9 * 16 / 9)
    )
    assert rows["d"] == ("e", [2.0, 2.0], 2.0, 1.8)


def test_case_args_apply_to_their_case_only():
    args = ["optim.lr=1e-4", "c:partition_method=compute", "b,e:ds=zero0"]
    assert bench_train.case_args(args, "c") == ["optim.lr=1e-4", "partition_method=compute"]
    assert bench_train.case_args(args, "e") == ["optim.lr=1e-4", "ds=zero0"]
    assert bench_train.case_args(args, "d") == ["optim.lr=1e-4"]


@pytest.mark.e2e
def test_bench_train_plain_case_end_to_end(tmp_path):
    """The matmul peak and the plain loop (a) through the script's own loop and table (the train.py cases
    launch DeepSpeed, tens of seconds each: run the script itself for those); its last step traced
    (--plain-trace-step) where train.py's profile_steps writes a trace, and read back as one."""
    proc = run_script(
        [
            "benchmarks/bench_train.py",
            *TINY,
            "--cases",
            "a",
            "--rounds",
            "1",
            "--steps",
            "1",
            "--micro-batches",
            "2",
            "--max-wait",
            "0",
            "--plain-trace-step",
            "2",
            "--work",
            str(tmp_path),
        ],
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| a | plain HF loop"))
    assert float(row.split("|")[6]) > 0  # tokens/s
    assert "matmul peak (float32" in proc.stdout
    from training.observation.timeline import read_run

    (trace,) = read_run(str(tmp_path / "run_a" / "out"))
    assert list(trace.steps) == [2] and trace.clock == "host"  # on CPU no kernels: nothing more to read


@pytest.mark.e2e
def test_bench_convert_end_to_end(tmp_path):
    """Both directions at a tiny size: every table row is there and the memory target is met."""
    work = tmp_path / "bench"
    proc = run_script(
        [
            "benchmarks/bench_convert.py",
            "--layers",
            "1",
            "--hidden",
            "64",
            "--vocab",
            "256",
            "--repeats",
            "1",
            "--work",
            str(work),
        ],
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 1 |")]
    assert len(rows) == 2 and "HF -> stages" in rows[0] and "stages -> HF" in rows[1]
    assert all(row.rstrip(" |").endswith("met") for row in rows)  # memory target (speed at this size is start-up)
    assert not work.exists()  # the big files are deleted at the end


def test_bench_load_reads_train_py_load_report():
    line = (
        "[train] rank 1: stage 1 specs 5..10 (6 specs, 17.04 M params) | loaded 65.0 MiB from 6 layer files in 0.10 s "
        "| peak RSS at load 441 MiB (before building the stage 372 MiB, stage parameters 65 MiB)"
    )
    assert bench_load.REPORT.search(line).groups() == ("1", "1", "17.04", "441", "372", "65")


@pytest.mark.e2e
def test_bench_convert_read_paths(tmp_path, tiny_hf):
    """--read-paths: the export's pread path, the mapping and a raw copy, each timed, on a real checkpoint."""
    from models.files.hf_convert import hf_to_stages

    hf_to_stages(tiny_hf, str(tmp_path / "ckpt"))
    proc = run_script(
        [
            "benchmarks/bench_convert.py",
            "--read-paths",
            str(tmp_path / "ckpt" / "global_step0"),
            "--repeats",
            "1",
            "--work",
            str(tmp_path / "work"),
        ],
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| raw copy", "| export"))]
    assert len(rows) == 3 and all(float(r.split("|")[4]) > 0 for r in rows), proc.stdout


def final_run(run_dir, peaks: list[dict] | None, states: list[dict] | None = None) -> str:
    """An output_dir whose metrics.jsonl ends with train.py's final figures (none: a run that did not finish)."""
    from training.observation.metrics import write_final_record

    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1}) + "\n")
    if peaks is not None:
        states_figures = {"model_states_mib": states} if states else {}
        write_final_record(str(run_dir), 1, {"peak_memory_mib": peaks, **states_figures})
    return str(run_dir)


def test_peak_memory_is_read_from_train_py_s_final_figures_gpu_first(tmp_path):
    gpu = final_run(tmp_path / "gpu", [{"host": 568.0, "gpu": 9120.0}, {"host": 570.0, "gpu": 9312.0}])
    assert bench_train.peak_memory_mib(gpu) == 9312
    assert bench_train.peak_memory_mib(final_run(tmp_path / "cpu", [{"host": 568.0}, {"host": 575.0}])) == 575
    assert bench_train.peak_memory_mib(final_run(tmp_path / "unfinished", None)) is None


def test_bench_runs_read_train_py_s_final_figures(tmp_path):
    """benchmarks/harness.py's reading of train.py's final figures (metrics.jsonl's last record, as its last lines
    print them), for benchmarks/bench_lora.py and benchmarks/bench_layouts.py (the runs themselves launch DeepSpeed: run
    the scripts for those, minutes)."""
    from benchmarks.harness import final_figures

    states = [{"weights": 72.3, "grads": 0.0, "optimizer": 8.6, "total": 80.904}] * 2
    gpu = final_run(tmp_path / "gpu", [{"host": 955.4, "gpu": 9120.2}, {"host": 938.0, "gpu": 9312.0}], states)
    host = final_run(tmp_path / "host", [{"host": 955.4}, {"host": 938.0}], states)
    assert final_figures(gpu)["states"] == [80.9, 80.9]
    assert final_figures(gpu)["peak"] == [9120, 9312] and final_figures(gpu)["peak_kind"] == "GPU"
    assert final_figures(host)["peak"] == [955, 938] and final_figures(host)["peak_kind"] == "host RSS"


def test_bench_layouts_refuses_a_layout_the_ranks_cannot_hold():
    bench_layouts = load_entry_point("benchmarks/bench_layouts.py")
    args = bench_layouts.parse_args(["--gpus", "4", "--layouts", "4x1,2x2,1x1"])
    assert bench_layouts.layouts(args) == [(4, 1, 1), (2, 2, 1), (1, 1, 4)]
    for bad in ("3x1", "2x", "1x1"):  # 3 stages on 4 ranks; no tp; dp 4 does not divide a global batch of 6
        argv = ["--gpus", "4", "--layouts", bad] + (["--global-batch", "6"] if bad == "1x1" else [])
        with pytest.raises(SystemExit, match="bench_layouts.py: error: --layouts"):
            bench_layouts.layouts(bench_layouts.parse_args(argv))


def test_bench_prepare_writes_a_prepared_directory_a_run_accepts(tmp_path):
    """The start-up benchmark's synthetic corpus is what data/prepare.py writes: train.py's reader takes it."""
    from data.cache import DataSettings, TokenBlocks, build_or_reuse

    bench_prepare = load_entry_point("benchmarks/bench_prepare.py")
    out = str(tmp_path / "prepared")
    bench_prepare.synthetic_prepared(out, tokens=64 * bench_prepare.SEQ, vocab=512)
    s = DataSettings(
        format="tokens", max_seq_length=bench_prepare.SEQ, packing=False, skip_bad_lines=False, pad_id=0, vocab_size=512
    )
    entry, meta = build_or_reuse(out, s, None, str(tmp_path / "cache"), print)
    rows = TokenBlocks(entry)
    assert len(rows) == meta["num_samples"] == 64 and rows[0]["position_ids"].tolist() == list(range(bench_prepare.SEQ))
    assert rows.total_tokens() == 64 * bench_prepare.SEQ


def test_bench_padding_writes_long_tailed_sft_pairs(tmp_path):
    bench_padding = load_entry_point("benchmarks/bench_padding.py")
    path = tmp_path / "chat.jsonl"
    bench_padding.write_chat_sft(str(path), 400, median_words=60)
    import json
    import statistics

    words = [len((r["prompt"] + " " + r["response"]).split()) for r in map(json.loads, path.read_text().splitlines())]
    assert 45 <= statistics.median(words) <= 75 and max(words) > 5 * 60 and min(words) < 30  # a long tail both ways


def test_bench_attention_measures_both_attentions_on_one_layer():
    """benchmarks/bench_attention.py's case, in this process at a tiny size (the script runs each in a fresh one)."""
    bench_attention = load_entry_point("benchmarks/bench_attention.py")
    spec = dict(seq=256, doc=64, window=0, hidden=32, heads=4, dtype="fp32", repeats=1, device="cpu")
    for attention in ("dense_mask", "documents"):
        for window in (0, 48):
            r = bench_attention.run_case(dict(spec, attention=attention, window=window))
            assert r["s"] > 0 and isinstance(r["peak_mib"], float)  # in this process the RSS peak is a past one


def test_bench_long_context_packs_its_documents_into_whole_rows(tmp_path):
    bench_long_context = load_entry_point("benchmarks/bench_long_context.py")
    path = str(tmp_path / "docs.jsonl")
    bench_long_context.write_documents(path, rows=3, seq=512, doc=128, vocab_size=100)
    lines = open(path).read().splitlines()
    assert len(lines) == 12 and all(len(json.loads(x)["input_ids"]) == 128 for x in lines)
    args = bench_long_context.parse_args([])
    assert (args.seqs, args.sps, args.gpus, args.global_batch) == ("4096,8192,16384", "1,2,4", 4, 4)


def test_bench_schedule_counts_the_drain_inside_the_optimizer_step_as_bubble(tmp_path):
    """Two ranks' instruction timings (benchmarks/harness.profile_rank's format): rank 1 finishes its backward
    passes early and waits 0.2 s inside the optimizer step (the gradient norm crosses the stages). That wait is
    bubble; the optimizer step's own 0.1 s is not."""
    bench = load_entry_point("benchmarks/bench_schedule.py")
    step = {"train_batch": [1, 2.0, 0], "_exec_optimizer_step": [1, 0.1, 0], "_exec_weight_pass": [2, 0.2, 0]}
    ranks = [
        {**step, "_exec_forward_pass": [8, 0.6, 0], "_exec_backward_pass": [8, 1.1, 0]},  # 1.9 s computing
        {
            **step,
            "_exec_forward_pass": [8, 0.5, 0],
            "_exec_backward_pass": [8, 0.9, 0],
            "_exec_optimizer_step": [1, 0.3, 0],
        },
    ]
    for rank, rec in enumerate(ranks):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps([rec, rec]))
    measured = bench.bubble(str(tmp_path), warmup=1)
    # pipelined: 2.0 - 0.1 = 1.9 s; rank 0 computes 1.9 (idle 0), rank 1 1.6 (idle 0.3 / 1.9)
    assert measured["bubble"] == pytest.approx(0.3 / 1.9 / 2)
    assert measured["forward"] == pytest.approx(1.1 / 16) and measured["weight"] == pytest.approx(0.1)


def test_bench_dpo_gives_sft_the_same_texts_as_rows(tmp_path):
    """benchmarks/bench_dpo.py: each pair's chosen and rejected completion, in order, are the SFT rows."""
    bench_dpo = load_entry_point("benchmarks/bench_dpo.py")
    args = bench_dpo.parse_args(["--micro-batch", "2", "--completion-words", "3", "5"])
    pairs, sft = tmp_path / "pairs.jsonl", tmp_path / "sft.jsonl"
    bench_dpo.write_texts(args, str(pairs), str(sft), 6)
    pair_rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    sft_rows = [json.loads(line) for line in sft.read_text().splitlines()]
    assert len(pair_rows) == 6 and len(sft_rows) == 12 and args.micro_batch == 2
    for i, p in enumerate(pair_rows):
        assert sft_rows[2 * i] == {"prompt": p["prompt"], "response": p["chosen"]}
        assert sft_rows[2 * i + 1] == {"prompt": p["prompt"], "response": p["rejected"]}
        assert 3 <= len(p["chosen"].split()) <= 5 and len(p["prompt"].split()) == args.prompt_words


@pytest.fixture()
def bench_main(tmp_path, monkeypatch, capsys):
    """``bench_main(script, argv)``: a benchmark script's ``main(argv)`` in this process, its stdout returned (a failed
    run raises SystemExit with its output). Its train.py launches and its workers (benchmarks/harness.py's
    ``run_ranks`` and ``run_python``) are forked from the session's fork server instead of started by the real
    ``deepspeed`` command and a fresh interpreter: the smoke tests check the script's own work, not its figures, and
    a launch takes seconds instead of 15."""
    from benchmarks import harness

    def forked(ranks: int, script: str, args: list[str]):
        return run_deepspeed(ranks, script, args, str(tmp_path / f"launch{len(list(tmp_path.glob('launch*')))}.log"))

    monkeypatch.setattr(harness, "run_ranks", forked)
    monkeypatch.setattr(harness, "run_python", run_script)

    def run(script: str, argv: list[str]) -> str:
        load_entry_point(script).main(argv)
        return capsys.readouterr().out

    return run


@pytest.mark.multirank  # the script launches train.py twice on 2 CPU ranks
def test_bench_moe_quick_halves_the_experts_per_rank(tmp_path, bench_main):
    """benchmarks/bench_moe.py --quick: a tiny Qwen3-MoE on data 2 with expert_parallel 1 and 2; one table row each, a
    rank of the second holding half the experts (train.py's own ``experts:`` line) and fewer model-state bytes, and the
    same loss (the same model and batches)."""
    stdout = bench_main("benchmarks/bench_moe.py", ["--quick", "--work-dir", str(tmp_path)])
    header = next(line for line in stdout.splitlines() if line.startswith("| expert_parallel |"))
    rows = {int(r.split("|")[1]): r.split("|")[1:-1] for r in stdout.splitlines() if r.startswith(("| 1 |", "| 2 |"))}
    assert sorted(rows) == [1, 2] and all(len(r) == header.count("|") - 1 for r in rows.values()), stdout
    experts = {ep: float(r[4].split(" M")[0]) for ep, r in rows.items()}  # every rank the same: the figure once
    assert experts[2] == pytest.approx(experts[1] / 2, abs=0.01), stdout
    states = {ep: max(float(v) for v in r[5].split(",")) for ep, r in rows.items()}
    assert states[2] < states[1] and all(float(r[1]) > 0 for r in rows.values())  # s/step
    assert float(rows[1][3]) == 0 < float(rows[2][3])  # time in all-to-alls: none without expert parallelism
    assert rows[1][-1] == rows[2][-1]  # last loss


def test_bench_hf_start_save_figures_take_the_slowest_rank_and_the_gap_without_a_save():
    """benchmarks/bench_hf_start.py --save's arithmetic: per save the slowest rank's gap after the saving step less the
    median gap after a step without a save; the step after a save against the others (from step 3: step 1 compiles
    nothing here but starts everything)."""
    bench = load_entry_point("benchmarks/bench_hf_start.py")
    # two ranks, 6 steps of 1 s; gaps 0.1 s except after steps 2 (rank 1: 2.1 s) and 4 (rank 0: 1.1 s)
    gaps = {0: [0.1, 0.5, 0.1, 1.1, 0.1], 1: [0.1, 2.1, 0.1, 0.3, 0.1]}
    steps = []
    for rank in (0, 1):
        t, rows = 0.0, []
        for k in range(6):
            took = 1.5 if k == 2 and rank == 1 else 1.0  # step 3 (after the save at 2) slower on rank 1
            rows.append((t, t + took))
            t += took + (gaps[rank][k] if k < 5 else 0.0)
        steps.append(rows)
    figures = bench.save_figures({"steps": steps, "saves": [2, 4]})
    assert figures["stopped"] == pytest.approx([2.0, 1.0])  # 2.1 - 0.1 and 1.1 - 0.1
    assert figures["after"] == pytest.approx(1.25)  # steps 3 (1.5 s) and 5 (1.0 s)
    assert figures["others"] == pytest.approx(1.0)


@pytest.mark.multirank  # train.py twice on 2 CPU ranks
def test_bench_hf_start_save_quick_measures_both_ways_of_saving(tmp_path, bench_main):
    argv = ["--save", "--quick", "--save-steps-total", "5", "--work-dir", str(tmp_path)]
    stdout = bench_main("benchmarks/bench_hf_start.py", argv)
    lines = [r for r in stdout.splitlines() if r.startswith(("| at once", "| in the background"))]
    rows = {r.split("|")[1].strip(): r.split("|")[2:-1] for r in lines}
    assert sorted(rows) == ["at once (save_async=false)", "in the background (save_async=true)"], stdout
    for row in rows.values():
        assert float(row[0]) > 0 and len(row[1].split("(")[1].split(",")) == 2  # MiB; saves at steps 2 and 4
        assert len(row[4].split(",")) == 2  # peak RSS of each of the 2 ranks


def test_bench_grpo_figures_count_the_completions_real_tokens():
    """benchmarks/bench_grpo.py's arithmetic: generated tokens are the mean length x the step's completions, over the
    generation seconds; the medians are per step."""
    bench = load_entry_point("benchmarks/bench_grpo.py")
    steps = [
        {"step_s": 1.0, "generation_s": 0.5, "completions/mean_length": 16.0},
        {"step_s": 2.0, "generation_s": 0.25, "completions/mean_length": 15.0},
        {"step_s": 3.0, "generation_s": 1.0, "completions/mean_length": 16.0},
    ]
    figures = bench.step_figures(steps, rows=8)
    assert figures["step_s"] == 2.0 and figures["generation_s"] == 0.5 and figures["length"] == 16.0
    assert figures["tokens_s"] == pytest.approx(256.0)  # per step 256, 480, 128 tokens/s
    assert figures["ms_per_token"] == pytest.approx(1e3 / 256)


@pytest.mark.multirank  # train.py once on 4 CPU ranks and TRL once
def test_bench_grpo_quick_compares_the_pipeline_with_trl(tmp_path, bench_main):
    """benchmarks/bench_grpo.py --quick: one row for the pipeline and one for TRL, generation tokens/s and step time
    above 0, completions of at most their limit, and the cost row of that completion length."""
    stdout = bench_main("benchmarks/bench_grpo.py", ["--quick", "--work-dir", str(tmp_path)])
    lines = stdout.splitlines()
    setups = [r.split("|")[1:-1] for r in lines if r.startswith(("| train.py, pipe 2 x data 2 |", "| TRL generate |"))]
    assert len(setups) == 2, stdout
    for row in setups:
        assert float(row[1]) > 0 and float(row[3]) > 0 and 0 < float(row[4]) <= 8, stdout
    assert len(setups[0][5].split(",")) in (1, 4) and len(setups[1][5].split(",")) == 1  # per rank (once if equal)
    costs = {int(r.split("|")[1]): r.split("|")[2:-1] for r in lines if r.startswith("| 8 |")}
    assert sorted(costs) == [8] and all(0 < float(c[0]) <= n and float(c[2]) > 0 for n, c in costs.items())


def test_fp8_cases_are_bc_with_the_recipe_against_bc():
    """bc8r and bc8t are bc (compile=true) plus fp8=rowwise / fp8=tensorwise, and their ratio row asks 1.2 x bc."""
    for case, recipe in (("bc8r", "rowwise"), ("bc8t", "tensorwise")):
        _, ranks, stages, threads, extra = bench_train.CASES[case]
        assert (ranks, stages, threads) == bench_train.CASES["bc"][1:4]
        assert extra == bench_train.CASES["bc"][4] + [f"fp8={recipe}"]
        assert bench_train.RATIOS[case] == ("bc", 1.2, 1.0)
    run = lambda step: {"tokens": 100, "step_s": [step]}  # noqa: E731
    rows = {r[0]: r for r in bench_train.ratio_rows({"bc": [run(1.2)], "bc8r": [run(1.0)]}, micro=2)}
    assert rows["bc8r"][2] == [pytest.approx(1.2)] and rows["bc8r"][4] == pytest.approx(1.2)
