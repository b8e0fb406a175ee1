"""Gemma 3's text model (``model_type`` gemma3_text, ``Gemma3ForCausalLM``): what differs from Llama outside its
decoder layer, and the values of its config the stages refuse.

Inside ``Gemma3DecoderLayer`` (run as it is, models/llama_pipe.py's ``Gemma3DecoderLayerPipe``): RMSNorms before and
after attention and the MLP, per-head q/k norms, scores scaled by ``query_pre_attn_scalar ** -0.5`` (not
``head_dim``), sliding-window layers (``layer_types``) beside full ones. Outside it, each a flag of its
``models.families.Family`` entry:

- the embedding multiplies its lookups by ``sqrt(hidden_size)`` in the weight's dtype (:func:`scaled_lookup`); a
  tied LM head uses the weight unscaled;
- the rotary embedding takes the layer's attention type: a RoPE base per type (``rope_parameters``:
  ``sliding_attention`` 10k, ``full_attention`` 1M, with linear scaling 8 on the 4B-27B full layers);
- the RMSNorm scales by ``1 + weight``: a model from scratch starts with weights 0.

Packed rows: the per-document attention (models/attention.py) takes the scaling and the window Gemma's attention
passes, so packed documents are attended as apart (tests/test_family_gemma3.py). ``attn_logit_softcapping`` is
ignored by ``Gemma3Attention`` itself (it passes no softcap to any attention function), so by the stages too;
``final_logit_softcapping`` (unset in the releases) caps the logits in every loss and in generation (models/loss.py's
``logit_softcap``).
"""

from __future__ import annotations

import math

import torch
from transformers import PretrainedConfig


def scaled_lookup(hidden: torch.Tensor, scale: float) -> torch.Tensor:
    """``hidden`` [B,S,H] times ``scale`` as ``Gemma3TextScaledWordEmbedding`` multiplies: the factor an fp32 tensor
    cast to the hidden states' dtype (sqrt(3072) is 55.5 in bf16), so the same rounding in every dtype."""
    return hidden * torch.tensor(scale, dtype=torch.float32).to(hidden.dtype)


def gemma3_problems(config: PretrainedConfig, where: str, fix) -> list[str]:
    """What of a gemma3_text config the stages cannot compute as ``Gemma3ForCausalLM`` does, one line each."""
    problems = []
    for kind, rope in (getattr(config, "rope_parameters", None) or {}).items():  # one per attention type
        theta, factor = rope.get("rope_theta"), rope.get("factor")
        if not (isinstance(theta, (int, float)) and math.isfinite(theta) and theta > 0):
            problems.append(
                f"{where}: rope_parameters.{kind}.rope_theta {theta!r} is out of range: "
                + fix(f"rope_parameters.{kind}.rope_theta", "> 0 (10000 on sliding layers, 1e6 on full ones)")
            )
        if factor is not None and not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor >= 1):
            problems.append(
                f"{where}: rope_parameters.{kind}.factor {factor!r} is out of range: "
                + fix(f"rope_parameters.{kind}.factor", ">= 1 (the context's extension; 8 on Gemma 3's full layers)")
            )
    if getattr(config, "use_bidirectional_attention", False):
        problems.append(
            f"{where}: use_bidirectional_attention true (an embedding model's attention, each token seeing the "
            "ones after it) is not a causal language model the stages train: "
            + fix("use_bidirectional_attention", "false")
        )
    return problems
