"""Fused GPU kernels on the stages' Hugging Face modules: ``kernels=liger`` (Liger-Kernel's Triton kernels, CUDA only;
``liger-kernel`` is a GPU extra, not a dependency: tools/gpu_wheels.sh carries its wheel to the GPU machine).

Liger's ``apply_liger_kernel_to_llama(model=...)`` patches a loaded ``LlamaForCausalLM`` in place: each decoder
layer's ``mlp`` gets ``LigerSwiGLUMLP``'s forward (silu(gate) x up in one kernel) and its RMSNorms
``LigerRMSNorm``'s (``_patch_swiglu_module``, ``_patch_rms_norm_module``), and the family's module-level
``apply_rotary_pos_emb`` becomes ``liger_rotary_pos_emb`` for the whole process. :func:`apply_kernels` does the same
to the decoder-layer stages a rank holds, with Liger's own two helpers, except RoPE: each attention's forward is
Hugging Face's own code bound with ``apply_rotary_pos_emb`` resolved to Liger's, so only those layers change (a
Hugging Face model beside them in the process, the parity tests' reference, keeps its own).

Weights, state-dict keys and checkpoints are untouched: only forwards change. The final norm keeps Hugging Face's
forward (its stage forward also passes routing statistics on; it is one of 2L + 1 norms). Families: the dense ones
whose modules Liger patches this way (llama, mistral, qwen2, qwen3, the last with its per-head q/k norms); the MoE
families (Liger swaps their experts module, which expert parallelism splits) and Llama 4 (complex RoPE) are refused.

``loss_impl=liger``, Liger's fused linear cross entropy, is the loss's (models/loss.py's ``liger_head_losses``); its
rules are here, beside these (:func:`loss_impl_problems`).
"""

from __future__ import annotations

import importlib.util
import types
from collections.abc import Iterable

import torch
from torch import nn

from models.llama_pipe import DecoderLayerPipe
from models.loss import liger_softcap_problem

KERNELS = ("none", "liger")
LIGER_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
LIGER_PARTS = ("rms_norm", "swiglu", "rope")


def kernel_problems(kernels: str, model_config, cuda: bool | None = None, importable: bool | None = None) -> list[str]:
    """Why ``kernels`` cannot run here, before any process group (training/configuration/validate.py): no CUDA device,
    no liger_kernel package, a family or activation Liger's modules do not cover. ``cuda``/``importable``: the
    machine's answers unless given."""
    if kernels == "none":
        return []
    problems = liger_unavailable(
        "kernels=liger", "kernels=none (the Hugging Face modules as they are)", cuda, importable
    )
    model_type = getattr(model_config, "model_type", None)
    if model_config is not None and model_type not in LIGER_FAMILIES:
        problems.append(
            f"kernels=liger covers the dense families {', '.join(LIGER_FAMILIES)}, not model_type {model_type!r} "
            "(Liger replaces a MoE model's experts module, which expert parallelism splits; Llama 4's RoPE is "
            "complex-valued): set kernels=none"
        )
    elif model_config is not None and getattr(model_config, "hidden_act", "silu") not in ("silu", "swish"):
        problems.append(
            f"kernels=liger's SwiGLU kernel computes silu(gate) x up, and this model's hidden_act is "
            f"{model_config.hidden_act!r}: set kernels=none"
        )
    return problems


def liger_unavailable(
    setting: str, instead: str, cuda: bool | None = None, importable: bool | None = None
) -> list[str]:
    """Why Liger's kernels cannot run on this machine (no CUDA device, no liger_kernel package), each naming
    ``setting`` and the value to set ``instead``; ``cuda``/``importable``: the machine's answers unless given."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    importable = importlib.util.find_spec("liger_kernel") is not None if importable is None else importable
    problems = []
    if not cuda:
        problems.append(
            f"{setting} runs Liger's Triton kernels, which need a CUDA GPU, and this machine has none: set {instead}"
        )
    if not importable:
        problems.append(
            f"{setting} needs the liger_kernel package, which is not installed: pip install liger-kernel==0.8.5 "
            f"(a GPU extra; tools/gpu_wheels.sh makes its wheel), or set {instead}"
        )
    return problems


def loss_impl_problems(
    loss_impl: str,
    loss_chunk_tokens: int,
    engine=None,
    cuda: bool | None = None,
    importable: bool | None = None,
    softcap: float | None = None,
) -> list[str]:
    """Why ``loss_impl=liger`` (Liger's fused linear cross entropy on the last stage, models/loss.py's
    ``liger_head_losses``) cannot run, before any process group (training/configuration/validate.py): no CUDA or no
    liger_kernel (:func:`liger_unavailable`), the head handing over logits (``loss_chunk_tokens=0``), or DeepSpeed's
    data-parallel engine (``engine``: the run's, parallel/engines.py; num_stages=1 with ZeRO 2/3, whose loss is built
    without the layout). A head split by vocabulary is tensor parallelism's rule (parallel/tensor_parallel.py). The
    rest runs as the chunked loss does, from the same (hidden, weight) and labels: sequence parallelism (each rank's
    slice of the targets), DPO (per-token losses), the MoE router loss (added after), DualPipeV, LoRA, compile.
    ``softcap`` (Gemma's final_logit_softcapping, models.loss.logit_softcap) is refused: Liger's cap is unchecked.
    """
    if loss_impl == "chunked":
        return []
    instead = "loss_impl=chunked (the chunked loss, the same numbers)"
    problems = liger_unavailable("loss_impl=liger", instead, cuda, importable)
    if loss_chunk_tokens < 1:
        problems.append(
            f"loss_impl=liger takes the hidden states and the LM head weight from the last stage, which hands over "
            f"whole logits with loss_chunk_tokens={loss_chunk_tokens}: set loss_chunk_tokens > 0 (e.g. 1024; Liger "
            f"sizes its own chunks), or set {instead}"
        )
    if engine is not None:
        problems += engine.pipeline_only(
            "loss_impl=liger with num_stages=1 and ZeRO 2/3 (DeepSpeed's data-parallel engine): it is wired into the "
            f"pipeline engine's last stage only: use ds=zero1 (or zero0; num_stages=1 then runs the pipeline "
            f"engine), or set {instead}"
        )
    if softcap is not None:
        problems.append(liger_softcap_problem(softcap))
    return problems


def apply_kernels(modules: Iterable[nn.Module], kernels: str, parts: Iterable[str] = LIGER_PARTS) -> int:
    """Put ``kernels``'s forwards on every decoder-layer stage among ``modules`` and their submodules (a rank's
    pipeline module, or a list of stage modules); ``parts``: which of Liger's kernels (all three unless a test picks
    one). Returns the number of decoder layers changed; 0 for ``kernels=none``."""
    if kernels == "none":
        return 0
    parts = set(parts)
    unknown = parts - set(LIGER_PARTS)
    if kernels != "liger" or unknown:
        raise ValueError(f"kernels {kernels!r}, parts {sorted(unknown)}: choose from {KERNELS}, {LIGER_PARTS}")
    # Liger's own helpers, the ones apply_liger_kernel_to_llama(model=...) calls on each layer.
    from liger_kernel.transformers.monkey_patch import (
        LigerSwiGLUMLP,
        _patch_rms_norm_module,
        _patch_swiglu_module,
        liger_rotary_pos_emb,
    )

    layers = [m for root in modules for m in root.modules() if isinstance(m, DecoderLayerPipe)]
    for layer in dict.fromkeys(layers):  # a module reached twice (a tied piece) is changed once
        if "swiglu" in parts:
            _patch_swiglu_module(layer.mlp, LigerSwiGLUMLP)
        if "rms_norm" in parts:
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            norms += [getattr(layer.self_attn, n) for n in ("q_norm", "k_norm") if hasattr(layer.self_attn, n)]
            for norm in norms:  # Liger's defaults for these families: casting_mode "llama", offset 0, in place
                _patch_rms_norm_module(norm)
        if "rope" in parts:
            rebind_global(layer.self_attn, "apply_rotary_pos_emb", liger_rotary_pos_emb)
    return len(dict.fromkeys(layers))


_REBOUND: dict[tuple, types.FunctionType] = {}


def rebind_global(module: nn.Module, name: str, value) -> None:
    """``module.forward`` becomes its class's forward with the global ``name`` resolved to ``value``: the same code
    (compiled, traced and checkpointed as before), one name changed, for this instance only. Every instance shares one
    rebound function and its globals: torch.compile caches its graphs per code object and installs them in the
    globals of the frame that compiled them, so a copy per layer would leave the other layers without them."""
    forward = type(module).forward
    if name not in forward.__code__.co_names:
        raise TypeError(f"{type(module).__name__}.forward does not call {name}: Liger's RoPE cannot replace it there")
    key = (forward, name, value)
    if key not in _REBOUND:
        scope = {**forward.__globals__, name: value}
        code, defaults, closure = forward.__code__, forward.__defaults__, forward.__closure__
        rebound = types.FunctionType(code, scope, forward.__name__, defaults, closure)
        rebound.__kwdefaults__ = forward.__kwdefaults__
        _REBOUND[key] = rebound
    module.forward = types.MethodType(_REBOUND[key], module)
