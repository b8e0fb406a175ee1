"""Weights & Biases (monitor.wandb, training/observation/tracking.py), offline, records what metrics.jsonl holds.

What the run directory holds is read back from W&B's own transaction log (its records, in LevelDB's log format) and
compared with metrics.jsonl. The multi-rank check (a stopped and resumed pipe 2 x data 2 run, one W&B run across both)
is in tests/test_preemption.py."""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import os
import struct
import time

import pytest

from tests.test_config import good, problems_of  # noqa: F401 (a fixture)
from training.configuration.schema import MonitorConfig
from training.observation.tracking import RUN_ID_FILE, WandbRun, flat_values

BLOCK = 32768  # LevelDB log blocks; each record: crc32 (4), length (2), type (1: whole, 2-4: first/middle/last)


def offline_history(output_dir: str) -> tuple[set[str], dict[int, dict[str, float]]]:
    """(run ids, step -> every value W&B logged at that step) of every offline run under output_dir/wandb."""
    from wandb.proto import wandb_internal_pb2

    ids, history = set(), {}
    for path in sorted(glob.glob(os.path.join(output_dir, "wandb", "offline-run-*", "run-*.wandb"))):
        data, i, pending, records = open(path, "rb").read(), 7, b"", []  # 7: W&B's header (":W&B", version)
        while i + 7 <= len(data):
            if BLOCK - i % BLOCK < 7:
                i += BLOCK - i % BLOCK
                continue
            _, length, kind = struct.unpack("<IHB", data[i : i + 7])
            chunk, i = data[i + 7 : i + 7 + length], i + 7 + length
            if kind in (1, 4):
                records.append(pending + chunk)
                pending = b""
            elif kind in (2, 3):
                pending += chunk
        for raw in records:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "run":
                ids.add(record.run.run_id)
            elif record.WhichOneof("record_type") == "history":
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                history.setdefault(int(items["_step"]), {}).update(
                    {k: v for k, v in items.items() if not k.startswith("_")}
                )
    return ids, history


def assert_holds_metrics(output_dir: str, records: list[dict]) -> None:
    deadline = time.time() + 20  # W&B's service may still be writing the last records when finish() returns
    while True:
        ids, history = offline_history(output_dir)
        held = all(flat_values(r).items() <= history.get(r["step"], {}).items() for r in records)
        if held or time.time() > deadline:
            break
        time.sleep(0.5)
    assert ids == {open(os.path.join(output_dir, RUN_ID_FILE)).read()}, ids  # one run, resumed or not
    for record in records:
        assert flat_values(record).items() <= history[record["step"]].items(), (record, history[record["step"]])


def test_records_become_wandb_keys():
    train = {"kind": "train", "step": 3, "loss": 2.5, "grad_norm": None, "layout": {"pipe": 2, "data": 1}}
    assert flat_values(train) == {"train/loss": 2.5, "train/layout/pipe": 2, "train/layout/data": 1}
    evaluation = {"kind": "eval", "step": 4, "eval_loss": 1.5, "source": "code"}
    assert flat_values(evaluation) == {"eval/code/eval_loss": 1.5}


@pytest.mark.slow  # a second and more: a W&B offline run written and resumed
def test_an_offline_run_holds_the_records_and_a_resume_continues_it(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = str(tmp_path)
    records = [{"kind": "train", "step": s, "loss": 3.0 / s, "lr": 1e-3, "layout": {"pipe": 2}} for s in (1, 2)]
    run = WandbRun(MonitorConfig(wandb=True, wandb_tags=["t"]), out, {"seed": 1})
    for r in records:
        run(r)
    run.close()
    later = [{"kind": "train", "step": 3, "loss": 0.9, "lr": 1e-3}, {"kind": "eval", "step": 3, "eval_loss": 1.1}]
    run = WandbRun(MonitorConfig(wandb=True), out, {"seed": 1})  # a resumed job: the same run id
    for r in later:
        run(r)
    run.close()
    assert len(glob.glob(os.path.join(out, "wandb", "offline-run-*"))) == 2
    assert_holds_metrics(out, records + later)


def test_wandb_without_the_package_is_refused(good, monkeypatch):  # noqa: F811
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = dataclasses.replace(good, monitor=MonitorConfig(wandb=True))
    assert "monitor.wandb=true needs the wandb package: pip install wandb==0.31.0" in problems_of(cfg, world_size=1)


@pytest.mark.parametrize("key", ["wandb_project", "wandb_tags"])
def test_the_wandb_settings_are_config_keys(key):
    assert key in MonitorConfig.__dataclass_fields__
