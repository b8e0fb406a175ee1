"""Causal attention over packed documents without an S x S mask.

Hugging Face's decoder layers call the attention function named by ``config._attn_implementation``
(transformers' ``AttentionInterface``) with ``position_ids`` among its keyword arguments. The function
registered here as ``sdpa_documents`` finds the documents of each row where the positions stop counting up
by one (transformers' own rule for packed rows, ``find_packed_sequence_indices``) and attends within each:

- a row with one document and no window cutting in: one causal SDPA call, as transformers' ``sdpa`` makes;
- otherwise, on a CUDA device in half precision, torch's variable-length flash attention
  (``torch.nn.attention.varlen``) over every document of the micro-batch at once;
- otherwise (CPU, fp32) causal SDPA per document, and a sliding window in blocks of ``window`` queries,
  each against its ``2 x window`` keys, so no mask grows with the sequence.

Llama 4's chunked layers (``layer_types`` ``chunked_attention``) attend within chunks of ``attention_chunk_size``
positions: the chunk boundaries (positions that are multiples of the chunk size) cut the documents into more
pieces, each attended causally on its own. The chunks count each document's own positions, as transformers'
``create_chunked_causal_mask`` does for packed rows (it remaps the mask's indices to ``position_ids``), so a packed
document is chunked as it is alone and both attention settings compute what ``Llama4ForCausalLM`` computes.

The dense per-document mask (``attention=dense_mask``, transformers' ``sdpa`` with ``create_causal_mask``)
stays available for comparison: [B,1,S,S] booleans per layer, 16 G entries at 128k tokens.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from models.family_gpt_oss import sink_attention
from models.per_micro_batch import PerMicroBatch

DOCUMENT_ATTENTION = "sdpa_documents"


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """[B,S] int64 -> [B,S] bool: where a document starts (the row's first token, or a position that does not
    continue the previous one by +1, as transformers detects packed sequences)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)  # [B,S]
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


class Documents:
    """The documents of one micro-batch's ``position_ids`` [B,S]: ``spans``, each row's (start, end) token
    offsets, and :meth:`cu_seqlens` for the variable-length kernel."""

    def __init__(self, spans: list[list[tuple[int, int]]]):
        self.spans = spans
        self.longest = max(end - start for row in spans for start, end in row)
        self.whole_rows = all(len(row) == 1 for row in spans)  # every row one document
        self._cu: torch.Tensor | None = None

    def cu_seqlens(self, device: torch.device) -> torch.Tensor:
        """[N+1] int32 on ``device``: where each of the N documents starts, end to end over the rows, then the end
        (a host-to-device copy, which waits for the device: made once)."""
        if self._cu is None or self._cu.device != device:
            lengths = [end - start for row in self.spans for start, end in row]
            self._cu = torch.tensor([0] + lengths, device=device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return self._cu


def find_documents(position_ids: torch.Tensor, chunk: int = 0) -> Documents:
    """The documents of each row; with ``chunk`` > 0, cut as well where a position is a multiple of ``chunk``
    (Llama 4's chunked attention: each piece attends only within itself).

    Finding them reads the positions on the host: on a GPU a sync, which drains the queue of kernels and leaves the
    GPU idle until the host launches the next. Every layer of a stage gets the same ``position_ids`` of a
    micro-batch (activation checkpointing's recomputation too), so the answer is kept (:data:`_FOUND`): one sync per
    micro-batch and stage instead of one per layer and pass."""
    return _FOUND.get(position_ids, chunk, lambda: _documents(position_ids, chunk))


def _documents(position_ids: torch.Tensor, chunk: int) -> Documents:
    spans = []
    seq = position_ids.shape[1]
    cuts = document_starts(position_ids)  # [B,S] bool
    if chunk:
        cuts |= position_ids % chunk == 0
    for row in cuts.cpu():
        starts = row.nonzero().squeeze(1).tolist() + [seq]
        spans.append(list(zip(starts[:-1], starts[1:])))
    return Documents(spans)


# The documents of the position_ids tensors seen last (models/per_micro_batch.py); the bound keeps little memory held
# (B x S int64 each).
_FOUND = PerMicroBatch(kept=16)


def attention_chunk(module: torch.nn.Module) -> int:
    """The chunk size of a decoder layer's attention whose ``layer_types`` entry is ``chunked_attention`` (Llama 4's
    RoPE layers), else 0."""
    config, layer = getattr(module, "config", None), getattr(module, "layer_idx", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None or layer is None or layer_types[layer] != "chunked_attention":
        return 0
    return config.attention_chunk_size


@functools.cache
def _varlen_and_parameters():
    """torch's variable-length flash attention and the names of its parameters, where this torch has it (looked up
    once: every layer's attention asks)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _varlen(window: int):
    """torch's variable-length flash attention, where this torch has it (and takes a window, if one is needed)."""
    varlen_attn, params = _varlen_and_parameters()
    if window and "window_size" not in params:
        return None
    return varlen_attn


def _window_blocks(q, k, v, window: int, scale, dropout: float):
    """Causal attention of one document (q [1,Hq,d,D], k/v [1,Hkv,d,D]) where query t sees keys t-window+1..t:
    blocks of ``window`` queries against their keys, a mask of window x (2 window - 1) at most."""
    d = q.shape[2]
    out = []
    for start in range(0, d, window):
        end = min(start + window, d)
        first = max(0, start - window + 1)
        t = torch.arange(start, end, device=q.device)[:, None]  # [c,1] query positions
        j = torch.arange(first, end, device=q.device)[None, :]  # [1,k] key positions
        allowed = (j <= t) & (j > t - window)  # [c,k] bool
        out.append(
            F.scaled_dot_product_attention(
                q[:, :, start:end],
                k[:, :, first:end],
                v[:, :, first:end],
                attn_mask=allowed,
                dropout_p=dropout,
                scale=scale,
                enable_gqa=True,
            )
        )
    return torch.cat(out, dim=2)  # [1,Hq,d,D]


def _causal(query, key, value, dropout: float, scaling: float | None) -> tuple[torch.Tensor, None]:
    """Causal SDPA over whole rows, as transformers' ``sdpa`` runs it: ([B,S,Hq,D], None)."""
    out = F.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=True
    )  # [B,Hq,S,D]
    return out.transpose(1, 2).contiguous(), None


def document_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    position_ids: torch.Tensor | None = None,
    whole_rows: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B,Hq,S,D], key/value [B,Hkv,S,D] -> ([B,S,Hq,D], None).

    ``attention_mask`` must be None: documents come from ``position_ids`` (the stages build no mask).
    ``whole_rows`` (the decoder layer's :func:`rows_are_whole_documents`, when it knows): every row is one document,
    so no window cutting in, one causal SDPA call, which a compiled layer (compile=true) traces into its graph; the
    documents found otherwise, on the host, outside the graph (:func:`attention_per_document`)."""
    if attention_mask is not None:
        raise ValueError("sdpa_documents takes the documents from position_ids; it was given a mask as well")
    seq = query.shape[2]
    window = sliding_window if sliding_window and sliding_window < seq else 0
    sinks = kwargs.get("s_aux")  # gpt-oss's per-head sinks [Hq] (models/family_gpt_oss.py)
    if whole_rows and not window and sinks is None:
        return _causal(query, key, value, dropout if module.training else 0.0, scaling)
    return attention_per_document(module, query, key, value, dropout, scaling, window, position_ids, sinks)


@torch.compiler.disable
def rows_are_whole_documents(position_ids: torch.Tensor, chunk: int = 0) -> bool:
    """Whether every row of ``position_ids`` [B,S] is one document (no chunk cutting in): host Python, outside a
    compiled layer's graph, which then holds the whole layer for such micro-batches (a guard on the answer)."""
    return find_documents(position_ids, chunk).whole_rows


# Compiled layers (compile=true) run it eagerly between their compiled parts: the documents come from data-dependent
# Python (each row's spans), which torch.compile would otherwise specialise on, a recompile per packing of the rows.
@torch.compiler.disable
def attention_per_document(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    scaling: float | None,
    window: int,
    position_ids: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, None]:
    """:func:`document_attention` over the documents the host finds in ``position_ids`` (``window`` 0: none), with
    the attention sinks [Hq] where given."""
    batch, heads, seq, dim = query.shape
    dropout = dropout if module.training else 0.0
    if position_ids is None:
        position_ids = torch.arange(seq, device=query.device).expand(batch, seq)
    documents = find_documents(position_ids, attention_chunk(module))
    spans = documents.spans
    if sinks is not None:
        return sink_attention(query, key, value, sinks, spans, window, scaling, dropout), None
    if not window and documents.whole_rows:
        return _causal(query, key, value, dropout, scaling)
    varlen = _varlen(window)
    if varlen is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and not dropout:
        return varlen_documents(varlen, query, key, value, documents, scaling, window), None
    rows = []
    for b, row in enumerate(spans):
        docs = []
        for start, end in row:
            q, k, v = (t[b : b + 1, :, start:end] for t in (query, key, value))  # [1,H,d,D]
            if window and end - start > window:
                docs.append(_window_blocks(q, k, v, window, scaling, dropout))
            else:
                docs.append(
                    F.scaled_dot_product_attention(
                        q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=True
                    )
                )
        rows.append(torch.cat(docs, dim=2))  # [1,Hq,S,D]
    return torch.cat(rows).transpose(1, 2).contiguous(), None  # [B,S,Hq,D]


def varlen_documents(varlen, query, key, value, documents: Documents, scaling: float | None, window: int):
    """torch's variable-length flash attention (``varlen``) over every document of the micro-batch at once: query
    [B,Hq,S,D], key [B,Hkv,S,D], value [B,Hkv,S,Dv] -> [B,S,Hq,Dv]. The kernel takes one head size: values of
    another (multi-head latent attention's, DeepSeek-V3) are padded with zero columns, which add nothing to the
    output, or the queries and keys are, which add nothing to the scores (the scale stays that of D)."""
    batch, heads, seq, dim = query.shape
    v_dim = value.shape[-1]
    size = max(dim, v_dim)
    if scaling is None and size != dim:  # the kernel's default would be that of the padded size
        scaling = dim**-0.5
    cu = documents.cu_seqlens(query.device)  # [N+1] int32
    q = query.transpose(1, 2).reshape(batch * seq, heads, dim)  # [B*S,Hq,D]: rows end to end
    k = key.transpose(1, 2).reshape(batch * seq, key.shape[1], dim)  # [B*S,Hkv,D]
    v = value.transpose(1, 2).reshape(batch * seq, value.shape[1], v_dim)  # [B*S,Hkv,Dv]
    q, k, v = (F.pad(t, (0, size - t.shape[-1])) for t in (q, k, v))
    params, extra = _varlen_and_parameters()[1], {}
    if "window_size" in params:  # (left, right): (-1, 0) is causal, (W - 1, 0) a causal window of W
        extra["window_size"] = (window - 1 if window else -1, 0)
    else:  # torch 2.11: causal or not, no window (_varlen gave None for a window)
        extra["is_causal"] = True
    if "enable_gqa" in params:
        extra["enable_gqa"] = True
    elif k.shape[1] != heads:  # an older torch: each KV head repeated for its query heads
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    out = varlen(q, k, v, cu, cu, documents.longest, documents.longest, scale=scaling, **extra)  # [B*S,Hq,size]
    return out[..., :v_dim].reshape(batch, seq, heads, v_dim)


AttentionInterface.register(DOCUMENT_ATTENTION, document_attention)
