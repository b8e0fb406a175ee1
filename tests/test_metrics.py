"""The progress line and metrics.jsonl: real tokens, label tokens, and MFU where the peak is known."""

from __future__ import annotations

import json

import pytest
import torch

from models.llama_pipe import flops_per_token
from models.tiny import tiny_config
from training.observation.metrics import (
    PEAK_TFLOPS,
    StepLogger,
    device_peak_tflops,
    mfu,
    peak_basis,
    read_final_record,
    write_final_record,
)


def test_mfu_is_model_flops_per_second_over_the_peak():
    six_n, attention = flops_per_token(tiny_config(), seq=64)
    assert mfu(1000.0, six_n + attention, 1e12) == pytest.approx(1000.0 * (six_n + attention) / 1e12)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_peak_is_the_knob_or_a_known_gpu_and_none_on_cpu():
    assert device_peak_tflops("bf16") is None  # no GPU here: MFU omitted
    assert device_peak_tflops("bf16", override=123.0) == 123.0
    names = [entry[0] for entry in PEAK_TFLOPS]
    assert names.index("H100 PCIe") < names.index("H100")  # the PCIe card is matched before the SXM one


def test_step_records_carry_real_tokens_label_tokens_and_mfu(tmp_path, capsys):
    logger = StepLogger(str(tmp_path), max_steps=2, log_steps=1, active=True, flops_per_token=1e9, peak_flops=1e12)
    logger.log(1, 2.5, 1e-3, 0.7, tokens=900, label_tokens=300, fed_tokens=1200)
    plain = StepLogger(str(tmp_path / "cpu"), max_steps=2, log_steps=1, active=False)  # inactive ranks write nothing
    plain.log(1, 2.5, 1e-3, 0.7, tokens=900, label_tokens=300)
    logger.close()
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record["tokens"] == 900 and record["label_tokens"] == 300
    assert record["mfu"] == pytest.approx(record["tokens_per_s"] * 1e9 / 1e12, rel=1e-2)
    assert record["padding"] == 0.25  # 300 of the 1200 tokens fed were padding
    assert f" tokens/s (25% padding) | MFU {100 * record['mfu']:.1f}% |" in capsys.readouterr().out
    assert not (tmp_path / "cpu").exists()


def test_final_record_comes_last_and_a_resumed_run_replaces_it(tmp_path):
    """The run's final figures are metrics.jsonl's last record; a run resumed from it keeps the steps up to its
    checkpoint and writes its own final record at its end, never two."""
    logger = StepLogger(str(tmp_path), max_steps=2, log_steps=1, active=True)
    for step in (1, 2):
        logger.log(step, 2.5, 1e-3, 0.7, tokens=900, label_tokens=300)
    logger.close()
    assert read_final_record(str(tmp_path)) is None  # a run that did not reach its end
    figures = {"peak_memory_mib": [{"host": 512.5}, {"host": 498.0}]}
    write_final_record(str(tmp_path), 2, figures)
    assert read_final_record(str(tmp_path)) == {"kind": "final", "step": 2, **figures}
    resumed = StepLogger(str(tmp_path), max_steps=3, log_steps=1, active=True, start_step=2)
    resumed.log(3, 2.4, 1e-3, 0.7, tokens=900, label_tokens=300)
    resumed.close()
    write_final_record(str(tmp_path), 3, {"peak_memory_mib": [{"host": 520.0}, {"host": 501.0}]})
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in records] == [("train", 1), ("train", 2), ("train", 3), ("final", 3)]


def test_an_fp8_runs_mfu_is_against_the_bf16_dense_peak_and_its_line_says_so(tmp_path, capsys, monkeypatch):
    """fp8 divides by the card's bf16 dense peak (not its FP8 one, nor fp32's), so FP8 and bf16 runs compare on one
    scale: the progress line and the record say which peak; a bf16 run's line stays as it was."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H100 80GB HBM3")
    assert device_peak_tflops("fp32", fp8="rowwise") == device_peak_tflops("bf16") == 989.4
    assert device_peak_tflops("fp32") == 66.9
    assert peak_basis("rowwise") == "the bf16 dense peak" and peak_basis(None) == ""
    assert peak_basis("tensorwise", 1979.0) == "mfu_peak_tflops=1979"
    for name, basis in (("fp8", peak_basis("rowwise")), ("bf16", peak_basis(None))):
        (tmp_path / name).mkdir()
        logger = StepLogger(
            str(tmp_path / name), 1, 1, True, flops_per_token=1e9, peak_flops=989.4e12, peak_basis=basis
        )
        logger.log(1, 2.5, 1e-3, 0.7, tokens=900, label_tokens=300)
        logger.close()
    out = capsys.readouterr().out.splitlines()
    assert "% vs the bf16 dense peak | " in out[0] and " vs " not in out[1]
    fp8, bf16 = (json.loads((tmp_path / n / "metrics.jsonl").read_text()) for n in ("fp8", "bf16"))
    assert fp8["mfu_peak"] == "the bf16 dense peak" and "mfu_peak" not in bf16
