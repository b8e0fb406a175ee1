"""model_name_or_path=HF_DIR: train.py starts straight from a Hugging Face directory (models/hf_stage.py).

Fast: what the converter refuses is refused before the start with its message (and for ``.bin`` weights the
command that converts them); each rank reads only its stage's tensors (its tensor-parallel piece, its experts), from
the shards that hold them, into the same weights the layer files give. Multi-rank: runs started from sharded
safetensors train bit-identically to the same runs started from the converted layer files, and the first checkpoint
they save resumes, reshards and exports.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from models.families import load_config
from models.files import hf_stage, pipeline_dir
from models.files.hf_convert import HFTensorSource, hf_to_stages
from models.files.hf_stage import load_stage_from_hf, stage_files
from models.files.pipeline_dir import load_layer_file, load_stage_weights
from models.host_memory import current_rss_mb
from models.llama_pipe import layer_file_name, spec_layout
from models.tiny import save_random_model, tiny_config
from tests.support.models import make_hf_dir
from tests.support.parity import PIPE, train_args
from tests.support.ranks import train_run
from tests.support.runs import read_metrics
from tests.support.scripts import load_entry_point
from tests.test_convert import _FakeStage, corrupt, hf_tensors
from training.configuration.schema import ConfigError, DataConfig, PeftConfig, TrainConfig
from training.configuration.validate import resolve

SHARD = "100KB"  # the tiny model (~0.5 MB in fp32) in several shards, a decoder layer spread over two at most


def sharded(src: str, dst) -> str:
    """``src`` written again by ``save_pretrained(max_shard_size=SHARD)``, with its tokenizer: the same tensors."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(str(dst), max_shard_size=SHARD)
    for name in os.listdir(src):
        if name.startswith("tokenizer"):
            shutil.copy(os.path.join(src, name), dst / name)
    assert os.path.isfile(dst / "model.safetensors.index.json")
    ours, theirs = hf_tensors(str(dst)), hf_tensors(src)
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    return str(dst)


def config_for(path: str, tmp_path, **changes) -> TrainConfig:
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    cfg = TrainConfig(
        model_name_or_path=path,
        output_dir=str(tmp_path / "out"),
        num_stages=2,
        ds_config="zero1",
        micro_batch_size=2,
        data=DataConfig(train_file=str(data)),
    )
    for key, value in changes.items():
        setattr(cfg, key, value)
    return cfg


def refusal(path: str, tmp_path, **changes) -> str:
    with pytest.raises(ConfigError) as err:
        resolve(config_for(path, tmp_path, **changes), world_size=4)
    return str(err.value)


def converter_refusal(path: str, tmp_path) -> list[str]:
    """The problem lines convert2ckpt.py prints for ``path``."""
    with pytest.raises(Exception) as err:
        hf_to_stages(path, str(tmp_path / "converted"))
    return [line.strip() for line in str(err.value).splitlines()[1:]] or [str(err.value)]


# -- refused before the start ----------------------------------------------------------------------------------------


def test_bin_weights_are_refused_with_the_command_that_converts_them(tmp_path, tiny_hf):
    d = tmp_path / "bin"
    d.mkdir()
    torch.save(hf_tensors(tiny_hf), d / "pytorch_model.bin")
    for name in os.listdir(tiny_hf):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny_hf, name), d / name)
    message = refusal(str(d), tmp_path)
    assert f"model_name_or_path {d} holds pickled weights (pytorch_model.bin)" in message
    command = f"python convert2ckpt.py --input {d} --output {d}-ckpt, then model_name_or_path={d}-ckpt"
    assert command in message
    # what the message says to run makes a model train.py starts from
    assert load_entry_point("convert2ckpt.py").main(["--input", str(d), "--output", f"{d}-ckpt"]) == 0
    assert resolve(config_for(f"{d}-ckpt", tmp_path), world_size=4).model_config.num_hidden_layers == 4


@pytest.mark.parametrize(
    "edit",
    [
        lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
        lambda t: t.update({"model.layers.9.extra": torch.zeros(3)}),
        lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)}),
    ],
    ids=["missing", "unexpected", "shape"],
)
def test_what_the_converter_refuses_is_refused_with_its_message(tmp_path, tiny_hf, edit):
    bad = corrupt(tiny_hf, tmp_path / "bad", edit)  # tests/test_convert.py's refusals
    expected = converter_refusal(bad, tmp_path)
    message = refusal(bad, tmp_path)
    assert f"model_name_or_path {bad} does not match its config.json (python convert2ckpt.py --input {bad}" in message
    assert expected and all(line in message for line in expected), (expected, message)


def test_a_damaged_shard_is_named(tmp_path, tiny_hf):
    d = sharded(tiny_hf, tmp_path / "sharded")
    shard = sorted(n for n in os.listdir(d) if n.endswith(".safetensors"))[1]
    with open(os.path.join(d, shard), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(d, shard)) // 2)
    message = refusal(d, tmp_path)
    assert f"model_name_or_path {d}: {os.path.join(d, shard)} is truncated:" in message


def test_quantized_and_fused_expert_checkpoints_are_refused(tmp_path, tokenizer_dir):
    """tests/test_moe.py's two refusals of the converter, as train.py says them."""
    quantized = make_hf_dir(tmp_path, tokenizer_dir, "quantized", model_type="mixtral")
    with open(os.path.join(quantized, "config.json")) as f:
        raw = json.load(f)
    raw["quantization_config"] = {"quant_method": "fp8"}
    with open(os.path.join(quantized, "config.json"), "w") as f:
        json.dump(raw, f)
    assert "a quantized checkpoint (quantization_config: fp8)" in refusal(quantized, tmp_path)

    fused = make_hf_dir(tmp_path, tokenizer_dir, "fused", model_type="qwen3_moe")
    state = AutoModelForCausalLM.from_pretrained(fused).state_dict()  # experts fused, as transformers holds them
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(fused, "model.safetensors"))
    message = refusal(fused, tmp_path)
    assert "missing tensor 'model.layers.0.mlp.experts.0.gate_proj.weight'" in message
    assert "stores one tensor per expert" in message


def test_lora_on_a_hugging_face_directory_is_refused(tmp_path, tiny_hf):
    message = refusal(tiny_hf, tmp_path, peft=PeftConfig(method="lora", r=4, alpha=8, target_modules=["q_proj"]))
    assert f"model_name_or_path {tiny_hf} is a Hugging Face directory: convert it first" in message


# -- what each rank reads --------------------------------------------------------------------------------------------


def read_keys(monkeypatch) -> list[str]:
    """The tensors read from the files from now on (HFTensorSource.get), in order."""
    seen, get = [], HFTensorSource.get
    monkeypatch.setattr(HFTensorSource, "get", lambda self, key: seen.append(key) or get(self, key))
    return seen


def test_a_stage_reads_only_its_tensors_from_the_shards_holding_them(tmp_path, tiny_hf, monkeypatch):
    hf = sharded(tiny_hf, tmp_path / "sharded")
    with open(os.path.join(hf, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    config = LlamaConfig.from_pretrained(hf)
    stage = _FakeStage(config, [2, 3])  # decoder layers 1 and 2
    mine = sorted(k for k in weight_map if k.startswith(("model.layers.1.", "model.layers.2.")))
    files = stage_files(stage, config, HFTensorSource(hf))
    assert sorted(k for keys in files.values() for k in keys) == mine
    shards = {os.path.basename(f) for f in files}
    assert shards == {weight_map[k] for k in mine} and len(shards) < len(set(weight_map.values()))

    seen = read_keys(monkeypatch)
    report = load_stage_from_hf(stage, config, hf)
    assert sorted(seen) == mine and {os.path.basename(f) for f in report.files} == shards
    assert report.num_tensors == len(mine) and report.bytes_read == sum(hf_tensors(hf)[k].numel() * 4 for k in mine)
    # the same weights as the converted layer files give
    hf_to_stages(tiny_hf, str(tmp_path / "ckpt"))
    converted = _FakeStage(config, [2, 3])
    load_stage_weights(converted, config, str(tmp_path / "ckpt"))
    for ours, theirs in zip(stage.forward_funcs, converted.forward_funcs):
        for (k, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
            assert torch.equal(a, b), k


def test_a_tied_head_reads_the_embedding(tmp_path, tiny_tied_hf, monkeypatch):
    hf = sharded(tiny_tied_hf, tmp_path / "sharded")
    config = LlamaConfig.from_pretrained(hf)
    n = config.num_hidden_layers
    last = _FakeStage(config, [n + 1, n + 2])  # final norm, LM head (tied: the embedding's module)
    last.tied_modules = {last._layer_specs[n + 2].key: last.forward_funcs[1]}  # as PipelineModule holds it
    seen = read_keys(monkeypatch)
    load_stage_from_hf(last, config, hf)
    assert sorted(seen) == ["model.embed_tokens.weight", "model.norm.weight"]
    ref = hf_tensors(hf)
    assert torch.equal(last.forward_funcs[1].state_dict()["weight"], ref["model.embed_tokens.weight"])


def split_(module, name: str, dim: int, rank: int, world: int, attr: str) -> None:
    """Make ``module``'s parameter ``name`` a rank's piece (``tp_split`` / ``ep_split``), as parallel/ does."""
    parent, _, leaf = name.rpartition(".")
    owner = module.get_submodule(parent) if parent else module
    whole = getattr(owner, leaf)
    piece = torch.nn.Parameter(torch.zeros_like(whole.detach().chunk(world, dim)[rank]).contiguous())
    setattr(piece, attr, (dim, rank, world))
    setattr(owner, leaf, piece)


def test_a_tensor_parallel_rank_reads_its_piece(tmp_path, tiny_hf):
    hf = sharded(tiny_hf, tmp_path / "sharded")
    config = LlamaConfig.from_pretrained(hf)
    stage = _FakeStage(config, [1])
    layer = stage.forward_funcs[0]
    split_(layer, "self_attn.q_proj.weight", 0, 1, 2, "tp_split")  # column: rows 32..63
    split_(layer, "self_attn.o_proj.weight", 1, 0, 2, "tp_split")  # row: columns 0..31
    report = load_stage_from_hf(stage, config, hf)
    ref = hf_tensors(hf)
    assert torch.equal(layer.self_attn.q_proj.weight, ref["model.layers.0.self_attn.q_proj.weight"][32:])
    assert torch.equal(layer.self_attn.o_proj.weight, ref["model.layers.0.self_attn.o_proj.weight"][:, :32])
    whole = sum(v.numel() * 4 for k, v in ref.items() if k.startswith("model.layers.0."))
    assert report.bytes_read == whole - 2 * 64 * 32 * 4  # half of q_proj and of o_proj not read


def test_an_expert_parallel_rank_reads_its_experts_only(tmp_path, tokenizer_dir, monkeypatch):
    src = make_hf_dir(tmp_path, tokenizer_dir, "moe", model_type="qwen3_moe")  # 4 experts, one tensor per expert
    hf = sharded(src, tmp_path / "sharded")
    config = load_config(hf)
    stage = _FakeStage(config, [1])
    experts = stage.forward_funcs[0].mlp.experts
    for name in ("gate_up_proj", "down_proj"):
        split_(experts, name, 0, 1, 2, "ep_split")  # experts 2 and 3
    seen = read_keys(monkeypatch)
    load_stage_from_hf(stage, config, hf)
    read = [k for k in seen if ".experts." in k]
    assert sorted(read) == sorted(
        f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in (2, 3) for p in ("gate_proj", "up_proj", "down_proj")
    )
    ref = hf_tensors(hf)
    for i, e in enumerate((2, 3)):
        gate, up = (ref[f"model.layers.0.mlp.experts.{e}.{p}.weight"] for p in ("gate_proj", "up_proj"))
        assert torch.equal(experts.gate_up_proj[i], torch.cat([gate, up]))
        assert torch.equal(experts.down_proj[i], ref[f"model.layers.0.mlp.experts.{e}.down_proj.weight"])


def test_loading_holds_the_stage_not_the_shard(tmp_path, monkeypatch):
    """The first stage of a model whose one file is mostly its embedding and LM head (31 MiB each): while the
    embedding is copied, the file's pages it has copied leave the process (the RSS after each copy, before the file
    is unmapped, stays near the stage's own), and the head's are never touched. Measured: +1.9 MiB; copying
    without releasing the pages, +33 MiB."""
    hf = str(tmp_path / "big")
    save_random_model(tiny_config(vocab_size=32000, hidden_size=256, num_hidden_layers=1), hf, seed=0)
    config = LlamaConfig.from_pretrained(hf)
    stage = _FakeStage(config, [0])
    for p in stage.forward_funcs[0].parameters():
        p.data.fill_(1.0)  # resident before the load starts
    monkeypatch.setattr(pipeline_dir, "LOAD_CHUNK", 4 * 2**20)
    rss, copy = [], hf_stage.copy_from_mapped
    monkeypatch.setattr(hf_stage, "copy_from_mapped", lambda dst, src: (copy(dst, src), rss.append(current_rss_mb())))
    before = current_rss_mb()
    load_stage_from_hf(stage, config, hf)
    grown = max(rss) - before
    embedding = load_file(f"{hf}/model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(stage.forward_funcs[0].state_dict()["weight"], embedding)
    assert grown < 12, f"RSS grew {grown:.0f} MiB loading a 31 MiB embedding in 4 MiB chunks"


# -- multi-rank: from the Hugging Face directory as from the converted layer files ------------------------------------


def equal_runs(a: str, b: str, steps: list[int]) -> None:
    """Runs ``a`` and ``b``: the same losses at ``steps`` and the same final layer files, bit for bit."""
    la = {m["step"]: m["loss"] for m in read_metrics(a)}
    lb = {m["step"]: m["loss"] for m in read_metrics(b)}
    assert [la[s] for s in steps] == [lb[s] for s in steps], (la, lb)
    tag = open(os.path.join(a, "latest")).read()
    assert tag == open(os.path.join(b, "latest")).read()
    names = sorted(n for n in os.listdir(os.path.join(a, tag)) if n.startswith("layer_"))
    assert names and names == sorted(n for n in os.listdir(os.path.join(b, tag)) if n.startswith("layer_"))
    for name in names:
        wa, wb = (load_layer_file(os.path.join(d, tag, name)) for d in (a, b))
        assert sorted(wa) == sorted(wb) and all(torch.equal(wa[k], wb[k]) for k in wa), name


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory, parity_pipe, tiny_hf, tiny_tied_hf, tiny_tied_ckpt):
    """Five launches beside conftest's ``parity_pipe`` (pipe 2 x data 2 from the untied layer files, 5 steps):
    ``untied``, the same from the sharded Hugging Face directory, saving at steps 2 and 4 too; the tied model for 2
    steps on pipe 2 x data 2 (``tied``) and on pipe 2 x tensor 2 (``tied_tp``), each from its sharded directory and
    from its layer files (``<name>_ckpt``)."""
    root, data = parity_pipe["root"], parity_pipe["data"]
    hf_root = tmp_path_factory.mktemp("hf_start")
    dirs = dict(untied=sharded(tiny_hf, hf_root / "untied"), tied=sharded(tiny_tied_hf, hf_root / "tied"))
    runs = {"untied": train_args(dirs["untied"], data, str(root / "hf_untied"), **PIPE, save_steps=2)}
    tied = dict(gradient_accumulation_steps=2, ds_config="zero1", max_steps=2)
    layouts = dict(tied=dict(num_stages=2), tied_tp=dict(num_stages=2, tensor_parallel=2, loss_chunk_tokens=16))
    for name, layout in layouts.items():
        for run, model in ((name, dirs["tied"]), (f"{name}_ckpt", tiny_tied_ckpt)):
            runs[run] = train_args(model, data, str(root / f"hf_{run}"), **tied, **layout)
    out, seconds = dict(root=root, dirs=dirs, args=runs["untied"]), {}
    for name, args in runs.items():
        start = time.time()
        out[name] = train_run(root, f"hf_{name}", 4, args)
        seconds[name] = time.time() - start
    print(f"[hf_start] launches (s): {', '.join(f'{k} {v:.1f}' for k, v in seconds.items())}")
    return out


@pytest.mark.multirank
def test_a_run_from_sharded_safetensors_is_the_run_from_layer_files(hf_runs):
    root = hf_runs["root"]
    equal_runs(str(root / "hf_untied"), str(root / "pipe"), list(range(1, 6)))
    for name in ("tied", "tied_tp"):
        equal_runs(str(root / f"hf_{name}"), str(root / f"hf_{name}_ckpt"), [1, 2])
    dirs = hf_runs["dirs"]
    for run, hf in (("untied", dirs["untied"]), ("tied", dirs["tied"]), ("tied_tp", dirs["tied"])):
        log = hf_runs[run].stdout  # every rank read its stage from the shards
        assert log.count(f"safetensors files of {hf} in") == 4, log[-3000:]
    assert read_metrics(str(root / "hf_tied_tp"))[0]["layout"]["tensor"] == 2


@pytest.mark.multirank
def test_its_first_checkpoint_resumes_reshards_and_exports(hf_runs, tmp_path):
    run = str(hf_runs["root"] / "hf_untied")
    assert sorted(n for n in os.listdir(run) if n.startswith("global_step")) == [
        "global_step2",
        "global_step4",
        "global_step5",
    ]
    # resumed from step 2 (the first checkpoint), steps 3-5 are the run's, bit for bit
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed, ignore=shutil.ignore_patterns("global_step4", "global_step5", ".run.lock"))
    (resumed / "latest").write_text("global_step2")
    args = [a for a in hf_runs["args"] if not a.startswith("output_dir=")] + [f"output_dir={resumed}"]
    proc = train_run(tmp_path, "resumed", 4, args)
    assert "steps 3..5 (resumed from global_step2)" in proc.stdout
    equal_runs(run, str(resumed), [3, 4, 5])

    convert2ckpt = load_entry_point("convert2ckpt.py")
    step2 = os.path.join(run, "global_step2")
    config = load_config(run)
    export = str(tmp_path / "export")
    assert convert2ckpt.main(["--to-hf", "--input", run, "--tag", "global_step2", "--output", export]) == 0
    exported = hf_tensors(export)
    for info in spec_layout(config):
        if info.owns_file:
            for key, t in load_layer_file(os.path.join(step2, layer_file_name(info.index))).items():
                assert torch.equal(exported[info.hf_prefix + key], t), key
    portable = str(tmp_path / "portable")
    assert convert2ckpt.main(["--reshard", "--input", run, "--tag", "global_step2", "--output", portable]) == 0
    weight = load_layer_file(os.path.join(step2, layer_file_name(3)))["mlp.up_proj.weight"]
    with safe_open(os.path.join(portable, "global_step2", "optimizer_03.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("mlp.up_proj.weight.fp32").view(weight.shape), weight)  # stored flat
