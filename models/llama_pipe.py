"""A Llama-family model as a list of DeepSpeed pipeline stages, built from Hugging Face's own modules.

Every stage module subclasses the Hugging Face module it wraps (the family's, from
``models.families``: Llama, Mistral, Qwen2, Qwen3), so its ``state_dict()`` keys are the Hugging Face
keys minus one prefix (``model.layers.3.`` + ``self_attn.q_proj.weight``). Conversion between the two
layouts is therefore a prefix mapping (see :func:`spec_layout`), and numerical parity with
``<Family>ForCausalLM`` holds by construction: the same code computes every layer.
"""

from __future__ import annotations

import copy
import math
import os
from functools import partial

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PretrainedConfig
from transformers.masking_utils import (
    create_causal_mask,
    create_chunked_causal_mask,
    create_sliding_window_causal_mask,
)

from models.attention import DOCUMENT_ATTENTION, attention_chunk, rows_are_whole_documents
from models.families import (
    FAMILIES,
    MOE_NORMAL_CLASSES,
    NORM_PLUS_ONE_CLASSES,
    RMS_NORM_CLASSES,
    attention_type,
    family_of,
    moe_spec,
)
from models.family_deepseek_v3 import SequenceBalanceStats
from models.family_gemma3 import scaled_lookup
from models.family_gemma4 import (
    Gemma4Embedding,
    Gemma4LayerCall,
    Gemma4LayerWire,
    init_layer_scalar_,
    largest,
    reuses_kv,
)
from models.family_gpt_oss import normal_parameter_names
from models.family_qwen3_5 import INIT_CLASSES as QWEN3_5_INIT_CLASSES
from models.family_qwen3_5 import LINEAR_ATTENTION, LinearAttentionPerDocument
from models.family_qwen3_5 import init_module_ as qwen3_5_init_
from models.files.pipeline_dir import tp_piece, whole_shape
from models.loss import logit_softcap
from models.per_micro_batch import PerMicroBatch
from models.router_loss import RouterStats
from models.specs import SpecInfo, expected_state_shapes, layer_file_name, spec_layout  # noqa: F401 (read from here too)

# Key under which the embedding and a tied LM head share one weight across stages.
TIED_EMBEDDING_KEY = "embed_tokens"


# attention= values: the attention function each decoder layer calls (transformers' AttentionInterface name)
ATTENTION_IMPLEMENTATIONS = {"documents": DOCUMENT_ATTENTION, "dense_mask": "sdpa"}


def prepare_config(
    config: PretrainedConfig, attention: str = DOCUMENT_ATTENTION, sequence_balance: bool = False
) -> PretrainedConfig:
    """A copy of ``config`` with the settings every stage needs: the attention function (``attention``, a
    registered name: per-document SDPA without a mask by default, models/attention.py), no KV cache, and for a
    MoE model the experts' kernel ``from_pretrained`` would pick. ``sdpa`` (attention=dense_mask) becomes the
    family's ``dense_attention`` (gpt-oss: ``eager``, which has its sinks). ``sequence_balance``: the stages carry
    DeepSeek-V3's sequence-wise balance loss (:func:`sequence_balance`)."""
    config = copy.deepcopy(config)
    if sequence_balance:
        config.sequence_balance = True
    config._attn_implementation = family_of(config).dense_attention if attention == "sdpa" else attention
    config.use_cache = False
    if moe_spec(config) is not None:  # the experts' kernel from_pretrained picks by default: one grouped matmul
        config._experts_implementation = "grouped_mm"
    return config


class EmbeddingPipe(nn.Embedding):
    """Spec 0: token embedding (``model.embed_tokens``). The parallel axes change what it sees and returns with
    forward hooks (parallel/tensor_parallel.py: this rank's vocabulary slice; parallel/sequence_parallel.py:
    this rank's slice of every row)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.router_experts = router_stats_experts(config)  # > 0: the routing statistics start here
        # Gemma's lookups are multiplied by sqrt(hidden_size) (not the tied head's weight)
        self.embed_scale = config.hidden_size**0.5 if family_of(config).scaled_embedding else None
        self.logit_softcap = logit_softcap(config)  # a tied head's cap, read by generation (the loss caps its own)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor] | torch.Tensor, tied_head: bool = False) -> tuple:
        if tied_head:  # the tied LM head of the chunked loss (tied_lm_head_chunked_forward)
            return inputs, handed_out(self.weight)  # hidden [B,S,H], [V,H] (or this rank's [V/tp,H])
        input_ids, position_ids = inputs  # [B,S] int64, [B,S] int64
        hidden = self.scale(super().forward(input_ids))  # [B,S,H]
        if self.router_experts:
            return hidden, position_ids, *RouterStats.initial_wire(hidden, self.router_experts)
        return hidden, position_ids

    def scale(self, hidden: torch.Tensor) -> torch.Tensor:
        """Looked-up rows [B,S,H] as the family's embedding returns them (Gemma's scaled, the others as they are)."""
        return hidden if self.embed_scale is None else scaled_lookup(hidden, self.embed_scale)


class Gemma4EmbeddingPipe(Gemma4Embedding):
    """Spec 0 of Gemma 4 (models/family_gemma4.py): (input_ids, position_ids) -> (hidden [B,S,H], position_ids,
    per-layer inputs [B,S,L,P]); the tied LM head's call as :class:`EmbeddingPipe`'s (the last stage's tied copy holds
    the per-layer inputs' modules too, unused there: the layer files' loader fills a tied copy from spec 0's file)."""

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor] | torch.Tensor, tied_head: bool = False) -> tuple:
        if tied_head:
            return inputs, handed_out(self.weight)  # hidden [B,S,H], [V,H]
        input_ids, position_ids = inputs  # [B,S] int64 each
        hidden, *per_layer_inputs = self.lookup(input_ids)
        return hidden, position_ids, *per_layer_inputs


def embedding_class(config: PretrainedConfig) -> type:
    """Spec 0's class: :class:`EmbeddingPipe`, or Gemma 4's with its per-layer inputs."""
    return Gemma4EmbeddingPipe if family_of(config).model_type == "gemma4_text" else EmbeddingPipe


def router_stats_experts(config: PretrainedConfig) -> int:
    """The experts per MoE layer when the stages carry routing statistics for the router loss (a MoE model with
    ``output_router_logits``, or with the sequence-wise balance loss), else 0."""
    moe = moe_spec(config)
    return moe.num_experts if moe is not None and (moe.router_loss or sequence_balance(config)) else 0


def sequence_balance(config: PretrainedConfig) -> bool:
    """Whether the stages' wire carries DeepSeek-V3's sequence-wise balance loss instead of the router loss's sums
    (``moe.sequence_balance_coef`` > 0: :func:`build_specs`'s ``sequence_balance``, models/family_deepseek_v3.py)."""
    return getattr(config, "sequence_balance", False)


def tied_head_call(args: tuple, kwargs: dict) -> bool:
    """Whether a hook's view of an ``EmbeddingPipe`` call is the tied LM head's (``tied_head=True``: hidden
    states in, the weight out), not a lookup of rows."""
    return kwargs.get("tied_head", args[1] if len(args) > 1 else False)


def handed_out(weight: nn.Parameter) -> torch.Tensor:
    """The LM head weight as a forward returns it to the chunked loss: a view, except under ZeRO-3.

    DeepSpeed's engine registers gradient hooks on every tensor its module's forward returns; on the
    Parameter itself they would stay on the leaf across steps, and DeepSpeed's bf16 optimizer at ZeRO-0
    then received a wrong head gradient. A view carries them for one graph only. ZeRO-3 needs the
    Parameter itself (its "dangling parameter" rule keeps it gathered for the loss)."""
    return weight if hasattr(weight, "ds_id") else weight.view_as(weight)


def tied_lm_head_forward(embedding: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """Last spec when embeddings are tied: logits from the shared embedding matrix."""
    return F.linear(hidden, embedding.weight)  # [B,S,H] x [V,H]^T -> [B,S,V]


def tied_lm_head_chunked_forward(embedding: EmbeddingPipe, hidden: torch.Tensor) -> tuple[torch.Tensor, nn.Parameter]:
    """Last spec when embeddings are tied and the loss is chunked: the loss computes the logits from the
    shared matrix (models/loss.py), so its gradient reaches the embedding weight on this stage, which
    DeepSpeed all-reduces with the first stage's as for the logits.

    The weight leaves through the module's own forward, not an attribute read: ZeRO-3 keeps a parameter
    that a module's forward returns gathered for the loss (its "dangling parameter" rule), while one
    read outside any forward is partitioned again when the model's forward returns, before the loss.
    """
    return embedding(hidden, tied_head=True)  # [B,S,H], [V,H]


# The mask each decoder layer's attention takes, by its family's attention type (models.families).
MASK_FUNCTIONS = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
    "chunked_attention": create_chunked_causal_mask,  # Llama 4's RoPE layers
}


# The rotary cos/sin of the micro-batches in flight, per layer type (Gemma's bases) and dtype: a few entries of
# B x S x head_dim, which every layer's attention would otherwise compute and save for its backward on its own.
_ROTARY = PerMicroBatch(kept=4)


class DecoderLayerPipe(nn.Module):
    """Specs 1..L: one Hugging Face decoder layer (``model.layers.{i}``).

    The base of the per-family classes (``LlamaDecoderLayerPipe(DecoderLayerPipe, LlamaDecoderLayer)``,
    see :func:`decoder_layer_class`). transformers 5 computes rotary embeddings and the attention masks
    once per model and passes them to each layer. Between pipeline stages only the integer
    ``position_ids`` travel (a float cos/sin pair would get a gradient from DeepSpeed; a mask would be
    O(S^2)), so each layer derives both from ``position_ids`` with the functions the family's model uses:

    - cos/sin from its own rotary embedding, whatever ``rope_parameters`` say (its buffers are
      non-persistent, so the state dict stays that of the Hugging Face decoder layer); Llama 4's gives
      complex frequencies [B,S,head_dim/2] instead, which its attention takes as they are;
    - no mask by default: the attention function (models/attention.py, or Ulysses around it with sequence
      parallelism) finds the documents of packed rows in ``position_ids`` and keeps each layer's window
      (or Llama 4's chunks);
    - with ``attention=dense_mask`` (transformers' ``sdpa``), the mask from ``create_causal_mask``, or
      ``create_sliding_window_causal_mask`` on a layer with a sliding window (``create_chunked_causal_mask``
      on a chunked one): None (SDPA's causal kernel) when positions count up from 0 in every row and no
      window or chunk cuts in, and a per-document [B,1,S,S] mask when they restart (packed documents), so
      attention never crosses a document boundary, and within a document never reaches past the window.

    Llama 4's decoder layer keeps ``position_ids`` to itself (its attention's keyword arguments lack them):
    a pre-hook on its attention hands them over, as the other families' layers do, for the per-document
    attention to find the documents.
    """

    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.rotary_emb = family_of(config).rotary_embedding(config)
        self._rope_config = config  # the layers built from one config compute the same cos/sin (_ROTARY)
        # what the rotary embedding takes after the positions: Gemma's, the layer's attention type (a base per type)
        self.rotary_args = (attention_type(config, layer_idx),) if family_of(config).rope_per_layer_type else ()
        dense = config._attn_implementation in ("sdpa", family_of(config).dense_attention)
        kind = attention_type(config, layer_idx)  # Qwen3.5's linear attention takes no mask (models/family_qwen3_5.py)
        self.make_mask = MASK_FUNCTIONS[kind] if dense and kind != LINEAR_ATTENTION else None
        # The per-document attention over whole rows (not a sequence-parallel slice): this layer asks the host
        # whether the micro-batch's rows are one document each, so a compiled layer is one graph for them.
        self.ask_whole_rows = config._attn_implementation == DOCUMENT_ATTENTION
        self.attention_chunk = attention_chunk(getattr(self, "self_attn", None))  # Qwen3.5's linear layers: none
        self._positions: torch.Tensor | None = None  # this forward's position_ids, for an attention not given them
        if not family_of(config).layer_passes_positions:
            self.self_attn.register_forward_pre_hook(self._hand_positions, with_kwargs=True)
        moe = moe_spec(config)
        self.router_top_k = 0  # > 0: this layer adds its routing to the statistics it passes on
        self.balance_documents = sequence_balance(config)  # its per-document balance terms, not the router loss's
        if moe is not None and (moe.router_loss or self.balance_documents) and layer_idx in moe.moe_layers:
            self.router_top_k = moe.top_k
            self.get_submodule(moe.router).register_forward_hook(self._keep_router_output)
        self._router_output: tuple | None = None

    def _keep_router_output(self, module, args, output) -> None:
        self._router_output = output  # logits [B*S,E] first (DeepSeek-V3's: then weights, choices [B*S,k])

    def _hand_positions(self, module, args, kwargs) -> tuple[tuple, dict]:
        return args, {**kwargs, "position_ids": self._positions}  # [B,S] int64, on to the attention function

    def forward(self, inputs: tuple) -> tuple:
        # [B,S,H], [B,S] int64 (with sequence parallelism: this rank's slice), and with the router loss the routing
        # statistics so far: counts int64 [E+1], probabilities fp32 [E] (models/router_loss.py)
        hidden, position_ids, *stats = inputs
        whole = {}  # asked first: compiled, the rest of the layer is then one graph
        if self.ask_whole_rows:
            whole["whole_rows"] = rows_are_whole_documents(position_ids, self.attention_chunk)
        # 2 x [B,S,head_dim] (Llama 4: complex [B,S,head_dim/2])
        if torch.compiler.is_compiling():  # inside the layer's graph
            cos_sin = self.rotary_emb(hidden, position_ids, *self.rotary_args)
        else:  # eager: once per micro-batch for the stage's layers (models/per_micro_batch.py)
            extra = (self.rotary_args, hidden.dtype, hidden.device, torch.is_inference_mode_enabled())
            rotary = partial(self.rotary_emb, hidden, position_ids, *self.rotary_args)
            cos_sin = _ROTARY.get(position_ids, extra, rotary, owner=self._rope_config)
        mask = None
        if self.make_mask is not None:
            mask = self.make_mask(  # None, or bool [B,1,S,S] (packed documents, sliding window)
                config=self.self_attn.config,
                inputs_embeds=hidden,
                attention_mask=None,
                past_key_values=None,
                position_ids=position_ids,
            )
        self._positions = position_ids
        hidden = super().forward(
            hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=cos_sin, **whole
        )
        self._positions = None
        routed, self._router_output = self._router_output, None  # never kept past this forward
        if self.router_top_k and stats and self.balance_documents:
            stats = SequenceBalanceStats.from_wire(*stats).add_documents(routed[0], routed[2], position_ids).to_wire()
        elif self.router_top_k and stats:
            stats = RouterStats.from_wire(*stats).add_layer(routed[0], self.router_top_k).to_wire()
        return hidden, position_ids, *stats


class NormPipe(nn.Module):
    """Spec L+1: final RMSNorm (``model.norm``); drops the positions, which no later spec needs, and hands the
    routing statistics of a MoE model with the router loss to ``router_sink`` (the loss's ``RouterLoss.receive``,
    set by parallel/stage.py's build): the loss of the same micro-batch takes them right after this stage's forward.
    The base of the per-family classes (see :func:`norm_class`)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__(config.hidden_size, eps=config.rms_norm_eps)
        self.router_sink = None

    def forward(self, inputs: tuple) -> torch.Tensor:
        hidden, _position_ids, *stats = inputs
        if stats:
            if self.router_sink is None:
                raise RuntimeError("routing statistics reached the final norm, and no router loss takes them")
            self.router_sink(*stats, self.training)  # counts int64 [E+1], probabilities fp32 [E]
        return super().forward(hidden)  # [B,S,H]


# One decoder-layer and one norm class per family (models/families.py), written out so that each pickles, shows
# and steps by name; their names end in "DecoderLayerPipe" / "NormPipe", which partition_method=type:DecoderLayerPipe
# matches.
class LlamaDecoderLayerPipe(DecoderLayerPipe, FAMILIES["llama"].decoder_layer):
    """DecoderLayerPipe over LlamaDecoderLayer."""


class LlamaNormPipe(NormPipe, FAMILIES["llama"].rms_norm):
    """NormPipe over LlamaRMSNorm."""


class MistralDecoderLayerPipe(DecoderLayerPipe, FAMILIES["mistral"].decoder_layer):
    """DecoderLayerPipe over MistralDecoderLayer."""


class MistralNormPipe(NormPipe, FAMILIES["mistral"].rms_norm):
    """NormPipe over MistralRMSNorm."""


class Qwen2DecoderLayerPipe(DecoderLayerPipe, FAMILIES["qwen2"].decoder_layer):
    """DecoderLayerPipe over Qwen2DecoderLayer."""


class Qwen2NormPipe(NormPipe, FAMILIES["qwen2"].rms_norm):
    """NormPipe over Qwen2RMSNorm."""


class Qwen3DecoderLayerPipe(DecoderLayerPipe, FAMILIES["qwen3"].decoder_layer):
    """DecoderLayerPipe over Qwen3DecoderLayer."""


class Qwen3NormPipe(NormPipe, FAMILIES["qwen3"].rms_norm):
    """NormPipe over Qwen3RMSNorm."""


class Qwen3MoeDecoderLayerPipe(DecoderLayerPipe, FAMILIES["qwen3_moe"].decoder_layer):
    """DecoderLayerPipe over Qwen3MoeDecoderLayer."""


class Qwen3MoeNormPipe(NormPipe, FAMILIES["qwen3_moe"].rms_norm):
    """NormPipe over Qwen3MoeRMSNorm."""


class MixtralDecoderLayerPipe(DecoderLayerPipe, FAMILIES["mixtral"].decoder_layer):
    """DecoderLayerPipe over MixtralDecoderLayer."""


class MixtralNormPipe(NormPipe, FAMILIES["mixtral"].rms_norm):
    """NormPipe over MixtralRMSNorm."""


class Llama4DecoderLayerPipe(DecoderLayerPipe, FAMILIES["llama4_text"].decoder_layer):
    """DecoderLayerPipe over Llama4TextDecoderLayer."""


class Llama4NormPipe(NormPipe, FAMILIES["llama4_text"].rms_norm):
    """NormPipe over Llama4TextRMSNorm."""


class DeepseekV3DecoderLayerPipe(DecoderLayerPipe, FAMILIES["deepseek_v3"].decoder_layer):
    """DecoderLayerPipe over DeepseekV3DecoderLayer."""


class DeepseekV3NormPipe(NormPipe, FAMILIES["deepseek_v3"].rms_norm):
    """NormPipe over DeepseekV3RMSNorm."""


class GptOssDecoderLayerPipe(DecoderLayerPipe, FAMILIES["gpt_oss"].decoder_layer):
    """DecoderLayerPipe over GptOssDecoderLayer."""


class GptOssNormPipe(NormPipe, FAMILIES["gpt_oss"].rms_norm):
    """NormPipe over GptOssRMSNorm."""


class Gemma3DecoderLayerPipe(DecoderLayerPipe, FAMILIES["gemma3_text"].decoder_layer):
    """DecoderLayerPipe over Gemma3DecoderLayer."""


class Gemma3NormPipe(NormPipe, FAMILIES["gemma3_text"].rms_norm):
    """NormPipe over Gemma3RMSNorm."""


class Gemma4DecoderLayerPipe(Gemma4LayerWire, DecoderLayerPipe, Gemma4LayerCall, FAMILIES["gemma4_text"].decoder_layer):
    """DecoderLayerPipe over Gemma4TextDecoderLayer, its per-layer input and shared keys/values on the wire."""


class Gemma4NormPipe(NormPipe, FAMILIES["gemma4_text"].rms_norm):
    """NormPipe over Gemma4RMSNorm (the last layer passes on no per-layer inputs or shared keys/values)."""


class Qwen3_5DecoderLayerPipe(DecoderLayerPipe, LinearAttentionPerDocument, FAMILIES["qwen3_5_text"].decoder_layer):
    """DecoderLayerPipe over Qwen3_5DecoderLayer, its linear attention per document (models/family_qwen3_5.py)."""


class Qwen3_5NormPipe(NormPipe, FAMILIES["qwen3_5_text"].rms_norm):
    """NormPipe over Qwen3_5RMSNorm."""


class Qwen3_5MoeDecoderLayerPipe(
    DecoderLayerPipe, LinearAttentionPerDocument, FAMILIES["qwen3_5_moe_text"].decoder_layer
):
    """DecoderLayerPipe over Qwen3_5MoeDecoderLayer, its linear attention per document."""


class Qwen3_5MoeNormPipe(NormPipe, FAMILIES["qwen3_5_moe_text"].rms_norm):
    """NormPipe over Qwen3_5MoeRMSNorm."""


# Keyed by model_type.
DECODER_LAYER_CLASSES = {
    "llama": LlamaDecoderLayerPipe,
    "mistral": MistralDecoderLayerPipe,
    "qwen2": Qwen2DecoderLayerPipe,
    "qwen3": Qwen3DecoderLayerPipe,
    "qwen3_moe": Qwen3MoeDecoderLayerPipe,
    "mixtral": MixtralDecoderLayerPipe,
    "llama4_text": Llama4DecoderLayerPipe,
    "gemma3_text": Gemma3DecoderLayerPipe,
    "gemma4_text": Gemma4DecoderLayerPipe,
    "deepseek_v3": DeepseekV3DecoderLayerPipe,
    "gpt_oss": GptOssDecoderLayerPipe,
    "qwen3_5_text": Qwen3_5DecoderLayerPipe,
    "qwen3_5_moe_text": Qwen3_5MoeDecoderLayerPipe,
}
NORM_CLASSES = {
    "llama": LlamaNormPipe,
    "mistral": MistralNormPipe,
    "qwen2": Qwen2NormPipe,
    "qwen3": Qwen3NormPipe,
    "qwen3_moe": Qwen3MoeNormPipe,
    "mixtral": MixtralNormPipe,
    "llama4_text": Llama4NormPipe,
    "gemma3_text": Gemma3NormPipe,
    "gemma4_text": Gemma4NormPipe,
    "deepseek_v3": DeepseekV3NormPipe,
    "gpt_oss": GptOssNormPipe,
    "qwen3_5_text": Qwen3_5NormPipe,
    "qwen3_5_moe_text": Qwen3_5MoeNormPipe,
}


def decoder_layer_class(config: PretrainedConfig) -> type:
    """The decoder-layer stage class of ``config``'s family."""
    return DECODER_LAYER_CLASSES[family_of(config).model_type]


def norm_class(config: PretrainedConfig) -> type:
    """The final-norm stage class of ``config``'s family."""
    return NORM_CLASSES[family_of(config).model_type]


class LMHeadPipe(nn.Linear):
    """Spec L+2 (untied): output projection (``lm_head``). With ``chunked`` it hands the hidden states
    and its weight to the chunked loss instead of computing the [B,S,V] logits (models/loss.py); a weight
    returned by a forward stays gathered under ZeRO-3 until the loss has used it."""

    def __init__(self, config: PretrainedConfig, chunked: bool = False):
        super().__init__(config.hidden_size, config.vocab_size, bias=False)
        self.chunked = chunked
        self.logit_softcap = logit_softcap(config)  # the logits' cap, read by generation (the loss caps its own)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, nn.Parameter]:
        if self.chunked:
            return hidden, handed_out(self.weight)  # [B,S,H], [V,H]
        return super().forward(hidden)  # [B,S,H] -> [B,S,V]


# Stage contract: what each spec receives and returns (B micro-batch, S sequence, H hidden, V vocab).
# Only the hidden states are floating point: DeepSpeed gives every float tensor sent between stages a
# gradient and expects it back, so positions travel as int64 and no float mask is ever sent.
# A MoE model with the router loss (output_router_logits) appends its routing statistics to the tuples of specs
# 0..L, (counts int64 [E+1], router probabilities fp32 [E]) (models/router_loss.py): each MoE layer adds its own,
# the norm hands the totals to the loss, and the probabilities' gradient comes back to every stage's routers.
# With DeepSeek-V3's sequence-wise balance loss (build_specs' sequence_balance) the same two tensors carry the counts
# and, in place of the probabilities, every MoE layer's per-expert balance terms summed (models/family_deepseek_v3.py).
#
#   spec 0        EmbeddingPipe     (input_ids [B,S] int64, position_ids [B,S] int64) -> (hidden [B,S,H], position_ids)
#   spec 1..L     DecoderLayerPipe  (hidden [B,S,H], position_ids [B,S] int64)        -> (hidden [B,S,H], position_ids)
#   spec L+1      NormPipe          (hidden [B,S,H], position_ids [B,S] int64)        -> hidden [B,S,H]
#   spec L+2      LMHeadPipe        hidden [B,S,H]                                    -> logits [B,S,V]
#                 (tied embeddings: the spec-0 embedding module with tied_lm_head_forward)
#   loss          CausalLMLoss      (logits [B,S,V], labels [B,S] int64)              -> scalar (models/loss.py)
#
# With loss_chunk_tokens > 0 (the chunked loss) the head computes no logits: the last stage's output is
#   spec L+2      LMHeadPipe        hidden [B,S,H]                          -> (hidden [B,S,H], weight [V,H])
#                 (tied embeddings: tied_lm_head_chunked_forward, the shared embedding weight)
#   loss          CausalLMLoss      ((hidden, weight), labels [B,S] int64)  -> scalar, logits chunk by chunk
# DeepSpeed hands the last stage's output to loss_fn untouched; the weight's gradient comes from the loss.
#
# The first stage's data iterator yields ((input_ids, position_ids), labels); the last stage reads labels.
#
# With sequence parallelism (sequence_parallel N, parallel/sequence_parallel.py's plan) spec 0 takes whole rows
# and keeps this rank's slice: every later spec sees S/N tokens (position_ids the slice of the global positions),
# the attention of each decoder layer exchanges heads for tokens with its N - 1 peers (Ulysses), and the loss takes
# its slice of the labels shifted over the whole row (models/loss.py).
def build_specs(
    config: PretrainedConfig,
    loss_chunk_tokens: int = 0,
    attention: str = DOCUMENT_ATTENTION,
    sequence_balance: bool = False,
) -> list[LayerSpec]:
    """The ``LayerSpec`` list of a Llama-family model, in the order of :func:`spec_layout`; with
    ``loss_chunk_tokens`` > 0 the head hands (hidden, weight) to the chunked loss (stage contract above);
    ``attention``: the attention function's registered name, ``sequence_balance``: DeepSeek-V3's sequence-wise
    balance loss on the wire (prepare_config)."""
    config = prepare_config(config, attention, sequence_balance)
    embedding = embedding_class(config)
    specs: list[LayerSpec] = []
    for info in spec_layout(config):
        if info.kind == "embed":
            if config.tie_word_embeddings:
                specs.append(TiedLayerSpec(TIED_EMBEDDING_KEY, embedding, config, tied_weight_attr=["weight"]))
            else:
                specs.append(LayerSpec(embedding, config))
        elif info.kind == "decoder":
            specs.append(LayerSpec(decoder_layer_class(config), config, info.index - 1))
        elif info.kind == "norm":
            specs.append(LayerSpec(norm_class(config), config))
        elif config.tie_word_embeddings:
            specs.append(
                TiedLayerSpec(
                    TIED_EMBEDDING_KEY,
                    embedding,
                    config,
                    forward_fn=tied_lm_head_chunked_forward if loss_chunk_tokens else tied_lm_head_forward,
                    tied_weight_attr=["weight"],
                )
            )
        else:
            specs.append(LayerSpec(LMHeadPipe, config, loss_chunk_tokens > 0))
    return specs


def spec_parameter_counts(config: PretrainedConfig) -> list[int]:
    """Parameters of every spec, from shapes on the meta device; a tied LM head counts the shared
    embedding again (as DeepSpeed's partitioner counts it: the last stage holds a copy)."""
    return list(_spec_counts(config)[0])


def spec_routed_expert_counts(config: PretrainedConfig) -> list[int]:
    """Routed-expert parameters of every spec: a MoE decoder layer's state-dict keys with ``.experts.`` (the router
    and a shared expert are not routed); 0 for every other spec and every spec of a dense model."""
    return list(_spec_counts(config)[1])


def is_routed_expert(key: str) -> bool:
    """Whether a spec's state-dict key is a routed expert's tensor (``mlp.experts.down_proj``)."""
    return ".experts." in f".{key}"


def _spec_counts(config: PretrainedConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(parameters, routed-expert parameters) of every spec. Kept per config contents: the planner's search and the
    partitioner ask for the same model's counts many times, and building layers on the meta device is most of what
    they cost: one decoder layer of each kind is built (dense or routed, and per attention type: Qwen3.5's linear and
    full layers hold different parameters; windows, chunks, RoPE hold none)."""
    key = config.to_json_string(use_diff=False)
    if key not in _SPEC_COUNTS:
        moe = moe_spec(config)
        routed = set(moe.moe_layers) if moe is not None else set()
        counts, by_kind = [], {}
        for info, spec in zip(spec_layout(config), build_specs(config)):
            # a decoder layer's kind: routed or not, and its attention type (Qwen3.5's linear and full layers differ)
            kind = ("spec", info.index)
            if info.kind == "decoder":
                layer = info.index - 1  # (Gemma 4's layers that reuse keys and values hold no k/v projections)
                kind = ("decoder", layer in routed, attention_type(config, layer), reuses_kv(config, layer))
            if kind not in by_kind:
                shapes = expected_state_shapes(spec, parameters_only=True)
                by_kind[kind] = (
                    sum(math.prod(s) for s in shapes.values()),
                    sum(math.prod(s) for k, s in shapes.items() if is_routed_expert(k)),
                )
            counts.append(by_kind[kind])
        _SPEC_COUNTS[key] = (tuple(c for c, _ in counts), tuple(r for _, r in counts))
    return _SPEC_COUNTS[key]


_SPEC_COUNTS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}


def model_parameters(config: PretrainedConfig) -> int:
    """Parameters of the whole model (a tied embedding counted once), from shapes only."""
    counts = spec_parameter_counts(config)
    return sum(counts[info.index] for info in spec_layout(config) if info.owns_file)


def flops_per_token(config: PretrainedConfig, seq: int) -> tuple[float, float]:
    """Training FLOPs per token, forward + backward, as torchtitan counts them for MFU: (6 N, attention).

    N counts the matmul parameters (every spec but the input embedding, a lookup; a tied LM head counts), of a
    Mixture-of-Experts layer's routed experts those a token runs through (top_k / E; all E for llama4_text, see
    spec_weights). Attention adds 12 H Q T per layer (H query heads of Q dims, T attended tokens): QK^T and AV,
    2 multiply-adds each forward, twice that backward, with no discount for the causal mask and no recomputation,
    the peers' convention (torchtitan's torchtitan/models/utils.py, quadratic_attention_flops_per_token: 12 L H Q T
    for Llama); a layer with a sliding window or chunk attends to at most that many tokens, as there. DeepSeek-V3's
    latent attention has query/key heads of ``qk_head_dim`` and value heads of ``v_head_dim``: 6 H (Q + V) T.
    """
    n = sum(spec_weights(config, "compute"))
    head_dim = largest(config, "head_dim") or config.hidden_size // config.num_attention_heads  # (Gemma 4: the widest)
    qk_dim, v_dim = getattr(config, "qk_head_dim", None) or head_dim, getattr(config, "v_head_dim", None) or head_dim
    attended = 0
    for layer in range(config.num_hidden_layers):
        kind = attention_type(config, layer)
        if kind == LINEAR_ATTENTION:  # Qwen3.5's Gated DeltaNet: linear in the tokens, its matmuls counted in N
            continue
        span = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}.get(kind)
        attended += min(seq, getattr(config, span, None) or seq) if span else seq
    return 6.0 * n, 6.0 * config.num_attention_heads * (qk_dim + v_dim) * attended


def spec_weights(config: PretrainedConfig, method: str) -> list[int]:
    """What the balanced partitioner weighs each spec by, for ``method`` ``parameters`` or ``compute``.

    ``parameters`` (DeepSpeed's method): the spec's parameter count, i.e. the memory it stores.
    ``compute``: the work per token, 2 FLOPs per parameter, so the same count, except the input
    embedding, a lookup, which weighs nothing, and a Mixture-of-Experts layer's routed experts (its state-dict
    keys with ``.experts.``, :func:`spec_routed_expert_counts`), of which a token runs ``experts_per_token`` / E
    (``models.families.MoESpec``: top_k; all E for Llama 4, whose Hugging Face experts module runs every token
    through every expert); the shared expert, dense, counts whole in every family.
    """
    counts = spec_parameter_counts(config)
    if method == "compute":
        counts[0] = 0  # spec 0 is the input embedding (spec_layout)
        moe = moe_spec(config)
        for i, routed in enumerate(spec_routed_expert_counts(config)):
            if routed:
                counts[i] -= routed - routed * moe.experts_per_token // moe.num_experts
    elif method != "parameters":
        raise ValueError(f"spec weights are defined for 'parameters' and 'compute', not {method!r}")
    return counts


class LlamaPipelineModule(PipelineModule):
    """``PipelineModule`` with two fixes for DeepSpeed 0.19.8, and the ``compute`` and ``memory``
    partition methods.

    1. Partitioning by parameters: DeepSpeed builds every layer of the model on every rank (one at a
       time, randomly initialised) just to count its parameters, minutes for a 70B model. Counting
       on the meta device gives the same numbers without allocating or initialising anything.
    2. Gradient clipping without ZeRO (fp32, ZeRO-0): DeepSpeed's ``clip_grad_norm_`` sums gradient
       norms over the pipeline but counts a parameter only on stage 0 or when it is flagged
       ``model_parallel``, so every other stage was missing from the global norm and each step was
       clipped by stage 0's norm alone. Flagging every parameter of a stage (except the replicated
       copy of a tied weight, which must count once) makes the norm global, as ZeRO-1 computes it.

    Every method's split comes from :func:`stage_boundaries`, so the planner predicts exactly the
    stages the model builds. ``partition_method="compute"`` (the default) balances the work per token
    instead of the stored parameters (see spec_weights). By parameters, the embedding's V x H weights
    count as much as a layer's matmuls, so the first stage got one layer too few and the last stage
    (layers + LM head) became the bottleneck: 4 | 4 layers + head for an 8-layer, 8192-vocabulary model,
    its last stage 57% of the work (measured: 2.71 vs 2.07 CPU s per step); by compute, 5 | 3 + head.
    The price is memory: the first stage stores the embedding on top of its share; ``parameters``
    balances stored parameters, ``memory`` the predicted per-GPU peak (docs/training.md#partitioning).

    Some parallel axes build the stage as a subclass of this one (each plan's ``stage_class``, picked by
    parallel/stage.py's ``stage_class``): tensor and expert parallelism's build, save and load the stage in pieces
    (parallel/tensor_parallel.py, expert_parallel.py), DualPipeV's cuts it into two pieces per rank (DeepSpeed's
    ``DualPipeVModule``, parallel/dualpipev.py).
    """

    def __init__(self, config: PretrainedConfig, *args, boundaries: list[int], **kwargs):
        self._llama_config, self._boundaries = config, list(boundaries)
        super().__init__(*args, **kwargs)
        for p in self.parameters():
            p.model_parallel = not p.ds_pipe_replicated

    def ckpt_layer_path(self, ckpt_dir: str, local_layer_idx: int) -> str:
        # One file per layer whatever the tensor-parallel rank: save_state_dict writes whole tensors.
        return os.path.join(ckpt_dir, layer_file_name(local_layer_idx + self._local_start))

    def _partition_layers(self, method: str = "uniform") -> None:
        # The split is the caller's (parallel.partition.stage_boundaries), whatever DeepSpeed's method says.
        self.parts = self._boundaries
        if len(self.parts) != self.num_stages + 1:
            raise ValueError(
                f"{len(self.parts) - 1} stages in the boundaries {self.parts}, {self.num_stages} in the topology"
            )
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


@torch.no_grad()
def materialize_(module: nn.Module) -> None:
    """Give every parameter left on the meta device memory of its shape, zeros: a new ``Parameter``
    carrying the old one's attributes (``tp_split``, DeepSpeed's flags), since torch cannot move a
    parameter off the meta device in place."""
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and p.is_meta:
                real = nn.Parameter(torch.zeros(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                real.__dict__.update(p.__dict__)
                m._parameters[name] = real


@torch.no_grad()
def init_weights_(module: nn.Module, config: PretrainedConfig, seed: int) -> None:
    """Hugging Face's initialisation (``LlamaPreTrainedModel._init_weights``, the same for every family
    here), from its own seed.

    Linear and embedding weights ~ N(0, initializer_range), biases 0, the padding row 0, RMSNorm 1
    (the q/k norms of Qwen3 included), a MoE layer's router and fused experts ~ N(0, initializer_range).
    Seeding per spec (not per rank) gives every data-parallel replica, and both ends of a tied
    embedding, the same weights, whatever the partitioning. A tensor-parallel rank draws each whole
    weight (the same numbers as without tensor parallelism) and keeps its piece.
    """
    from deepspeed.module_inject.layers import TensorParallel_Layer

    g = torch.Generator().manual_seed(seed)
    std = config.initializer_range

    def normal_(w: torch.Tensor, zero_row: int | None = None) -> None:
        # drawn on the CPU generator whatever the device: the same weights on a GPU as on CPU ranks
        whole = torch.empty(whole_shape(w), dtype=w.dtype).normal_(0.0, std, generator=g)
        if zero_row is not None:
            whole[zero_row] = 0.0
        w.copy_(tp_piece(whole, w))

    for m in module.modules():
        init_layer_scalar_(m)
        if isinstance(m, (nn.Linear, TensorParallel_Layer)):  # DeepSpeed's split q/k/v/o/gate/up/down
            normal_(m.weight)
            if m.bias is not None:
                m.bias.zero_()
        elif isinstance(m, nn.Embedding):
            normal_(m.weight, zero_row=m.padding_idx)
        elif isinstance(m, QWEN3_5_INIT_CLASSES):  # Qwen3.5's gated norms and Gated DeltaNet's own parameters
            qwen3_5_init_(m, normal_, g)
        elif isinstance(m, RMS_NORM_CLASSES) and hasattr(m, "weight"):  # (Gemma 4's v norm has none)
            m.weight.fill_(0.0 if isinstance(m, NORM_PLUS_ONE_CLASSES) else 1.0)  # Gemma's: 1 + weight
        elif isinstance(m, MOE_NORMAL_CLASSES):  # fused experts [E,...] and routers [E,H], as Hugging Face's
            for p in m.parameters(recurse=False):
                normal_(p)
            if hasattr(m, "e_score_correction_bias"):  # DeepSeek-V3's router bias (a buffer): 0, as Hugging Face's
                m.e_score_correction_bias.zero_()
        elif (drawn := normal_parameter_names(m)) is not None:  # gpt-oss's experts, router and sinks
            for name, p in m.named_parameters(recurse=False):
                normal_(p) if name in drawn else p.zero_()


class LlamaStack(nn.Module):
    """Every spec in one module, for DeepSpeed's data-parallel engine (``num_stages=1`` with ZeRO 2/3).

    The same modules in the same order as the pipeline (so the same layer files, weights and
    numbers); ``forward`` chains them like ``PipelineModule.forward``. It carries the attributes of a
    one-stage ``PipelineModule`` that ``models.files.pipeline_dir.local_modules`` reads, so loading, seeded
    initialisation and layer-file export are the pipeline's code paths.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        activation_checkpointing: bool = False,
        loss_chunk_tokens: int = 0,
        attention: str = DOCUMENT_ATTENTION,
    ):
        super().__init__()
        self._layer_specs = build_specs(config, loss_chunk_tokens, attention)
        self.forward_funcs = build_sequential(config, loss_chunk_tokens, attention)
        self._local_start, self._local_stop, self.stage_id = 0, len(self._layer_specs), 0
        # Registered once each (a tied head is a partial over the embedding module).
        self.layers = nn.ModuleList([f for f in self.forward_funcs if isinstance(f, nn.Module)])
        self.tied_modules = {s.key: self.forward_funcs[0] for s in self._layer_specs if isinstance(s, TiedLayerSpec)}
        self.activation_checkpointing = activation_checkpointing

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        x = (input_ids, position_ids)  # [B,S] int64 each
        for f in self.forward_funcs:
            if self.activation_checkpointing and isinstance(f, DecoderLayerPipe) and self.training:
                x = (checkpoint(lambda h, p, f=f: f((h, p))[0], x[0], x[1], use_reentrant=False), x[1])
            else:
                x = f(x)
        return x  # logits [B,S,V], or (hidden [B,S,H], head weight [V,H]) for the chunked loss


def build_sequential(
    config: PretrainedConfig,
    loss_chunk_tokens: int = 0,
    attention: str = DOCUMENT_ATTENTION,
    sequence_balance: bool = False,
) -> list[nn.Module | partial]:
    """All specs built in one process and chained like ``PipelineModule.forward`` (tests, debugging).

    Tied specs share one module, as on a single pipeline stage. The chain ends in logits, or with
    ``loss_chunk_tokens`` > 0 in what the chunked loss takes (see the stage contract above build_specs).
    """
    tied: dict[str, nn.Module] = {}
    funcs: list[nn.Module | partial] = []
    for spec in build_specs(config, loss_chunk_tokens, attention, sequence_balance):
        if isinstance(spec, TiedLayerSpec):
            module = tied.setdefault(spec.key, spec.build())
            funcs.append(module if spec.forward_fn is None else partial(spec.forward_fn, module))
        else:
            funcs.append(spec.build())
    return funcs
