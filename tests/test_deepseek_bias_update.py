"""DeepSeek-V3's router-bias update in training (moe.bias_update_speed) equals the rule written out: the step's wiring
(training/moe_balance.py) against a DeepseekV3ForCausalLM loop over several steps, recomputation and eval passes not
counted; the bias kept by a checkpoint; the knob refused where it moves nothing; a train.py run on CPU ranks (with the
sequence-wise balance loss on too, logged as tests/test_deepseek_sequence_balance.py's formula gives it)."""

from __future__ import annotations

import pytest
import torch

from models.families import moe_spec
from parallel.layout import Layout
from parallel.stage import build_pipeline_model, pipeline_topology
from tests.test_family_deepseek_v3 import BIAS, deepseek, step_loads
from tests.test_stage_parity import copy_hf_weights, parity_batch
from training.moe_balance import BiasBalancer, bias_update_problems

SPEED = 0.01


def stage_model(config, hf, interval: int = 0):
    """One rank's whole pipeline module with ``hf``'s weights (``interval``: activation checkpointing's)."""
    layout = Layout(stages=1, dp=1, loss_chunk=16)
    model = build_pipeline_model(config, pipeline_topology(layout), layout, activation_checkpoint_interval=interval)
    copy_hf_weights(model.forward_funcs, config, hf.state_dict())
    model._precompute_checkpointable_values()  # as DeepSpeed's pipeline engine does before the first step
    return model


def biases(model) -> dict[int, torch.Tensor]:
    """Spec index -> its router bias, of the routed layers of ``model`` (a pipeline module)."""
    funcs = enumerate(model.forward_funcs)
    return {i: f.get_buffer(BIAS).clone() for i, f in funcs if hasattr(getattr(f, "mlp", None), "gate")}


def test_the_step_wiring_equals_the_rule_written_out(one_rank):
    """Three AdamW steps of two micro-batches each, activation checkpointing on and an eval forward between steps:
    the balancer's loads are the training forwards' (counted once) and each bias moves by speed x sign(mean - load),
    as the loop written out beside DeepseekV3ForCausalLM moves it; a step the optimizer skipped moves none."""
    config, hf = deepseek()
    model = stage_model(config, hf, interval=1)
    model.train()
    balancer = BiasBalancer.of(model, config, SPEED)
    assert BiasBalancer.of(model, config, 0.0) is None  # speed 0: nothing counted, nothing moved
    loads = step_loads(hf)
    opt_ref, opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (hf, model))
    initial = biases(model)
    for step in range(3):
        for _ in range(2):  # the step's micro-batches
            input_ids, position_ids, labels = parity_batch(config.vocab_size, packed=False)
            hf(input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False).loss.backward()
            model.loss_fn(model((input_ids, position_ids)), labels).backward()
        opt_ref.step(), opt.step(), opt_ref.zero_grad(), opt.zero_grad()
        ours = balancer.after_step()
        with torch.no_grad():
            for layer, load in loads.items():
                load = load.float()
                hf.get_buffer(f"model.layers.{layer}.{BIAS}").add_(SPEED * torch.sign(load.mean() - load))
                assert torch.equal(ours[layer + 1], load.long()), (step, layer)
            model.eval()  # an eval pass: not counted
            model((input_ids, position_ids))
            model.train()
        assert sorted(ours) == [layer + 1 for layer in moe_spec(config).moe_layers]
        loads.clear()
    for index, bias in biases(model).items():
        torch.testing.assert_close(bias, hf.get_buffer(f"model.layers.{index - 1}.{BIAS}"), rtol=0, atol=1e-7)
        assert (bias - initial[index]).abs().max() >= SPEED  # moved
    before = biases(model)
    model((input_ids, position_ids))
    assert balancer.after_step(applied=False)  # counted, not applied
    assert all(torch.equal(before[i], b) for i, b in biases(model).items())
    balancer.remove()


def test_a_checkpoint_keeps_the_moved_bias(one_rank, tmp_path):
    """DeepSpeed's layer files (save_state_dict, as save_checkpoint writes them) hold the bias, a persistent buffer,
    and load_state_dir (resume's load_checkpoint) puts it back in a fresh model."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    config, hf = deepseek()
    model = stage_model(config, hf)
    with torch.no_grad():
        for index in biases(model):
            model.forward_funcs[index].get_buffer(BIAS).add_(0.125)
    engine = TorchCheckpointEngine()
    model.checkpoint_parallel_write_pipeline = False  # what DeepSpeed's engine sets from its config
    model.save_state_dict(str(tmp_path / "ckpt"), engine)
    fresh = stage_model(config, deepseek(seed=1)[1])
    assert any(not torch.equal(a, b) for a, b in zip(biases(fresh).values(), biases(model).values()))
    fresh.load_state_dir(str(tmp_path / "ckpt"), engine)
    assert all(torch.equal(a, b) for a, b in zip(biases(fresh).values(), biases(model).values(), strict=True))


def test_the_knob_is_refused_where_it_moves_nothing():
    from models.tiny import tiny_config

    assert bias_update_problems(0.001, tiny_config("deepseek_v3")) == []
    assert bias_update_problems(0.0, tiny_config("llama")) == []
    (line,) = bias_update_problems(0.001, tiny_config("qwen3_moe"))
    assert line.startswith("moe.bias_update_speed 0.001: qwen3_moe has no router bias") and line.endswith(
        "set moe.bias_update_speed=0"
    )
    (line,) = bias_update_problems(-0.5, tiny_config("deepseek_v3"))
    assert line.startswith("moe.bias_update_speed -0.5 < 0: set it >= 0")


@pytest.mark.multirank  # starts DeepSpeed ranks
def test_train_py_moves_the_bias_as_a_single_process_replay(tmp_path, tokenizer_dir):
    """train.py, data parallel 2 (the loads summed over both ranks), activation checkpointing, three fp32 steps at
    speed 0.01 with moe.sequence_balance_coef 0.1: the checkpoint's biases equal a DeepseekV3ForCausalLM + AdamW loop
    over the same global batches with the rule written out after each step and the balance loss written out (coef x
    its mean over the step's micro-batches, a document per unpacked row); every step logs expert_load_max and
    sequence_balance_loss, that mean."""
    from transformers import AutoModelForCausalLM

    from models.files.hf_convert import hf_to_stages
    from models.loss import label_tokens
    from models.tiny import write_uneven_sft
    from tests.support.models import make_hf_dir
    from tests.support.parity import SFT_OPTIM, cached_rows, global_batches, hf_loss, parity_args, trained_weights
    from tests.support.ranks import train_run
    from tests.support.runs import read_metrics
    from tests.test_deepseek_sequence_balance import routing, spans, written_out
    from training.configuration.schema import OptimConfig, TrainConfig
    from training.optim import param_groups

    steps, seq, gas, coef = 3, 64, 2, 0.1
    data = str(tmp_path / "train.jsonl")
    write_uneven_sft(data, 40, seed=0)
    hf_dir = make_hf_dir(tmp_path, tokenizer_dir, "hf", model_type="deepseek_v3")
    hf_to_stages(hf_dir, str(tmp_path / "ckpt"))
    args = parity_args(str(tmp_path / "ckpt"), data, str(tmp_path / "run"), seq, 2, steps, SFT_OPTIM)
    args += ["data.format=sft", "data.pad_to_multiple_of=0", "activation_checkpoint_interval=1", "ds_config=zero1"]
    args += [f"gradient_accumulation_steps={gas}", f"moe.bias_update_speed={SPEED}"]
    args += [f"moe.sequence_balance_coef={coef}"]
    train_run(tmp_path, "run", 2, args)

    batches = global_batches(cached_rows(str(tmp_path / "cache"), data), dp=2, gas=gas, steps=steps)[0]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")
    optim = TrainConfig(optim=OptimConfig(**SFT_OPTIM)).optim
    opt = torch.optim.AdamW(param_groups(model, optim.weight_decay), lr=optim.lr, betas=optim.betas, eps=optim.eps)
    loads, kept, balances = step_loads(model), routing(model), []
    for micro_batches in batches:
        n = torch.tensor(sum(label_tokens(labels) for _, labels in micro_batches))
        loss, balance = 0.0, []
        for mb in micro_batches:
            loss = loss + hf_loss(model, mb, n)
            balance.append(sum(written_out(lo, ch, spans(mb[0][1])) for lo, ch in kept.values()))
        (loss + coef * torch.stack(balance).mean()).backward()
        balances.append(torch.stack(balance).mean().item())
        opt.step(), opt.zero_grad()
        with torch.no_grad():
            for layer, load in loads.items():
                load = load.float()
                model.get_buffer(f"model.layers.{layer}.{BIAS}").add_(SPEED * torch.sign(load.mean() - load))
        loads.clear()
    saved = trained_weights(str(tmp_path / "run"), model.config)
    layers = moe_spec(model.config).moe_layers
    for layer in layers:
        key = f"model.layers.{layer}.{BIAS}"
        torch.testing.assert_close(saved[key], model.get_buffer(key), rtol=0, atol=1e-7, msg=key)
        assert saved[key].abs().max() >= SPEED  # moved from the converted 0
        key = f"model.layers.{layer}.mlp.gate.weight"  # trained by the balance loss's gradient too
        torch.testing.assert_close(saved[key], model.get_parameter(key), rtol=0, atol=1e-5, msg=key)
    metrics = read_metrics(str(tmp_path / "run"))
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["expert_load_max"] >= 1.0 for m in metrics)
    assert max(abs(m["sequence_balance_loss"] - b) for m, b in zip(metrics, balances)) < 1e-5, balances
