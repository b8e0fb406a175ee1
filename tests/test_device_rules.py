"""Rules that depend on what the device can do (fp16) give the same answer on every machine.

Each test sets the device's answers itself (DeepSpeed's accelerator: its name, and whether it says fp16 is supported),
both ways, instead of assuming this machine's (a Xeon with AVX512-FP16 says yes to fp16 where another CPU says no). The
same rule through ``resolve``, on a CPU that says yes: tests/test_config.py."""

from __future__ import annotations

import pytest
from deepspeed.accelerator import get_accelerator

from training.configuration import ds_json
from training.configuration.ds_json import precision_problems

CPU_FP16 = (
    "precision fp16 needs a CUDA GPU (on the CPU, DeepSpeed's fp16 exists only where the CPU has AVX512-FP16 and is "
    "not tested here, so it is refused on every CPU): set precision=bf16 or precision=fp32"
)


@pytest.fixture
def device(monkeypatch):
    """``device(name, fp16)``: DeepSpeed's accelerator is ``name`` and says fp16 is supported or not."""

    def set_device(name: str, fp16: bool) -> None:
        monkeypatch.setattr(ds_json, "accelerator_name", lambda: name)
        monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: fp16)

    return set_device


@pytest.mark.parametrize("fp16", [True, False], ids=["cpu_with_avx512_fp16", "cpu_without"])
def test_fp16_is_refused_on_every_cpu_with_the_reason(device, fp16):
    device("cpu", fp16)
    assert precision_problems("fp16") == [CPU_FP16]
    assert precision_problems("bf16") == precision_problems("fp32") == []


def test_fp16_on_a_gpu_follows_what_the_gpu_supports(device):
    device("cuda", True)
    assert precision_problems("fp16") == []
    device("cuda", False)
    assert precision_problems("fp16") == [
        "precision fp16 is not supported on this device (cuda): set precision=bf16 or precision=fp32"
    ]
