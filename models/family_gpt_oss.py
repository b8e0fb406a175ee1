"""What gpt-oss (``GptOssForCausalLM``) needs beyond its Hugging Face modules: attention with its learned sinks over
packed documents, its from-scratch initialisation, and the reading of its MXFP4 release.

Sinks: each head h has a learned logit ``sinks[h]`` that joins every query's softmax as one more column, its value
zero (``eager_attention_forward`` of modeling_gpt_oss: the probabilities of the real keys sum to less than 1).
transformers' ``sdpa`` drops it (its ``s_aux`` keyword is swallowed). :func:`sink_attention` computes it with SDPA
itself: one extra key in front of each document, whose score is the sink, by one extra feature, ``sinks[h] / scale``
on the queries and 1 on that key, 0 on every real key (the scores of the real keys unchanged), and a zero value;
the causal mask aligned bottom-right (``causal_lower_right``) lets every query see it. The sinks' gradient comes
through the queries' extra feature. So per-document attention, packed rows and sliding windows keep the kernels
(no S x S mask) and the sinks, and packed documents equal the documents apart.

MXFP4: the released checkpoints hold the experts as 4-bit values with a power-of-two scale per 32
(``*_blocks``, ``*_scales``; ``quantization_config.quant_method`` mxfp4). models/files/hf_convert.py's
``HFTensorSource`` shows each pair as the tensor it stands for, dequantized to bf16 (:func:`dequantize_mxfp4`), so the
conversion and the start from a Hugging Face directory read the release as they read a bf16 one; the config loses
its ``quantization_config`` (the weights written are never MXFP4). The cost: bf16 experts are 2 bytes a parameter
where MXFP4 stores 4.25 bits (32 values of 4 bits and one 8-bit scale), 3.8x; gpt-oss-20b's 19.1 B expert parameters
go from 10.2 GB to 38.2 GB, gpt-oss-120b's 114.7 B from 60.9 GB to 229.4 GB.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers.models.gpt_oss import modeling_gpt_oss

# Features added to queries and keys: the sink's, then zeros, so the head size stays a multiple of 8 (the kernels')
_EXTRA = 8

# Parameters Hugging Face's GptOssPreTrainedModel._init_weights draws from N(0, initializer_range), by module class;
# the module's other own parameters (the experts' biases) start at 0.
NORMAL_PARAMETERS = {
    modeling_gpt_oss.GptOssExperts: ("gate_up_proj", "down_proj"),
    modeling_gpt_oss.GptOssTopKRouter: ("weight", "bias"),
    modeling_gpt_oss.GptOssAttention: ("sinks",),
}


def normal_parameter_names(module: torch.nn.Module) -> tuple[str, ...] | None:
    """The own parameters of a gpt-oss module drawn from N(0, initializer_range) (its others start at 0), or None
    for a module of another class."""
    for cls, names in NORMAL_PARAMETERS.items():
        if isinstance(module, cls):
            return names
    return None


def _with_sink_key(q, k, v, sinks: torch.Tensor, scale: float):
    """q [B,Hq,L,D], k/v [B,Hkv,M,D] -> q [B,Hq,L,D+8], k [B,Hkv,M+1,D+8], v [B,Hkv,M+1,D]: a sink key first, whose
    score for head h is ``sinks[h]``, and whose value is zero."""
    batch, heads, length, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    sink = (sinks.to(q.dtype) / scale).view(1, heads, 1, 1).expand(batch, heads, length, 1)
    q = torch.cat([q, sink, q.new_zeros(batch, heads, length, _EXTRA - 1)], dim=-1)
    sink_key = k.new_zeros(batch, kv_heads, 1, dim + _EXTRA)
    sink_key[..., dim] = 1.0
    k = torch.cat([sink_key, torch.cat([k, k.new_zeros(batch, kv_heads, keys, _EXTRA)], dim=-1)], dim=2)
    v = torch.cat([v.new_zeros(batch, kv_heads, 1, dim), v], dim=2)
    return q, k, v


def _attend(q, k, v, sinks, scale: float, dropout: float, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention with the sink (q [B,Hq,L,D], k/v [B,Hkv,M,D], M >= L, the queries the last L keys'), or with
    ``allowed`` [L,M] bool where given -> [B,Hq,L,D]."""
    length, keys = q.shape[2], k.shape[2]
    q, k, v = _with_sink_key(q, k, v, sinks, scale)
    if allowed is None:
        mask = causal_lower_right(length, keys + 1)  # query i: the sink and keys 0..i + M - L
    else:
        mask = torch.cat([allowed.new_ones(length, 1), allowed], dim=1)  # [L,M+1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=True)


def _window(q, k, v, sinks, scale: float, dropout: float, window: int) -> torch.Tensor:
    """One document (q [1,Hq,d,D]) where query t sees the sink and keys t-window+1..t: blocks of ``window`` queries
    against their keys, as models/attention.py's ``_window_blocks``."""
    d = q.shape[2]
    out = []
    for start in range(0, d, window):
        end = min(start + window, d)
        first = max(0, start - window + 1)
        t = torch.arange(start, end, device=q.device)[:, None]
        j = torch.arange(first, end, device=q.device)[None, :]
        allowed = (j <= t) & (j > t - window)  # [c,k]
        out.append(_attend(q[:, :, start:end], k[:, :, first:end], v[:, :, first:end], sinks, scale, dropout, allowed))
    return torch.cat(out, dim=2)


def sink_attention(query, key, value, sinks, spans, window: int, scaling: float | None, dropout: float):
    """Causal attention with per-head sinks within each document of ``spans`` (each row's (start, end) token
    offsets, models/attention.py's ``Documents.spans``), in a sliding ``window`` (0: none): query [B,Hq,S,D],
    key/value [B,Hkv,S,D], sinks [Hq] -> [B,S,Hq,D]."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if not window and all(len(row) == 1 for row in spans):  # one document a row: one call
        return _attend(query, key, value, sinks, scale, dropout).transpose(1, 2).contiguous()
    rows = []
    for b, row in enumerate(spans):
        docs = []
        for start, end in row:
            q, k, v = (t[b : b + 1, :, start:end] for t in (query, key, value))
            if window and end - start > window:
                docs.append(_window(q, k, v, sinks, scale, dropout, window))
            else:
                docs.append(_attend(q, k, v, sinks, scale, dropout))
        rows.append(torch.cat(docs, dim=2))
    return torch.cat(rows).transpose(1, 2).contiguous()


# What the MXFP4 experts are dequantized to: the precision of the model's own weights (transformers dequantizes so too)
MXFP4_DTYPE = torch.bfloat16
_BLOCKS, _SCALES = "_blocks", "_scales"


def is_mxfp4(raw_config: dict) -> bool:
    """Whether a config.json's ``quantization_config`` is MXFP4 (gpt-oss's release)."""
    quantized = raw_config.get("quantization_config")
    return isinstance(quantized, dict) and quantized.get("quant_method") == "mxfp4"


def mxfp4_tensors(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """The tensors a checkpoint holds in MXFP4, from its tensors' shapes: {the model's key: (its blocks' key, its
    scales' key, its shape)}. ``X_blocks`` [E,out,G,16] uint8 (two 4-bit values a byte, G groups of 32 along the
    input) and ``X_scales`` [E,out,G] uint8 (a power of two per group) make ``X`` [E,in,out], in = 32 G (the
    transpose: the experts' weights are stored input first, gate_up_proj [E,H,2I])."""
    found = {}
    for key, shape in shapes.items():
        if key.endswith(_BLOCKS) and (scales := key.removesuffix(_BLOCKS) + _SCALES) in shapes and len(shape) == 4:
            experts, out, groups, pairs = shape
            found[key.removesuffix(_BLOCKS)] = (key, scales, (experts, groups * pairs * 2, out))
    return found


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One MXFP4 tensor as :data:`MXFP4_DTYPE` (transformers' own dequantization, exact: every 4-bit value times a
    power of two is a bf16 number): blocks [E,out,G,16], scales [E,out,G] -> [E,32 G,out]."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=MXFP4_DTYPE)


def mxfp4_refusal(path: str, model_type: str) -> str:
    """The line refusing MXFP4 weights of a family other than gpt-oss."""
    return (
        f"{path}: MXFP4 weights (quantization_config: mxfp4) are read for gpt_oss only, not {model_type}: convert "
        "the model's unquantized release"
    )
