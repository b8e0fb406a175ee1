"""LoRA injection: Hugging Face PEFT's own LoRA layers put into the decoder layers of a pipeline stage.

Each rank injects PEFT's LoRA layers (``peft.inject_adapter_in_model``) into the decoder layers of its own
stage, after the frozen base weights are loaded there, so no rank ever builds more than its stage. A
spec's state-dict keys then carry PEFT's names (``self_attn.q_proj.lora_A.default.weight``); their adapter-file
keys are models/files/peft_adapter.py's, and which ``peft`` settings are valid is models/lora_rules.py's.
"""

from __future__ import annotations

import torch
from torch import nn

from models.files.pipeline_dir import full_numel
from models.specs import SpecInfo, spec_layout

ADAPTER_NAME = "default"


def lora_config(peft_cfg, base_model_name_or_path: str | None = None):
    """PEFT's ``LoraConfig`` of the ``peft`` settings (training/configuration/schema.PeftConfig)."""
    from peft import LoraConfig

    return LoraConfig(
        r=peft_cfg.r,
        lora_alpha=peft_cfg.alpha,
        lora_dropout=peft_cfg.dropout,
        target_modules=list(peft_cfg.target_modules),
        modules_to_save=list(peft_cfg.modules_to_save) or None,
        use_rslora=peft_cfg.use_rslora,
        use_dora=peft_cfg.use_dora,
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name_or_path,
    )


def trains_fully(info: SpecInfo, peft_cfg) -> bool:
    """Whether the spec is one of ``peft.modules_to_save`` (trained fully, saved whole in the adapter)."""
    return (info.kind == "embed" and "embed_tokens" in peft_cfg.modules_to_save) or (
        info.kind == "head" and "lm_head" in peft_cfg.modules_to_save
    )


def _input_needs_grad(module: nn.Module, inputs, output):
    """Forward hook on a frozen embedding: its hidden states require grad, so a recomputed (reentrant)
    chunk of decoder layers after it still sends gradients to its LoRA weights (Hugging Face's
    ``enable_input_require_grads``)."""
    if isinstance(output, tuple) and output[0].is_floating_point() and not output[0].requires_grad:
        output[0].requires_grad_(True)
    return output


def apply_lora(
    local: list[tuple[int, nn.Module]],
    config,
    peft_cfg,
    seed: int,
    compute_dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> None:
    """Freeze this stage's base weights and inject PEFT's LoRA layers into its decoder layers, in place;
    with ``peft.quantize=nf4`` (QLoRA) each decoder layer's linear layers are quantised first, on ``device``
    (:func:`quantize_nf4_`), and PEFT wraps them with its bitsandbytes LoRA layers.

    ``local``: the stage's (spec index, module) pairs (``models.files.pipeline_dir.local_modules``). PEFT draws
    the initial ``lora_A`` from torch's generator, seeded per spec here (as ``init_weights_`` is), so every
    data-parallel replica starts from the same adapters whatever the partitioning.
    """
    from peft import inject_adapter_in_model

    layout = spec_layout(config)
    for index, module in local:
        info = layout[index]
        module.requires_grad_(trains_fully(info, peft_cfg))
        if info.kind == "decoder":
            if peft_cfg.quantize == "nf4":
                quantize_nf4_(module, compute_dtype, device)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + info.file_index)
                inject_adapter_in_model(lora_config(peft_cfg), module, adapter_name=ADAPTER_NAME)
        elif info.kind == "embed" and not trains_fully(info, peft_cfg):
            module.register_forward_hook(_input_needs_grad)


def quantize_nf4_(module: nn.Module, compute_dtype: torch.dtype, device: str | torch.device) -> None:
    """Replace every ``nn.Linear`` of ``module`` by bitsandbytes' ``Linear4bit`` holding its weight in NF4,
    quantised as it moves to ``device``: what transformers' ``BitsAndBytesConfig(load_in_4bit=True,
    bnb_4bit_quant_type="nf4")`` loading does (bit for bit, tests/test_lora.py), layer by layer, so the
    device never holds the stage at its stored precision. The quantisation state (absmax, the NF4 code)
    is dropped from the module's state dict: a checkpoint saves no part of the frozen base."""
    import bitsandbytes as bnb

    for name, child in list(module.named_modules()):
        if type(child) is not nn.Linear:
            continue
        parent, _, attr = name.rpartition(".")
        with torch.device("meta"):  # no fp32 init of a weight about to be replaced
            q = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                child.bias is not None,
                compute_dtype,
                compress_statistics=False,  # transformers' default: no double quantisation
                quant_type="nf4",
                quant_storage=torch.uint8,
            )
        q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, **q.weight.__dict__).to(device)
        if child.bias is not None:
            q.bias = nn.Parameter(child.bias.data.to(device), requires_grad=False)
        # On CPUs with AVX512-BF16, bitsandbytes repacks a layer for a bf16 kernel at its first eval-mode
        # forward, for good: an eval during training would change the precision of every later step.
        q.support_avx512bf16_for_cpu = False
        setattr(module.get_submodule(parent) if parent else module, attr, q)
    module.is_loaded_in_4bit = True  # what PEFT reads (from a whole model, as a rule) to wrap with its bnb layers

    def drop_quant_state(mod, state_dict, prefix, local_metadata):
        # PEFT moves each quantised layer under ``base_layer``; its state keys follow the weight's name.
        weights = [n for n, p in mod.named_parameters() if isinstance(p, bnb.nn.Params4bit)]
        for key in [k for k in state_dict if any(k.startswith(f"{prefix}{w}.") for w in weights)]:
            del state_dict[key]

    module.register_state_dict_post_hook(drop_quant_state)


def base_numel(p: torch.Tensor) -> int:
    """Elements of a frozen base weight: an NF4 one packs two into each byte, its shape is the original's."""
    state = getattr(p, "quant_state", None)
    return state.shape.numel() if state is not None else full_numel(p)


def trainable_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """A module's trained tensors (adapters, modules_to_save), by state-dict key."""
    return {k: p for k, p in module.named_parameters() if p.requires_grad}
