"""The schedule simulator (parallel/schedule_sim.py) on DeepSpeed's own instruction streams, and the memory
planner's use of it for pipeline_schedule=dualpipev."""

from __future__ import annotations

import pytest

from parallel import schedule_sim
from parallel.layout import Layout
from parallel.schedule_sim import bubble_share, instructions, simulate, simulated, uniform_times


@pytest.mark.parametrize("p, m", [(2, 4), (3, 5), (4, 8), (8, 16)])
def test_1f1b_bubble_is_the_closed_form(p, m):
    """Equal pieces: idle (p - 1) / (m + p - 1), makespan (m + p - 1)(f + b), stage s holds min(p - s, m)."""
    sim = simulate("1f1b", p, m, [1.0] * p, [2.5] * p)
    assert sim.idle_share == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert sim.makespan == pytest.approx((m + p - 1) * 3.5)
    assert sim.in_flight == tuple((min(p - s, m),) for s in range(p))
    assert bubble_share("1f1b", 2, 4) == pytest.approx(0.2) and bubble_share("1f1b", 8, 16) == pytest.approx(7 / 23)


def test_1f1b_makespan_follows_the_slowest_stage():
    """A stage twice as slow as the others sets the pace: the others wait, its own idle share is the smallest."""
    sim = simulate("1f1b", 4, 8, [1, 2, 1, 1], [2, 4, 2, 2])
    assert sim.makespan > simulate("1f1b", 4, 8, [1] * 4, [2] * 4).makespan
    assert min(range(4), key=lambda r: sim.idle[r]) == 1


def test_dualpipev_idles_less_than_1f1b():
    """p=2, equal pieces, backward twice forward: DeepSpeed's DualPipeV 1/7 of the step at m=4 and 1/13 at m=8
    (idle 5p - 6 forward-units beside 6m of work), 1F1B 1/5 and 1/9; train.py's, half of each backward's
    weight gradients deferred, under half of 1F1B's."""
    for m, dualpipev, one_f_one_b in ((4, 1 / 7, 1 / 5), (8, 1 / 13, 1 / 9)):
        assert bubble_share("dualpipev", 2, m, weight=0) == pytest.approx(dualpipev)
        assert bubble_share("1f1b", 2, m) == pytest.approx(one_f_one_b)
        assert bubble_share("dualpipev", 2, m) < one_f_one_b / 2
    for p in (4, 8):
        assert bubble_share("dualpipev", p, 2 * p) < bubble_share("dualpipev", p, 2 * p, weight=0)
        assert bubble_share("dualpipev", p, 2 * p, weight=0) < bubble_share("1f1b", p, 2 * p)


def held_by_buffer_ids(schedule: str, stages: int, micro_batches: int, rank: int) -> list[int]:
    """Per phase, the most buffers forwarded and not yet backwarded in DeepSpeed's instruction stream of
    ``rank``, counted by buffer id (not by the simulator's counters)."""
    live: dict[int, set[int]] = {0: set(), 1: set()}
    peak = {0: 0, 1: 0}
    for cmd in instructions(schedule, stages, micro_batches, rank):
        phase = getattr(cmd, "phase", 0)
        if type(cmd).__name__ == "ForwardPass":
            assert cmd.buffer_id not in live[phase]
            live[phase].add(cmd.buffer_id)
            peak[phase] = max(peak[phase], len(live[phase]))
        elif type(cmd).__name__ == "BackwardPass":
            live[phase].remove(cmd.buffer_id)
    return [peak[0], peak[1]] if schedule == "dualpipev" else [peak[0]]


@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (4, 8), (4, 12)])
def test_in_flight_counts_are_deepspeeds_buffers(p, m):
    """Rank r of DualPipeV holds 2p - r micro-batches of its phase-0 piece and r + 1 of its phase-1 piece, both
    at once at some point (so the planner's sum of the two peaks is reached); 1F1B min(p - r, m)."""
    sim = simulated("dualpipev", p, m)
    for r in range(p):
        assert list(sim.in_flight[r]) == held_by_buffer_ids("dualpipev", p, m, r) == [2 * p - r, r + 1]
        assert (2 * p - r, r + 1) in sim.held[r]
        assert list(simulated("1f1b", p, m).in_flight[r]) == held_by_buffer_ids("1f1b", p, m, r)


def test_a_receive_without_its_send_is_reported_not_waited_for(monkeypatch):
    real = schedule_sim.instructions

    def without_first_send(schedule, stages, micro_batches, rank, zero_bubble=False):
        cmds = real(schedule, stages, micro_batches, rank, zero_bubble)
        if rank == 0:
            cmds.remove(next(c for c in cmds if type(c).__name__ == "SendActivation"))
        return cmds

    monkeypatch.setattr(schedule_sim, "instructions", without_first_send)
    for schedule in ("1f1b", "dualpipev"):
        pieces = Layout(stages=2, schedule=schedule).pieces
        with pytest.raises(RuntimeError, match="deadlocked"):
            simulate(schedule, 2, 4, [1.0] * pieces, [2.0] * pieces)


def test_uniform_times_scale_with_layers():
    assert uniform_times([3, 1], 1.0, 2.0) == ([3.0, 1.0], [6.0, 2.0])
    with pytest.raises(ValueError, match="4 pieces"):
        simulate("dualpipev", 2, 4, [1.0] * 2, [2.0] * 2)


SHAPE_ARGS = dict(hidden=256, ffn=688, layers=8, heads=4, kv_heads=4, vocab=1000)


def test_planner_counts_each_dualpipev_piece_with_its_own_in_flight_micro_batches():
    """8 layers on 2 ranks: 1F1B rank 1 holds 1 micro-batch of 4 layers; DualPipeV rank 1 holds 3 of its
    phase-0 piece (2 layers) and 2 of its phase-1 piece (2 layers), 10 layers' worth; the loss moves to rank 0
    without the previous micro-batch's logits."""
    from parallel.memory_plan import (
        Shape,
        layer_activation_bytes,
        loss_bytes,
        micro_batch_activation_bytes,
        stage_estimates,
    )

    shape = Shape(**SHAPE_ARGS)
    one_f_one_b = Layout(stages=2, grad_accum=8)
    dualpipev = Layout(stages=2, grad_accum=8, schedule="dualpipev")
    work = layer_activation_bytes(shape, dualpipev)
    per_layer = micro_batch_activation_bytes(shape, dualpipev, 1)
    base = stage_estimates([1e6, 1e6], one_f_one_b, shape, [4, 4])
    dual = stage_estimates([5e5] * 4, dualpipev, shape, [2, 2, 2, 2])
    assert [e.activations for e in base] == [2 * 4 * per_layer + work, 1 * 4 * per_layer + work]
    assert [e.activations for e in dual] == [(4 * 2 + 1 * 2) * per_layer + work, (3 * 2 + 2 * 2) * per_layer + work]
    assert [e.parameters for e in dual] == [e.parameters for e in base]
    assert [e.loss for e in base] == [0, loss_bytes(shape, one_f_one_b)]
    assert [e.loss for e in dual] == [loss_bytes(shape, dualpipev), 0] and dual[0].loss < base[1].loss


def spec_counts(config) -> tuple[list[int], list[str]]:
    from models.llama_pipe import spec_layout, spec_parameter_counts

    return spec_parameter_counts(config), [info.kind for info in spec_layout(config)]


def rank_peaks(config, layout: Layout, bounds: list[int]) -> list[float]:
    """The planner's peak per rank for the pieces ``bounds`` cut."""
    from parallel.memory_plan import shape_of, stage_estimates

    counts, kinds = spec_counts(config)
    params = [float(sum(counts[a:b])) for a, b in zip(bounds, bounds[1:])]
    layers = [kinds[a:b].count("decoder") for a, b in zip(bounds, bounds[1:])]
    return [e.total for e in stage_estimates(params, layout, shape_of(config), layers)]


def test_dualpipev_memory_boundaries_balance_the_ranks():
    """pieces + 1 increasing boundaries over every spec; the ranks' largest peak below the compute split's,
    and no single boundary move lowers it."""
    from models.llama_pipe import spec_layout
    from parallel.partition import memory_boundaries, stage_boundaries
    from training.configuration.model_source import model_group_config

    config = model_group_config("llama3-8b")
    layout = Layout(stages=2, grad_accum=4, seq_len=4096, loss_chunk=1024, schedule="dualpipev")
    parts = memory_boundaries(config, layout)
    assert len(parts) == layout.pieces + 1 and parts[0] == 0 and parts[-1] == len(spec_layout(config))
    assert all(a < b for a, b in zip(parts, parts[1:]))
    best = max(rank_peaks(config, layout, parts))
    assert best < max(rank_peaks(config, layout, stage_boundaries(config, layout.pieces, "compute")))
    for i in range(1, layout.pieces):
        for at in range(parts[i - 1] + 1, parts[i + 1]):
            assert max(rank_peaks(config, layout, parts[:i] + [at] + parts[i + 1 :])) >= best
    one_f_one_b = memory_boundaries(config, Layout(stages=2, grad_accum=4, seq_len=4096, loss_chunk=1024))
    assert len(one_f_one_b) == 3  # the schedule decides how many pieces


def test_estimate_memory_reports_the_schedule_and_refuses_what_train_py_refuses(capsys):
    from tests.support.scripts import load_entry_point

    script = load_entry_point("scripts/estimate_memory.py")
    script.main(["--model", "llama3-8b", "--stages", "2", "--grad-accum", "8", "--schedule", "both"])
    out = capsys.readouterr().out
    assert "pipeline schedule 1f1b: bubble" in out and "pipeline schedule dualpipev: bubble" in out
    assert "(4 pieces, two per rank)" in out and "largest activations of a rank" in out
    script.main(["--model", "llama3-8b", "--gpus", "4", "--gpu-mem", "80", "--schedule", "both", "--top", "40"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    assert {row[1] for row in rows} == {"1f1b", "dualpipev"}
    assert all("(DualPipeV)" in " ".join(row) for row in rows if row[1] == "dualpipev")
    with pytest.raises(SystemExit) as exit_:
        script.main(["--model", "llama3-8b", "--stages", "4", "--grad-accum", "4", "--schedule", "dualpipev"])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and "needs --grad-accum >= 2 x --stages = 8" in err  # its flags
