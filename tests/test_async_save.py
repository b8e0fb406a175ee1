"""save_async's pieces in one process: the host copy, the capturing checkpoint engine, the writer thread, and the order
in which a checkpoint becomes ``latest``.

The multi-rank runs are in tests/test_run_failures.py's chain and in the layouts' own resume tests.
"""

from __future__ import annotations

import collections
import os
from types import SimpleNamespace

import pytest
import torch

from models.files.pipeline_dir import checkpoint_tags, latest_tag
from training.checkpoints.async_save import BackgroundWriter, CheckpointEngine, host_copy
from training.checkpoints.save_restore import make_latest, prune, remove_interrupted_saves, staging_dir


def adamw_after_steps(steps: int) -> tuple[torch.nn.Linear, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(2, 4)).sum().backward()
        optim.step()
    return model, optim


def test_the_host_copy_holds_the_values_of_the_save_whatever_training_does_after(tmp_path):
    """A torch optimizer's state_dict hands out its live per-parameter states (exp_avg, and a step counter updated
    in place): written later without a copy, the file holds the next step's values. With the capture it holds
    the save's, the same file a direct save writes."""
    model, optim = adamw_after_steps(1)
    direct = tmp_path / "direct.pt"
    engine = CheckpointEngine()
    engine.save({"optimizer": optim.state_dict(), "weight": model.weight}, str(direct))
    with engine.capturing() as captured:
        engine.save({"optimizer": optim.state_dict(), "weight": model.weight}, str(tmp_path / "captured.pt"))
    late = {"optimizer": optim.state_dict(), "weight": model.weight}  # what a writer without a copy gets
    model(torch.randn(2, 4)).sum().backward()
    optim.step()  # training goes on before the background write
    assert not (tmp_path / "captured.pt").exists()  # captured, not written
    ((path, obj),) = captured
    engine.write(obj, path)
    engine.write(late, str(tmp_path / "late.pt"))
    want, got, stale = (engine.load(str(tmp_path / n)) for n in ("direct.pt", "captured.pt", "late.pt"))
    assert torch.equal(got["weight"], want["weight"])
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(got["optimizer"]["state"][0][key], want["optimizer"]["state"][0][key]), key
        assert not torch.equal(stale["optimizer"]["state"][0][key], want["optimizer"]["state"][0][key]), key
    assert not torch.equal(stale["weight"], want["weight"])
    assert os.path.getsize(tmp_path / "captured.pt") == os.path.getsize(direct)


def test_the_host_copy_keeps_container_types_and_owns_its_storage():
    flat = torch.arange(10.0)
    point = collections.namedtuple("point", "x y")
    item = collections.OrderedDict(
        view=flat[2:5], shape=torch.Size([3]), pair=(1, flat[:1]), named=point(flat[5:6], "y"), text="a", n=3
    )
    copy = host_copy(item)
    flat.add_(100)
    assert type(copy) is collections.OrderedDict and list(copy) == list(item)
    assert torch.equal(copy["view"], torch.tensor([2.0, 3.0, 4.0]))
    assert copy["view"].untyped_storage().nbytes() == 3 * 4  # its part only, not the flat buffer
    assert type(copy["shape"]) is torch.Size and type(copy["pair"]) is tuple
    assert type(copy["named"]) is point and torch.equal(copy["named"].x, torch.tensor([5.0]))
    assert (copy["text"], copy["n"]) == ("a", 3)


def test_a_capture_leaves_deepspeeds_clone_to_the_host_copy():
    engine = CheckpointEngine()
    assert engine.preserves_storage_sharing()  # DeepSpeed clones a layer file's tensors before a direct save
    with engine.capturing():
        assert not engine.preserves_storage_sharing()  # host_copy copies them once
    assert engine.preserves_storage_sharing() and engine.captured is None


def test_the_writer_writes_in_the_background_and_reports_a_failure(tmp_path):
    engine = CheckpointEngine()
    writer = BackgroundWriter()
    files = [(str(tmp_path / f"{i}.pt"), {"t": torch.full((3,), float(i))}) for i in range(3)]
    writer.start("global_step1", files, engine, captured_s=0.01)
    writer.wait()
    assert not writer.busy and writer.error is None and writer.written_s >= 0
    assert [engine.load(str(tmp_path / f"{i}.pt"))["t"][0].item() for i in range(3)] == [0.0, 1.0, 2.0]
    with pytest.raises(AssertionError, match="global_step1 is still pending"):
        writer.start("global_step2", [], engine, 0.0)
    writer.done()
    writer.start("global_step2", [(str(tmp_path / "missing" / "x.pt"), {})], engine, 0.0)
    writer.wait()
    assert writer.error is not None and "missing" in writer.error


def test_a_checkpoint_is_renamed_into_place_before_latest_and_pruning_see_it(tmp_path, capsys):
    """``.global_step<N>.partial`` is never a checkpoint (resume, prune, --to-hf ignore it); save_total_limit=1 keeps
    the previous checkpoint until the new one is complete; a start removes what interrupted saves left."""
    out = tmp_path / "run"
    for tag in ("global_step2", "global_step4"):
        os.makedirs(staging_dir(str(out), tag))
    make_latest(SimpleNamespace(output_dir=str(out), save_total_limit=1), "global_step2")
    assert latest_tag(str(out)) == "global_step2" and checkpoint_tags(str(out)) == [(2, "global_step2")]
    assert prune(str(out), 1, keep="global_step2") == []  # .global_step4.partial: not a checkpoint to prune
    assert os.path.isdir(staging_dir(str(out), "global_step4"))
    make_latest(SimpleNamespace(output_dir=str(out), save_total_limit=1), "global_step4")
    assert latest_tag(str(out)) == "global_step4" and checkpoint_tags(str(out)) == [(4, "global_step4")]
    os.makedirs(staging_dir(str(out), "global_step6"))
    os.makedirs(out / "notes.partial")
    remove_interrupted_saves(str(out))
    assert sorted(os.listdir(out)) == ["global_step4", "latest", "notes.partial"]
    assert "removing " + staging_dir(str(out), "global_step6") in capsys.readouterr().out


def test_the_planner_counts_the_host_copy_of_a_checkpoint():
    """save_async holds what a rank writes (its weights, its optimizer-state partition, offloaded ones too) in host
    memory until written: the planner's host column and the preflight line count it."""
    from parallel.layout import Layout
    from parallel.memory_plan import stage_estimate, stage_table

    for zero, offload in ((1, False), (1, True), (0, False)):
        layout = Layout(stages=2, dp=2, zero=zero, offload_optimizer=offload, dtype="bf16")
        plain = stage_estimate(0, 1e9, None, layout, None, 2e9)
        copied = stage_estimate(0, 1e9, None, Layout(**{**layout.__dict__, "save_async": True}), None, 2e9)
        assert plain.snapshot == 0 and copied.total == plain.total  # not GPU memory
        # bf16 weights + half of 12 bytes of optimizer states per parameter (ZeRO-1, or bf16 ZeRO-0's BF16_Optimizer:
        # sharded over data 2); not the offloaded fp32 gradients
        assert copied.snapshot == pytest.approx(1e9 * (2 + 6))
        table = stage_table([copied], None)
        assert "host" in table[0] and f"{(copied.host + copied.snapshot) / 1e9:.2f}" in table[1]
