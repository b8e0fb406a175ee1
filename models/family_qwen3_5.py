"""Qwen3.5 (``qwen3_5_text``, ``Qwen3_5ForCausalLM``; MoE ``qwen3_5_moe_text``, ``Qwen3_5MoeForCausalLM``): what its
stages add to the Llama-family path of models/llama_pipe.py.

Its decoder layers (``layer_types``, 3 ``linear_attention`` to 1 ``full_attention`` by default) are Hugging Face's own:

- linear attention (``linear_attn``, Gated DeltaNet): q/k/v through a short causal depthwise convolution
  (``linear_conv_kernel_dim`` taps), then the gated delta rule, a recurrent state per value head that decays by
  ``exp(g)`` and is corrected by ``beta`` at each token, and an RMSNorm of the output gated by ``silu(z)``. Without
  the fla / causal-conv1d kernels (CPU, and any machine without them) transformers runs its torch fallbacks,
  ``torch_chunk_gated_delta_rule`` and a ``conv1d``, which ignore document boundaries (they drop ``cu_seqlens``);
- full attention: q/k RMSNorm per head, RoPE on the first ``partial_rotary_factor`` (1/4) of each head, and a sigmoid
  gate on the output (``q_proj`` gives each head's query and gate);
- RMSNorms that scale by ``1 + weight`` (their weights start at 0); the MoE variant's every MLP is a softmax top-k
  router (renormalised), the fused experts and a shared expert scaled by a sigmoid gate.

A packed row would carry the convolution window and the recurrent state from one document into the next, so
:class:`LinearAttentionPerDocument` runs each linear-attention module on the documents of the micro-batch as rows of
their own (right-padded with zeros, which a causal operator never reads back) and puts the outputs back in place:
a packed row computes what its documents compute apart (tests/test_family_qwen3_5.py). Rows that are one document
each run as they are, Hugging Face's computation unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

from models.attention import find_documents

LINEAR_ATTENTION = "linear_attention"  # the layer_types entry of a Gated DeltaNet layer
MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")

# The modules whose initialisation is Hugging Face's own here (Qwen3_5PreTrainedModel._init_weights): the gated
# output norm at 1, the DeltaNet's conv ~ N(0, std), dt_bias 1, A_log the log of U(0.01, 16). (The norms that scale
# by 1 + weight start at 0: the family's norm_adds_one, models/families.py.)
GATED_NORMS = (modeling_qwen3_5.Qwen3_5RMSNormGated, modeling_qwen3_5_moe.Qwen3_5MoeRMSNormGated)
DELTA_NETS = (modeling_qwen3_5.Qwen3_5GatedDeltaNet, modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet)
INIT_CLASSES = GATED_NORMS + DELTA_NETS


@torch.no_grad()
def init_module_(module: nn.Module, normal_, generator: torch.Generator) -> None:
    """Hugging Face's initialisation of one of :data:`INIT_CLASSES` (``normal_``: the caller's N(0, std) draw)."""
    if isinstance(module, GATED_NORMS):
        module.weight.fill_(1.0)
    else:
        normal_(module.conv1d.weight)
        module.dt_bias.fill_(1.0)
        a = torch.empty(module.A_log.shape, dtype=torch.float32).uniform_(0.01, 16, generator=generator)
        module.A_log.copy_(a.log_())


class LinearAttentionPerDocument:
    """Mixin of a Qwen3.5 decoder-layer stage (before the Hugging Face layer in its bases): hooks on its
    linear-attention module regroup a micro-batch of packed rows into one row per document, zero-padded on the right,
    and the outputs back into the rows, so the convolution and the recurrent state restart at each document.

    The documents come from the ``position_ids`` of the layer's forward (``DecoderLayerPipe._positions``), found on
    the host as the per-document attention finds them (models/attention.py, kept per micro-batch)."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self._document_lengths: torch.Tensor | None = None  # this forward's documents, regrouped
        if config.layer_types[layer_idx] == LINEAR_ATTENTION:
            self.linear_attn.register_forward_pre_hook(self._documents_apart, with_kwargs=True)
            self.linear_attn.register_forward_hook(self._rows_again)

    @torch.compiler.disable
    def _documents_apart(self, module, args, kwargs):
        positions = self._positions  # [B,S] int64
        if positions is None or args:
            return None
        documents = find_documents(positions)
        if documents.whole_rows:
            return None
        hidden = kwargs["hidden_states"]  # [B,S,H]
        lengths = [end - start for row in documents.spans for start, end in row]
        self._document_lengths = torch.tensor(lengths, device=hidden.device)
        docs = pad_sequence(hidden.reshape(-1, hidden.shape[-1]).split(lengths), batch_first=True)  # [N,Lmax,H]
        return args, {**kwargs, "hidden_states": docs}

    @torch.compiler.disable
    def _rows_again(self, module, args, output: torch.Tensor):
        lengths, self._document_lengths = self._document_lengths, None
        if lengths is None:
            return None
        batch, seq = self._positions.shape
        kept = torch.arange(output.shape[1], device=output.device) < lengths[:, None]  # [N,Lmax] bool
        return output[kept].view(batch, seq, output.shape[-1])  # documents in row order tile the rows


def qwen3_5_problems(config, where: str, fix) -> list[str]:
    """What of a Qwen3.5 config its decoder layers cannot build or compute, one line each (models/config_rules.py)."""
    problems = []
    kinds = sorted({kind for kind in config.layer_types if kind not in (LINEAR_ATTENTION, "full_attention")})
    if kinds:
        problems.append(
            f"{where}: layer_types {config.layer_types!r} names {', '.join(map(repr, kinds))}, which a Qwen3.5 "
            "decoder layer does not build (it builds linear_attention and full_attention layers): "
            + fix("layer_types", "to a list of linear_attention / full_attention, one per layer")
        )
    keys, values = config.linear_num_key_heads, config.linear_num_value_heads
    if keys < 1 or values % keys:
        problems.append(
            f"{where}: linear_num_value_heads {values} is not a multiple of linear_num_key_heads {keys} (each "
            "query/key head of the Gated DeltaNet serves the same number of value heads): "
            + fix("linear_num_value_heads", f"to a multiple of {keys}")
        )
    return problems


def _named(model_type: str | None) -> str:
    return f"model_type {model_type} (Qwen3.5: Gated DeltaNet linear-attention layers)"


def parallel_problems(model_type: str | None, tp: int, sp: int) -> list[str]:
    """Tensor and sequence parallelism with a Qwen3.5 model, refused with the reason (their axes' rules ask; expert
    parallelism splits its routed experts as any Qwen3-MoE's, parallel/expert_parallel.py)."""
    if model_type not in MODEL_TYPES:
        return []
    problems = []
    if tp > 1:
        problems.append(
            f"tensor_parallel {tp} with {_named(model_type)}: the split covers attention and MLP projections only; "
            "the DeltaNet's projections, convolution channels and recurrent heads are not split, and its gated "
            "q_proj (query and gate per head) is not checked against the unsplit model: set tensor_parallel=1 "
            "(more stages or data parallelism instead)"
        )
    if sp > 1:
        problems.append(
            f"sequence_parallel {sp} with {_named(model_type)}: each rank would hold a slice of every row, while "
            "the convolution and the recurrent state run along the whole row (Ulysses exchanges only around the "
            "softmax attention): set sequence_parallel=1 (shorter data.max_seq_length or more stages)"
        )
    return problems


def lora_problems(model_type: str | None) -> list[str]:
    """LoRA with a Qwen3.5 model, refused with the reason (models/lora_rules.py asks)."""
    if model_type not in MODEL_TYPES:
        return []
    return [
        f"peft.method=lora with {_named(model_type)} is not supported yet: peft.target_modules name the "
        "attention and MLP projections, which 3 of every 4 layers (linear attention) lack, the DeltaNet's "
        "in_proj_qkv / in_proj_z / out_proj are not among them, and no adapter parity is tested: train every "
        "weight (peft.method=none)"
    ]


def compile_problems(model_type: str | None) -> list[str]:
    """compile=true with a Qwen3.5 model, refused with the reason (training/compile.py asks)."""
    if model_type not in MODEL_TYPES:
        return []
    return [
        f"compile=true with {_named(model_type)}: transformers' torch gated-delta rule (a triangular solve per "
        "chunk) and the per-document regrouping of packed rows are not checked compiled: set compile=false"
    ]


def objective_problems(model_type: str | None, train_objective: str) -> list[str]:
    """train_objective=grpo with a Qwen3.5 model, refused with the reason (training/configuration/validate.py asks)."""
    if model_type not in MODEL_TYPES or train_objective != "grpo":
        return []
    return [
        f"train_objective=grpo with {_named(model_type)}: generation on the stages (models/generation.py) keeps "
        "a key/value cache per attention layer, not the DeltaNet's convolution and recurrent states, nor its "
        "padding mask for left-padded prompts: use train_objective=sft or dpo"
    ]
