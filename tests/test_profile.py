"""profile_steps: per-rank torch.profiler traces with every pipeline instruction a named range
(training/observation/profiling.py), read back and drawn one step at a time (training/observation/timeline.py,
scripts/plot_timeline.py).

Fast tier: the timeline and bubble of a small synthetic two-rank trace, computed by hand (the ranks' clocks
aligned on their base times, or on their steps; a GPU trace's device ranges preferred); each wrong input named by
the script; every engine instruction has a kind; the micro-batch each range names agrees with the buffer the
1F1B and zero-bubble DualPipeV schedules give it; the instrumentation undone leaves the engines as they were;
the validation of profile_steps, all problems at once.

Multi-rank: pipe 2, 1F1B, 4 micro-batches, 3 steps, profile_steps=[2,3]: both ranks' traces hold the steps, the
schedule and every instruction of both steps with its micro-batch; on the common clock each micro-batch's
forward on rank 1 starts after rank 0's ends and its backward on rank 0 after rank 1's (so the clocks are
aligned); plot_timeline.py draws a PNG and prints each rank's bubble. DualPipeV's profile rides on the pipe 4
run of tests/test_dualpipev.py (:func:`check_profiled_run`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.schedule import TrainSchedule

from models.tiny import write_random_tokens
from parallel.dualpipev import LlamaDualPipeVEngine, ZeroBubbleDualPipeVSchedule
from tests.support.ranks import train_run
from tests.support.scripts import load_entry_point, run_script
from tests.test_config import good, problems_of  # noqa: F401 (a fixture)
from training.configuration.validate import resolve
from training.observation.profiling import InstructionNames, engine_instructions, instrument
from training.observation.timeline import INSTRUCTION_KINDS, TraceError, read_run, step_timeline

BASE_NS = 1_790_000_000_000_000_000


def write_trace(path, base_ns: int, ranges: list[tuple], cat: str = "user_annotation") -> None:
    """A Chrome trace as torch.profiler exports it: ``ranges`` of (name, start µs, end µs) on ``base_ns``'s clock
    (a 4-tuple's last item: its category), beside an op event and a metadata event that must be ignored."""
    events = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "ts": 0, "args": {"name": "python"}}]
    for name, start, end, *category in ranges:
        events.append(
            dict(ph="X", cat=category[0] if category else cat, name=name, pid=1, tid=1, ts=start, dur=end - start)
        )
    events.append(dict(ph="X", cat="cpu_op", name="ForwardPass mb=9", pid=1, tid=1, ts=11.0, dur=1.0))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"schemaVersion": 1, "baseTimeNanoseconds": base_ns, "traceEvents": events}, f)


# Two ranks of a 1F1B step, in microseconds on rank 0's clock; rank 1's trace starts 5 µs later (its base).
RANK0 = [
    ("train step 2", -200, -120),
    ("ForwardPass mb=0", -190, -150),
    ("train step 3", 0, 100),
    ("TrainSchedule", 5, 95),
    ("ForwardPass mb=0", 10, 30),
    ("SendActivation mb=0", 30, 35),
    ("RecvGrad mb=0", 35, 60),
    ("BackwardPass mb=0", 60, 80),
    ("OptimizerStep", 80, 90),
    ("ForwardPass mb=0", 150, 160),  # after the step (an eval pass): not in the step
]
RANK1 = [
    ("train step 2", -195, -110),
    ("ForwardPass mb=0", -150, -130),
    ("train step 3", 5, 105),
    ("RecvActivation mb=0", 12, 32),
    ("ForwardPass mb=0", 32, 45),
    ("BackwardPass mb=0", 45, 55),
    ("SendGrad mb=0", 55, 60),
    ("OptimizerStep", 85, 95),
]


def synthetic_run(root, rank1_shift_us: float = 5.0) -> str:
    """A run directory with the two ranks' traces (rank 1's base ``rank1_shift_us`` after rank 0's)."""
    shift_ns = int(rank1_shift_us * 1000)
    write_trace(os.path.join(root, "profile", "rank0.pt.trace.json"), BASE_NS, RANK0)
    rank1 = [(n, s - rank1_shift_us, e - rank1_shift_us) for n, s, e in RANK1]  # on its own clock
    write_trace(os.path.join(root, "profile", "rank1.pt.trace.json"), BASE_NS + shift_ns, rank1)
    return str(root)


def test_a_step_s_bubble_per_rank_and_overall(tmp_path):
    timeline = step_timeline(read_run(synthetic_run(tmp_path)))  # the last step both ranks profiled
    assert timeline.step == 3 and timeline.clock == "host" and timeline.schedule == "TrainSchedule"
    # from rank 0's first instruction (10) to rank 1's last (95): rank 1's clock is 5 µs behind rank 0's
    assert (timeline.start, timeline.end, timeline.window) == (10, 95, 85)
    r0, r1 = timeline.ranks
    assert [b.name for b in r0.boxes] == [n for n, s, e in RANK0[4:9]]
    assert [b.kind for b in r1.boxes] == ["send/recv", "forward", "backward", "send/recv", "optimizer"]
    # rank 0 computes 20 + 20 + 10, waits 5 + 25, and 5 more between its last box and the step's end
    assert (r0.busy, r0.waiting) == (50, 30) and r0.bubble(85) == pytest.approx(35 / 85)
    assert (r1.busy, r1.waiting) == (33, 25) and r1.bubble(85) == pytest.approx(52 / 85)
    assert timeline.bubble == pytest.approx((35 + 52) / 170)
    assert timeline.report() == [
        "rank 0: bubble 41.2% of the step (waiting in send/recv 35.3%, between instructions 5.9%); 5 instructions",
        "rank 1: bubble 61.2% of the step (waiting in send/recv 29.4%, between instructions 31.8%); 5 instructions",
        "step 3 (TrainSchedule, 2 ranks, host clock): 0.1 ms from the first instruction to the last, bubble 51.2% "
        "overall",
    ]
    earlier = step_timeline(read_run(str(tmp_path)), step=2)
    assert [len(r.boxes) for r in earlier.ranks] == [1, 1] and (earlier.start, earlier.end) == (-190, -130)


def test_ranks_aligned_on_their_steps(tmp_path):
    timeline = step_timeline(read_run(synthetic_run(tmp_path)), align="step")
    # each rank's step starts at 0: rank 1's boxes 5 µs earlier than on the clock
    assert timeline.ranks[1].boxes[0].start == 7 and (timeline.start, timeline.end) == (7, 90)


def test_a_gpu_trace_s_device_ranges_are_preferred(tmp_path):
    """As a GPU trace reads (seen on an H200): the device range of each instruction that launched kernels
    (gpu_user_annotation) carries the External id of its host range; steps exist on the host only, and step 1's
    kernels may run after step 2's host range began."""
    host = [("train step 1", 0, 50, 1), ("ForwardPass mb=0", 1, 2, 2), ("SendActivation mb=0", 2, 3, 3)]
    host += [("OptimizerStep", 3, 4, 4), ("train step 2", 60, 90, 5), ("ForwardPass mb=0", 61, 62, 6)]
    device = [("ForwardPass mb=0", 10, 40, 2), ("OptimizerStep", 70, 75, 4), ("ForwardPass mb=0", 80, 95, 6)]
    events = [
        dict(ph="X", cat="user_annotation", name=n, ts=s, dur=e - s, args={"External id": x}) for n, s, e, x in host
    ]
    events += [
        dict(ph="X", cat="gpu_user_annotation", name=n, ts=s, dur=e - s, args={"External id": x})
        for n, s, e, x in device
    ]
    os.makedirs(tmp_path / "profile")
    (tmp_path / "profile" / "rank0.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    timeline = step_timeline(read_run(str(tmp_path)), step=1)
    assert timeline.clock == "device" and [(b.name, b.start, b.end) for b in timeline.ranks[0].boxes] == [
        ("ForwardPass mb=0", 10, 40),
        ("OptimizerStep", 70, 75),
    ]
    assert timeline.window == 65 and timeline.ranks[0].bubble(65) == pytest.approx(30 / 65)


def gpu_step_events() -> list[dict]:
    """Two steps of a GPU trace: host ranges, Kineto's device ranges, the launches (runtime calls) and kernels."""
    host = [("train step 1", 0, 50, 1), ("ForwardPass mb=0", 1, 10, 2), ("BackwardPass mb=0", 10, 40, 3)]
    host += [("OptimizerStep", 40, 48, 4), ("train step 2", 60, 90, 5), ("ForwardPass mb=0", 61, 70, 6)]
    events = [
        dict(ph="X", cat="user_annotation", name=n, ts=s, dur=e - s, args={"External id": x}) for n, s, e, x in host
    ]
    events += [
        dict(ph="X", cat="gpu_user_annotation", name=n, ts=s, dur=d, args={"External id": x})
        for n, s, d, x in (("ForwardPass mb=0", 10, 40, 2), ("BackwardPass mb=0", 50, 1, 3))
    ]
    launches = [(2, 1, 1), (3, 2, 1), (12, 3, 2), (14, 4, 2), (16, 5, 2), (18, 6, 2), (42, 8, 1), (65, 7, 1)]
    events += [  # (host µs, correlation id, thread): 2 is autograd's
        dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=t, dur=1, tid=tid, args={"correlation": c})
        for t, c, tid in launches
    ]
    # the optimizer's host range waits 20 µs for the device (a .item()), on the main thread
    events.append(dict(ph="X", cat="cuda_runtime", name="cudaStreamSynchronize", ts=44, dur=20, tid=1, args={}))
    kernels = [  # (category, name, start, end, correlation)
        ("kernel", "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", 10, 40, 1),
        ("kernel", "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>(Flash_fwd_params)", 40, 50, 2),
        ("kernel", "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", 50, 70, 3),
        ("kernel", "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", 75, 80, 4),
        ("kernel", "void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor>(int)", 80, 85, 5),
        ("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 90, 100, 6),
        ("kernel", "void multi_tensor_apply_kernel<FusedAdamMathFunctor>(int)", 100, 110, 8),
        ("kernel", "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", 110, 130, 7),  # step 2's, launched at 65
    ]
    events += [dict(ph="X", cat=cat, name=n, ts=s, dur=e - s, args={"correlation": c}) for cat, n, s, e, c in kernels]
    return events


def test_a_gpu_step_s_instructions_and_kernel_time_come_from_the_kernels_they_launched(tmp_path):
    """As a GPU trace reads (seen on an H200): a kernel belongs to the host range its launch (the runtime call of the
    same correlation id) falls in, also when autograd's backward launches it from another thread, which Kineto's
    gpu_user_annotation ranges miss (here the backward's is 1 µs long), and when it runs after the next step's host
    range began. Each instruction's box spans its kernels; a step's kernel time is summed by kind, and the GPU's
    idle share is the span no kernel covers."""
    events = gpu_step_events()
    os.makedirs(tmp_path / "profile")
    (tmp_path / "profile" / "rank0.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    timeline = step_timeline(read_run(str(tmp_path)), step=1)
    assert timeline.clock == "device"
    assert [(b.name, b.start, b.end) for b in timeline.ranks[0].boxes] == [
        ("ForwardPass mb=0", 10, 50),
        ("BackwardPass mb=0", 50, 100),
        ("OptimizerStep", 100, 110),
    ]
    assert timeline.window == 100 and timeline.ranks[0].bubble(100) == 0
    k = timeline.kernels[0]
    assert (k.span, k.busy) == (100, 90)  # 10..110, idle 70..75 and 85..90
    assert k.by_kind == {
        "matmul": 50,
        "attention": 10,
        "Triton (compiled, Liger)": 5,
        "elementwise/reduction": 5,
        "memory copies": 10,
        "optimizer": 10,
    }
    assert k.top[0] == ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", "matmul", 50, 2)
    lines = timeline.report()
    assert lines[2] == (
        "rank 0 GPU, step 1: 0.1 ms from its first kernel to its last, busy 90.0% (idle 10.0%: waiting for the host); "
        "kernel time by kind: matmul 55.6%, attention 11.1%, memory copies 11.1%, optimizer 11.1%, Triton (compiled, "
        "Liger) 5.6%, elementwise/reduction 5.6%"
    )
    assert len(lines) == 3 + 6 + 1 and "x2" in lines[3] and "matmul" in lines[3]  # a line per kernel name
    assert k.host == 50 and k.calls == [("cudaStreamSynchronize", 20, 1), ("cudaLaunchKernel", 7, 1 * 7)]
    assert lines[-1].startswith("  host: the step's range 0.1 ms; CUDA API time in it (all threads): cudaStream")
    assert [line for line in lines if "Memcpy" in line][0].split()[4] == "memory"
    later = step_timeline(read_run(str(tmp_path)), step=2)
    assert [(b.name, b.start, b.end) for b in later.ranks[0].boxes] == [("ForwardPass mb=0", 110, 130)]
    assert later.kernels[0].by_kind == {"matmul": 20} and later.kernels[0].span == later.kernels[0].busy == 20


def plot(argv, capsys) -> tuple[int, str, str]:
    code = load_entry_point("scripts/plot_timeline.py").main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_plain_loop_s_gpu_trace_says_where_its_time_went_without_a_picture(tmp_path, capsys):
    """A trace with steps and kernels but no pipeline instruction (benchmarks/bench_train.py --plain-trace-step, the
    plain Hugging Face loop's): plot_timeline.py prints the kernel summary instead of failing."""
    events = [e for e in gpu_step_events() if e["cat"] not in ("user_annotation", "gpu_user_annotation")]
    events += [e for e in gpu_step_events() if e["name"].startswith("train step")]
    os.makedirs(tmp_path / "profile")
    (tmp_path / "profile" / "rank0.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    code, out, err = plot([tmp_path, "--step", 1], capsys)
    assert code == 0, err
    assert out.startswith("no picture (") and "rank 0 GPU, step 1: 0.1 ms from its first kernel" in out
    code, out, err = plot([tmp_path, "--step", 3], capsys)  # not profiled: the error stands
    assert code == 1 and "step 3 is not profiled" in err


def test_plot_timeline_draws_the_synthetic_step(tmp_path, capsys):
    code, out, err = plot([synthetic_run(tmp_path), "--out", tmp_path / "t.png"], capsys)
    assert code == 0, err
    assert "rank 1: bubble 61.2% of the step" in out and "bubble 51.2% overall" in out
    with open(tmp_path / "t.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_wrong_inputs_are_named(tmp_path, capsys):
    def error_of(*argv) -> str:
        code, out, err = plot(argv, capsys)
        assert code == 1 and out == "", (out, err)
        return err.removeprefix("plot_timeline.py: error: ").strip()

    assert "is not a directory" in error_of(tmp_path / "nowhere")
    assert error_of(tmp_path).startswith(f"{tmp_path}/profile does not exist: profile a run with profile_steps=")
    run = synthetic_run(tmp_path / "run")
    assert "step 7 is not profiled on every rank: rank 0 has steps [2, 3]; rank 1 has steps [2, 3]" in error_of(
        run, "--step", "7"
    )
    os.remove(os.path.join(run, "profile", "rank1.pt.trace.json"))
    os.rename(os.path.join(run, "profile", "rank0.pt.trace.json"), os.path.join(run, "profile", "rank2.pt.trace.json"))
    assert "lacks the traces of rank(s) [0, 1] (it has ranks [2])" in error_of(run)
    os.remove(os.path.join(run, "profile", "rank2.pt.trace.json"))
    (tmp_path / "run" / "profile" / "rank0.pt.trace.json").write_text('{"traceEvents": [')
    assert "rank0.pt.trace.json is not readable JSON" in error_of(run)
    # a data-parallel run's trace (num_stages=1): steps but no instruction
    write_trace(str(tmp_path / "dp" / "profile" / "rank0.pt.trace.json"), BASE_NS, [("train step 1", 0, 9)])
    assert "step 1 has no pipeline instruction: the run did not use a pipeline engine" in error_of(tmp_path / "dp")


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"traceEvents": [', "is not readable JSON"),
        ('{"events": []}', "has no traceEvents list: not a Chrome trace"),
        ('{"traceEvents": []}', "has no 'train step N' range: not a trace train.py's profile_steps wrote"),
        ('{"traceEvents": [{"ph": "X", "cat": "user_annotation", "name": "train step 1", "ts": "a"}]}', "no numeric"),
    ],
)
def test_a_broken_trace_is_named(tmp_path, text, message):
    os.makedirs(tmp_path / "profile")
    (tmp_path / "profile" / "rank0.pt.trace.json").write_text(text)
    with pytest.raises(TraceError, match=re.escape(message)):
        read_run(str(tmp_path))


def test_every_engine_instruction_has_a_kind():
    assert set(engine_instructions().values()) == set(INSTRUCTION_KINDS)


def names_of(schedule) -> list[tuple]:
    """(instruction, its kwargs, the range name) of every instruction ``schedule`` yields, named as they run."""
    names = InstructionNames()
    return [(cmd.name, cmd.kwargs, names(cmd.name, cmd.kwargs)) for cmds in schedule.steps() for cmd in cmds]


@pytest.mark.parametrize("stages, micro_batches", [(2, 4), (2, 8), (4, 8)])
def test_ranges_name_the_micro_batch_the_schedules_give(stages, micro_batches):
    for stage in range(stages):
        sched = TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage)
        for instruction, kwargs, name in names_of(sched):
            if "buffer_id" in kwargs:  # 1F1B's buffers are micro-batch ids modulo the buffers it reserves
                micro = int(re.search(r"mb=(\d+)", name).group(1))
                assert micro % sched.num_pipe_buffers() == kwargs["buffer_id"], (stage, name, kwargs)
        sched = ZeroBubbleDualPipeVSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage)
        deferred, weights = [], []
        for instruction, kwargs, name in names_of(sched):
            if "buffer_id" in kwargs:  # DualPipeV's: phase x micro-batches + micro-batch
                micro = int(re.search(r"mb=(\d+)", name).group(1))
                assert kwargs.get("phase", 0) * micro_batches + micro == kwargs["buffer_id"], (stage, name)
                if kwargs.get("defer_weights"):
                    assert name.endswith("inputs-only")
                    deferred.append(name.removeprefix("BackwardPass ").removesuffix(" inputs-only"))
            elif instruction == "WeightPass":
                weights.append(name.removeprefix("WeightPass "))
        assert weights == deferred and weights, (stage, weights, deferred)


def test_undoing_the_instrumentation_leaves_the_engines_as_they_were():
    maps = [dict(cls._INSTRUCTION_MAP) for cls in LlamaDualPipeVEngine.__mro__ if "_INSTRUCTION_MAP" in vars(cls)]
    schedule = PipelineEngine._exec_schedule
    undo = instrument()
    try:
        wrapped = [dict(c._INSTRUCTION_MAP) for c in LlamaDualPipeVEngine.__mro__ if "_INSTRUCTION_MAP" in vars(c)]
        assert all(getattr(fn, "profiler_range", False) for m in wrapped for fn in m.values())
        assert PipelineEngine._exec_schedule is not schedule
    finally:
        undo()
    assert [dict(c._INSTRUCTION_MAP) for c in LlamaDualPipeVEngine.__mro__ if "_INSTRUCTION_MAP" in vars(c)] == maps
    assert PipelineEngine._exec_schedule is schedule


def test_profile_steps_problems_are_said_together(good):  # noqa: F811
    ok = dataclasses.replace(good, max_steps=4, profile_steps=[2, 3])
    assert resolve(ok, 4).cfg.profile_steps == [2, 3] and resolve(dataclasses.replace(ok, profile_steps=[4, 4]), 4)
    text = problems_of(dataclasses.replace(ok, profile_steps=[0, 6]), 4)
    assert "profile_steps [0, 6] starts at step 0: steps count from 1, set first >= 1" in text
    assert "profile_steps [0, 6] ends after the run's last step (max_steps 4): set last <= 4, or raise" in text
    text = problems_of(dataclasses.replace(ok, profile_steps=[3, 2]), 4)
    assert "profile_steps [3, 2] descends: set [first, last] with first <= last" in text
    text = problems_of(dataclasses.replace(ok, profile_steps=[2]), 4)
    assert "profile_steps [2] must be two steps [first, last], e.g. profile_steps=[2,3] ([] = no profile)" in text
    text = problems_of(dataclasses.replace(ok, max_steps=0), 4)
    assert "profile_steps [2, 3] with max_steps=0: no step is trained; drop profile_steps" in text


# ------------------------------------------------------------------------------------------------ multi-rank


def check_profiled_run(out: str, ranks: int, steps: tuple[int, int], micro_batches: int, dualpipev: bool) -> str:
    """What every profiled run must show (the 1F1B run here, tests/test_dualpipev.py's DualPipeV run): each rank's
    trace is JSON holding the steps ``steps`` and no other, each instruction of both with its micro-batch
    (``micro_batches``), on one clock where each micro-batch's pass starts after its producer's ended;
    plot_timeline.py draws the last step and prints the bubbles. Returns the script's output."""
    first, last = steps
    traces = read_run(out)  # each rank's JSON, parsed
    assert [t.rank for t in traces] == list(range(ranks))
    schedule = "ZeroBubbleDualPipeVSchedule" if dualpipev else "TrainSchedule"
    phases = (" phase=0", " phase=1") if dualpipev else ("",)
    for t in traces:
        assert sorted(t.steps) == list(range(first, last + 1)) and schedule in t.schedules, (t.rank, t.schedules)
        names = [b.name for b in t.boxes]
        for mb in range(micro_batches):
            for phase in phases:
                forwards = names.count(f"ForwardPass mb={mb}{phase}")
                backwards = sum(names.count(f"BackwardPass mb={mb}{phase}{d}") for d in ("", " inputs-only"))
                assert forwards == backwards == last - first + 1, (t.rank, mb, phase, forwards, backwards)
        assert names.count("OptimizerStep") == names.count("ReduceGrads") == last - first + 1
        assert any(b.kind == "send/recv" for b in t.boxes), names
        if dualpipev:
            assert "CommitP2P" in names and any(n.startswith("WeightPass mb=") for n in names)
    timeline = step_timeline(traces, last)
    assert_causal(timeline, dualpipev)
    proc = run_script(["scripts/plot_timeline.py", out])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(ranks):
        assert re.search(rf"^rank {rank}: bubble \d+\.\d% of the step", proc.stdout, re.M), proc.stdout
    assert re.search(
        rf"^step {last} \(\w+Schedule, {ranks} ranks, host clock\): .* bubble \d+\.\d% overall$", proc.stdout, re.M
    )
    png = os.path.join(out, "profile", f"timeline_step{last}.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    return proc.stdout


def assert_causal(timeline, dualpipev: bool) -> None:
    """On the traces' common clock, each micro-batch's forward on a (virtual) stage starts after the previous
    stage's forward of it ended, and its backward after the next stage's backward: misaligned clocks break it."""
    ranks = len(timeline.ranks)
    stages = 2 * ranks if dualpipev else ranks
    passes = {}  # (pass, virtual stage, micro-batch) -> (start, end)
    for share in timeline.ranks:
        for box in share.boxes:
            if box.kind in ("forward", "backward"):
                stage = share.rank if not box.phase else stages - 1 - share.rank
                passes[box.kind, stage, box.micro_batch] = (box.start, box.end)
    checked = 0
    for (kind, stage, mb), (start, _) in passes.items():
        producer = (kind, stage - 1 if kind == "forward" else stage + 1, mb)
        if producer in passes:
            assert start >= passes[producer][1], (kind, stage, mb, start, passes[producer])
            checked += 1
    assert checked >= (stages - 1) * 2, passes


@pytest.fixture(scope="module")
def profiled_1f1b(tmp_path_factory, tiny_ckpt):
    root = tmp_path_factory.mktemp("profile")
    write_random_tokens(str(root / "train.jsonl"), 64, 32, vocab_size=512)
    args = {
        "model_name_or_path": tiny_ckpt,
        "output_dir": root / "run",
        "data.train_file": root / "train.jsonl",
        "data.max_seq_length": 32,
        "data.cache_dir": root / "cache",
        "num_stages": 2,
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 4,
        "max_steps": 3,
        "precision": "fp32",
        "profile_steps": "[2,3]",
        "min_free_disk_gb": 0,
    }
    proc = train_run(root, "run", 2, [f"{k}={v}" for k, v in args.items()])
    return str(root / "run"), proc.stdout + proc.stderr


@pytest.mark.multirank
def test_a_1f1b_run_profiles_its_steps_and_draws_one(profiled_1f1b):
    out, log = profiled_1f1b
    assert f"profile of steps 2..3 written per rank to {out}/profile" in log
    assert "USDT" not in log  # torch's profiler_start/stop line on every rank: filtered (training/observation/logs.py)
    report = check_profiled_run(out, ranks=2, steps=(2, 3), micro_batches=4, dualpipev=False)
    print(report)
