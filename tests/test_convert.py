"""convert2ckpt.py: HF -> stages -> HF is bit-identical; bad input fails clearly and leaves no output."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, LlamaForCausalLM

from models.files import pipeline_dir
from models.files.hf_convert import ConversionError, hf_to_stages, save_layer_file, stages_to_hf
from models.files.pipeline_dir import CheckpointError, load_layer_file, load_stage_weights
from models.host_memory import current_rss_mb, mapped_file_span
from models.llama_pipe import layer_file_name, spec_layout
from tests.support.models import make_hf_dir
from tests.support.scripts import load_entry_point

convert2ckpt = load_entry_point("convert2ckpt.py")


def hf_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors model directory (single file or shards)."""
    out = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(model_dir, name)))
    return out


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


def leftovers(parent: str) -> list[str]:
    return [n for n in os.listdir(parent) if ".tmp-" in n]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_round_trip_is_bit_identical(tmp_path, tokenizer_dir, dtype, tied):
    src = make_hf_dir(tmp_path, tokenizer_dir, "src", dtype=dtype, tie_word_embeddings=tied)
    hf_to_stages(src, str(tmp_path / "ckpt"))
    stages_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
    assert_bit_identical(hf_tensors(src), hf_tensors(str(tmp_path / "back")))
    tag_files = sorted(os.listdir(tmp_path / "ckpt" / "global_step0"))
    num_specs = len(spec_layout(LlamaForCausalLM.config_class.from_pretrained(src)))
    expected_files = [layer_file_name(i) for i in range(num_specs - (1 if tied else 0))]
    assert tag_files == sorted(expected_files + ["mp_rank_00_model_states.pt"])

    # The export is a usable Hugging Face model: same logits, tokenizer loads.
    original = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32)
    exported = LlamaForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    ids = torch.randint(0, original.config.vocab_size, (1, 16))
    assert torch.equal(original(ids).logits, exported(ids).logits)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "back"))
    assert (
        tok("def f(x): return x")["input_ids"] == AutoTokenizer.from_pretrained(src)("def f(x): return x")["input_ids"]
    )


def test_sharded_safetensors_and_bin_inputs(tmp_path, tokenizer_dir):
    src = make_hf_dir(tmp_path, tokenizer_dir, "src")
    reference = hf_tensors(src)
    model = LlamaForCausalLM.from_pretrained(src)

    sharded = str(tmp_path / "sharded")
    model.save_pretrained(sharded, max_shard_size="200KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    hf_to_stages(sharded, str(tmp_path / "ckpt_sharded"))
    stages_to_hf(str(tmp_path / "ckpt_sharded"), str(tmp_path / "back_sharded"), max_shard_size="300KB")
    assert len([n for n in os.listdir(tmp_path / "back_sharded") if n.endswith(".safetensors")]) > 1
    assert_bit_identical(reference, hf_tensors(str(tmp_path / "back_sharded")))

    for name, zipfile in (("bin", True), ("legacy_bin", False)):  # legacy: the pre-1.6 torch.save format
        d = tmp_path / name
        d.mkdir()
        torch.save(reference, d / "pytorch_model.bin", _use_new_zipfile_serialization=zipfile)
        (d / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
        hf_to_stages(str(d), str(tmp_path / f"ckpt_{name}"))
        stages_to_hf(str(tmp_path / f"ckpt_{name}"), str(tmp_path / f"back_{name}"))
        assert_bit_identical(reference, hf_tensors(str(tmp_path / f"back_{name}")))


def test_dtype_cast_updates_config(tmp_path, tiny_hf):
    hf_to_stages(tiny_hf, str(tmp_path / "ckpt"), dtype=torch.bfloat16)
    layer = torch.load(tmp_path / "ckpt" / "global_step0" / layer_file_name(1), weights_only=True)
    assert all(t.dtype == torch.bfloat16 for t in layer.values())
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["dtype"] == "bfloat16"


def corrupt(src: str, dst, edit) -> str:
    """Copy of ``src`` whose tensors pass through ``edit(dict)``."""
    dst.mkdir()
    tensors = hf_tensors(src)
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(open(os.path.join(src, "config.json")).read())
    return str(dst)


@pytest.mark.parametrize(
    "edit, expected",
    [
        (
            lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
            ["missing tensor 'model.layers.1.mlp.up_proj.weight'", "(176, 64)"],
        ),
        (
            lambda t: t.update({"model.layers.9.extra": torch.zeros(3)}),
            ["unexpected tensor 'model.layers.9.extra'", "(3,)"],
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)}),
            ["'model.layers.0.self_attn.k_proj.weight' has shape (64, 64)", "implies (32, 64)"],
        ),
    ],
    ids=["missing", "unexpected", "shape"],
)
def test_bad_input_names_tensor_and_shapes_and_writes_nothing(tmp_path, tiny_hf, edit, expected):
    bad = corrupt(tiny_hf, tmp_path / "bad", edit)
    with pytest.raises(ConversionError) as err:
        hf_to_stages(bad, str(tmp_path / "out"))
    for fragment in expected:
        assert fragment in str(err.value)
    assert not (tmp_path / "out").exists() and not leftovers(str(tmp_path))


def test_failure_midway_leaves_no_output(tmp_path, tiny_hf, monkeypatch):
    real_save, calls = torch.save, []

    def failing_save(obj, path, *a, **k):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("No space left on device")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError):
        hf_to_stages(tiny_hf, str(tmp_path / "out"))
    assert len(calls) == 3
    assert not (tmp_path / "out").exists() and not leftovers(str(tmp_path))


def test_existing_output_needs_overwrite_and_cli_reports_errors(tmp_path, tiny_hf, capsys):
    out = str(tmp_path / "ckpt")
    assert convert2ckpt.main(["--input", tiny_hf, "--output", out]) == 0
    assert convert2ckpt.main(["--input", tiny_hf, "--output", out]) == 1
    assert "already exists" in capsys.readouterr().err
    assert convert2ckpt.main(["--input", tiny_hf, "--output", out, "--overwrite"]) == 0
    assert convert2ckpt.main(["--to-hf", "--input", out, "--tag", "global_step7", "--output", str(tmp_path / "x")]) == 1
    assert "tag 'global_step7' not found" in capsys.readouterr().err
    assert convert2ckpt.main(["--to-hf", "--input", tiny_hf, "--output", str(tmp_path / "y")]) == 1
    assert "looks like a Hugging Face model directory" in capsys.readouterr().err


def test_export_refuses_a_checkpoint_of_another_shape(tmp_path, tiny_hf, tokenizer_dir):
    hf_to_stages(tiny_hf, str(tmp_path / "ckpt"))
    other = make_hf_dir(tmp_path, tokenizer_dir, "wide", intermediate_size=128)
    (tmp_path / "ckpt" / "config.json").write_text(open(os.path.join(other, "config.json")).read())
    with pytest.raises(
        ConversionError, match=r"'mlp.gate_proj.weight' has shape \(176, 64\), the model config expects \(128, 64\)"
    ):
        stages_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))


class _FakeStage:
    """Just enough of a PipelineModule for load_stage_weights: one stage owning ``specs``."""

    def __init__(self, config, specs):
        from models.llama_pipe import build_specs

        all_specs = build_specs(config)
        self._layer_specs = all_specs
        self._local_start, self._local_stop = specs[0], specs[-1] + 1
        self.tied_modules = {}
        self.forward_funcs = [all_specs[i].build() for i in specs]


def test_stage_loader_reads_only_its_files_and_reports_problems(tmp_path, tiny_hf):
    from transformers import LlamaConfig

    hf_to_stages(tiny_hf, str(tmp_path / "ckpt"))
    config = LlamaConfig.from_pretrained(tiny_hf)
    stage = _FakeStage(config, [2, 3])
    report = load_stage_weights(stage, config, str(tmp_path / "ckpt"))
    assert [os.path.basename(f) for f in report.files] == [layer_file_name(2), layer_file_name(3)]
    ref = hf_tensors(tiny_hf)
    assert torch.equal(stage.forward_funcs[0].mlp.down_proj.weight, ref["model.layers.1.mlp.down_proj.weight"])

    os.remove(tmp_path / "ckpt" / "global_step0" / layer_file_name(3))
    with pytest.raises(CheckpointError, match="missing layer file .*layer_03-model_states.pt"):
        load_stage_weights(_FakeStage(config, [2, 3]), config, str(tmp_path / "ckpt"))


def test_mapped_tensor_file_span_points_at_its_bytes(tmp_path):
    """The export reads a tensor's bytes from its layer file with pread (where mapped_file_span finds
    them) instead of through the mapping: the span must point at exactly those bytes."""
    path = str(tmp_path / "layer.pt")
    save_layer_file({"a": torch.arange(1000, dtype=torch.float32), "b": torch.randn(7, 5).bfloat16()}, path)
    state = load_layer_file(path)
    for t in state.values():
        file, offset = mapped_file_span(t)
        assert os.path.samefile(file, path)
        nbytes = t.numel() * t.element_size()
        with open(path, "rb") as f:
            f.seek(offset)
            assert f.read(nbytes) == t.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert mapped_file_span(torch.ones(3)) is None  # ordinary memory
    assert mapped_file_span(state["a"].clone()) is None


def test_stage_copy_releases_the_mapped_file_as_it_goes(tmp_path, monkeypatch):
    """Loading a stage holds the stage plus one chunk, not plus one layer file: after copying a 64 MiB
    tensor out of its mapped file, the file's pages are no longer resident in this process."""
    path = str(tmp_path / "big.pt")
    save_layer_file({"w": torch.randn(16, 2**20)}, path)  # 64 MiB fp32
    src = load_layer_file(path)["w"]
    dst = torch.zeros(16, 2**20)  # touched: resident before the copy starts
    monkeypatch.setattr(pipeline_dir, "LOAD_CHUNK", 4 * 2**20)
    before = current_rss_mb()
    pipeline_dir.copy_from_mapped(dst, src)
    grown = current_rss_mb() - before
    assert torch.equal(dst, src)
    assert grown < 16, f"RSS grew {grown:.0f} MiB: the mapped file stayed resident (64 MiB)"
