"""Per-GPU memory of a training layout, before booking the GPUs.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, section 3/5): with mixed-precision Adam
every parameter costs 2 bytes (bf16/fp16 weights) + 2 (gradients) + K=12 (fp32 master weights,
momentum, variance). Per GPU, for the parameters Psi of its pipeline stage and DeepSpeed's data-parallel
degree Nd (``Layout.data_axis`` = sequence_parallel x dp: every rank of a sequence group holds the same
weights, so ZeRO shards over the groups' ranks too):

    ZeRO-0   (2 + 2 + K) Psi            ZeRO-2   2 Psi + (2 + K) Psi / Nd
    ZeRO-1   (2 + 2) Psi + K Psi / Nd   ZeRO-3   (2 + 2 + K) Psi / Nd

That is the paper's mixed precision (fp16). DeepSpeed trains bf16 at ZeRO-0 differently: its
pipeline engine then uses BF16_Optimizer, which shards the fp32 master weights and Adam moments over
data-parallel ranks as ZeRO-1 does and keeps a bf16 gradient-accumulation buffer beside the
gradients: 2 Psi + (2 + 2) Psi + K Psi / Nd (measured with training/observation/memory_census.py; the sweep
prints estimate and measurement side by side).

Optimizer offload moves the K part to host memory; ZeRO-3 parameter offload moves the weights too
(the GPU keeps about one layer). What moves is counted as host memory per rank; with ZeRO-1/2 the host
also holds an fp32 copy of the rank's gradient partition for CPU Adam, 4 Psi / Nd (measured; ZeRO-3
writes gradients into its fp32 partitions in place). fp32 training uses 4 + 4 bytes for weights and
gradients and K=8 (momentum, variance) at ZeRO-0, where the weights are their own master copy; ZeRO 1-3
clone them into their fp32 partitions all the same, K=12 (measured with the census).

Activations are estimated for Llama in 16-bit (SDPA/flash attention, so no S x S score matrix is
kept): per decoder layer and micro-batch of B x S tokens, the saved tensors are about
(6 + 2 * kv_heads / heads) * B*S*H + 4 * B*S*F elements (norm inputs/outputs, q/k/v, attention and
projection outputs, the three SwiGLU tensors of width F). Activation checkpointing keeps only the
layer inputs (B*S*H each) plus one layer being recomputed. With the 1F1B pipeline schedule stage p
holds min(stages - p, micro-batches) micro-batches in flight; a layer's backward needs about one
layer's activations more as working memory. The last stage also holds the loss
buffers of one micro-batch (see loss_bytes): the logits of B*S tokens, or of ``loss_chunk_tokens`` of
them with the chunked loss.

Families whose attention is not q/k/v projections of hidden / heads per head replace the (2 + 2 * kv_heads / heads) H
of that count with their own (``Shape.attention_elements``): DeepSeek-V3's multi-head latent attention its latents,
queries and keys of qk_nope + qk_rope features per head and values of v_head_dim (``LatentAttention``); gpt-oss's
sink attention its queries and keys with the sink's extra features (models/family_gpt_oss.py); Qwen3.5's Gated
DeltaNet layers their projections, convolution and gated norm, and the fp32 intermediates of transformers' torch
chunked gated delta rule, chunk matrices and one recurrent state per chunk (``LinearAttention``), averaged with its
softmax layers. Their parameters, sinks included, come from the specs' shapes as every family's.

Sequence parallelism (DeepSpeed Ulysses, ``Layout.sp`` = N ranks per sample): every tensor outside the
attention core (norms, q/k/v projections, MLP, loss) holds S/N tokens of each sample; the core runs on
the whole sequence for heads/N of the heads, the same bytes. So a layer's saved activations, the
checkpointed layer inputs and the unchunked logits are those of B*S/N tokens (a loss chunk stays a chunk).
With tensor parallelism the heads are first divided by tp: per rank q has h = heads/tp heads and k, v
have kv = max(kv_heads/tp, N) (DeepSpeed replicates the KV heads up to N when there are fewer). Around
each attention the all-to-all of q, k, v (forward) and of the output makes temporary copies: each rank
holds, as one layer's working memory, about

    2 (send + receive) x (2 h + 2 kv) x head_dim x B*S/N elements          (ulysses_buffer_bytes)

and sends, per layer and micro-batch, the (N-1)/N of its q, k, v and output that other ranks take:

    (h + 2 kv + h) x head_dim x B*S/N x elem x (N-1)/N bytes  forward      (all_to_all_bytes)

as much again in backward (the gradients go back the same way), and again in the recomputed forward
with activation checkpointing (all_to_all_step_bytes).

LoRA (``Layout.lora_rank`` > 0) trains adapters only: the frozen base costs its weights alone, in the
training precision (with QLoRA, ``Layout.nf4``, the decoder's linear weights in NF4: NF4_BYTES each),
unpartitioned; the adapters of each decoder layer, r (in + out) parameters per
target linear layer, cost what a trained parameter costs above. Activations stay those of the whole
model (backward still runs through every frozen layer), plus the adapters' own r-wide tensors, which are
negligible beside them. No [V,H] gradient exists (the embedding and the LM head are frozen), so the
gradient temporaries are the adapters'.

DualPipeV (``Layout.schedule`` "dualpipev"): the specs are cut into 2 x stages pieces and pipeline rank r holds
piece r (phase 0) and piece 2 x stages - 1 - r (phase 1), rank 0 the embedding and the LM head. A rank's
model states are those of both pieces' parameters; its activations are, per piece, the micro-batches that
piece holds at its peak (from DeepSpeed's own instruction streams, parallel/schedule_sim.py: 2 x stages - r
and r + 1, reached at the same moment) times its per-micro-batch bytes, plus one layer's working memory, as
1F1B. What DeepSpeed's DualPipeV engine keeps besides: its 2 x micro-batches pipe-buffer slots hold tensors
only while a micro-batch is in flight (nothing more); the last rank's turn-around input is a detached view of
its phase-0 output, held until that piece's backward as every stage holds its outputs (nothing more); rank 0
keeps each phase-1 micro-batch's loss tensor until its backward (one in flight: one loss buffer), and frees
the outputs after each backward, so the previous micro-batch's logits that 1F1B's last stage keeps are gone;
its labels (8 bytes a token) wait from the load to the phase-1 backward, negligible.

Mixture of Experts (``Shape.moe``, from the specs' shapes: models/moe_counts.py) with expert parallelism
(``Layout.ep`` = ep): each MoE layer's E experts are divided over ep data-parallel ranks of its stage, so a rank
holds all of its stage's other parameters (attention, norms, routers, embeddings, shared experts) and 1/ep of its
routed experts. Their gradients and optimizer states follow: ZeRO shards the other parameters' states over
DeepSpeed's data axis Nd and the experts' over the Nd / ep ranks holding the same experts (DeepSpeed's
expert-data-parallel group), so ZeRO-1's optimizer states stay K Psi / Nd per rank and the weights and gradients
shrink. A stage's routed experts are its decoder layers' share of the model's (exact when every layer is a MoE
layer, the average otherwise). Per MoE layer and token the saved activations replace the dense MLP's 4 F
elements with those of the token's expert copies, top_k of them (all E for llama4_text: Hugging Face's Llama 4
experts run every token through every expert, scaled by its router score): the gathered input and the expert
output (2 top_k H) and the SwiGLU tensors (4 top_k I, I the expert width), plus the router's logits and
probabilities (2 E) and a shared expert's SwiGLU tensors (4 I_shared; Llama 4's); with ep > 1 a layer's
all-to-alls (dispatch to the experts' ranks and combine back) hold send and receive buffers of tokens x top_k x H
each way as working memory, and each rank sends

    2 (dispatch + combine) x tokens x top_k x H x elem x (ep-1)/ep bytes per MoE layer forward (expert_all_to_all_bytes)

as much again in backward, and again in the recomputed forward with activation checkpointing. The largest
gradient temporary may be a MoE layer's fused expert tensor, [E/ep, 2I, H] on a rank. The formulas hold for any
ZeRO stage; the layouts the search proposes are those train.py runs (parallel/expert_parallel.py's
``ExpertParallelPlan.layout_problems``): a MoE model on the pipeline engine without tensor or sequence parallelism
or DualPipeV, and ep > 1 neither in fp16 nor with the optimizer offloaded in this version.

GRPO (``Layout.generation``, train_objective=grpo): each step first generates its completions on the stages, then
trains on them; the generation's KV cache, logits and sampling temporaries are freed before the training step, so a
stage holds the larger of the two beside its weights and optimizer states, and with grpo.beta > 0 the reference
weights for the whole run (``Estimate.total``; the generation's bytes: parallel/generation_memory.py, which adds
them to these estimates).

FP8 (``Layout.fp8``, torchao 0.18's ``convert_to_float8_training`` on the decoder layers' linears): the master
weights, gradients and optimizer states stay as they are, and so do the saved activations: ``Float8Linear``'s autograd
function saves its input and weight in high precision (``ctx.save_for_backward(input_hp, weight_hp_t)``) and casts
them again in backward. What it adds is working memory, one linear at a time: its backward keeps the float8 casts
of the output gradient (twice, scaled along either axis), of the weight and of the input, 1 byte an element each,
until it returns, and each cast of an n-element tensor holds, in eager, its scaled fp32 copy and the clamped one, 8 n
bytes, beside its float8 result (``hp_tensor_and_scale_to_float8``). Per stage the widest linear counts, with T
tokens of a micro-batch, in and out features i and o (the tensor-parallel rank's share):

    rowwise, tensorwise    8 max(T i, T o, i o) + T i + 2 T o + i o      (fp8_work_bytes)
    rowwise_with_gw_hp     8 max(T o, i o) + T o + i o                   (the weight gradient in high precision)

An upper bound: a tiny Llama's peak on CPU (its ``torch._scaled_mm`` allocating its output alone, as a GPU's kernel
does) rose by 0.45-0.6 of it, the casts' moment finding part of the layer's working memory freed
(tests/test_memory_plan.py). Compiled layers (compile=true) fuse the casts and
lose the fp32 copies; what torch.compile's partitioner then saves for backward is not counted here (the GPU run's
peak memory, benchmarks/bench_train.py, is the check). A scale is one float per row or one per tensor: nothing.

Backward also computes each parameter's gradient into a new tensor before adding it to the accumulated
one (every micro-batch after the first): one parameter's gradient more, at a time. On the first and the
last stage that is the [V,H] embedding or LM head, as large as a loss chunk at a 128k vocabulary
(measured per stage by benchmarks/bench_stage_memory.py).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from models.family_gemma4 import largest
from models.family_gpt_oss import _EXTRA as SINK_FEATURES  # the features its sink attention adds to q and k
from models.family_qwen3_5 import LINEAR_ATTENTION
from models.lora_rules import peft_layout_problems
from models.moe_counts import MoEShape, moe_shape
from parallel.axes import AXES, fp8_layout_problems, grpo_layout_problems
from parallel.axis import ModelFacts
from parallel.layout import GenerationBatch, Layout, layout_problems, tp_dividing
from parallel.schedule_sim import simulated
from parallel.sequence_parallel import SequenceParallelPlan

OFFLOADS = ("none", "optimizer", "params")  # what the fit search offloads: nothing, the optimizer, the weights too
GB = 1e9  # the ZeRO paper and GPU vendors count decimal gigabytes
DS_REDUCE_BUCKET_DEFAULT = 500_000_000  # elements: DeepSpeed's reduce_bucket_size when the JSON has none


def reduce_bucket_elements(total_params: float) -> int:
    """ZeRO-2/3's gradient reduce bucket as train.py sets it: DeepSpeed's default, capped at the model's
    size (the bucket is allocated whole; a larger one holds nothing more)."""
    return int(min(DS_REDUCE_BUCKET_DEFAULT, total_params))


NF4_BYTES = 0.5 + 4 / 64  # QLoRA: bytes per quantised weight (4 bits + bitsandbytes' fp32 absmax per 64)
FP8_CAST_BYTES = 8  # an eager cast's scaled and clamped fp32 copies, per element of the tensor cast
ROW_PARALLEL = ("o_proj", "down_proj")  # the linears tensor parallelism splits by their input (the rest: output)


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention's sizes (DeepSeek-V3: ``q_lora_rank`` ... ``v_head_dim`` of its config)."""

    q_rank: int  # the queries' latent (0: one q_proj, no latent)
    kv_rank: int  # the keys' and values' latent, what generation caches beside the RoPE key
    nope_dim: int  # each head's query/key features without RoPE
    rope_dim: int  # each head's RoPE features (the config's head_dim), one key of them shared by every head
    v_dim: int  # each head's value features

    def elements(self, heads: int) -> int:
        """Saved elements per token of Hugging Face's DeepseekV3Attention (its autograd graph's, counted on CPU): the
        q latent, its RMSNorm's normalised values and output (3 q_rank), the kv projection's output, its latent's
        normalised values and normed latent (3 kv_rank + rope_dim), the queries and the keys (2 heads (nope + rope)),
        kv_b_proj's output, which the values are a view of (heads (nope + v)), and the attention output (heads v)."""
        qk = self.nope_dim + self.rope_dim
        return 3 * self.q_rank + 3 * self.kv_rank + self.rope_dim + heads * (2 * qk + self.nope_dim + 2 * self.v_dim)


@dataclass(frozen=True)
class LinearAttention:
    """Qwen3.5's Gated DeltaNet layers (``linear_*`` of its config): how many, and their heads' sizes."""

    layers: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    chunk: int = 64  # transformers' torch_chunk_gated_delta_rule's chunk_size

    def elements(self) -> int:
        """Saved elements per token in the training precision: the q/k/v projection's output (the convolution's
        input) and the convolution's (silu's input), 2 (2 Hk dk + Hv dv); the gate z, the gated norm's normalised
        values cast back and out_proj's input, 3 Hv dv."""
        qkv = 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
        return 2 * qkv + 3 * self.value_heads * self.value_dim

    def fp32_elements(self) -> float:
        """Saved fp32 elements per token of the torch chunked gated delta rule (what runs without the fla kernels),
        its q and k repeated to the Hv value heads, and of the gated norm: per head 8 dk (q three times, k four,
        k_cumdecay), 6 dv (the values, the solve's, each chunk's v_new, the norm's input, normalised values and
        gate), five [chunk, chunk] matrices per chunk (the pairwise decay, the UT system before and after its mask,
        the intra-chunk scores before and after), the recurrent state [dk, dv] of every chunk and 9 scalars (beta,
        decays, the norm's rsqrt). Counted from the autograd graph of transformers 5.23's module on CPU."""
        h, dk, dv, c = self.value_heads, self.key_dim, self.value_dim, self.chunk
        return h * (8 * dk + 6 * dv + 5 * c + dk * dv / c + 9)


@dataclass(frozen=True)
class Shape:
    """What the activation estimate needs from the architecture."""

    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int = 0  # 0: hidden / heads
    moe: MoEShape | None = None  # a Mixture-of-Experts model's experts (models/moe_counts.py); None: dense
    model_type: str | None = None  # the config's (train.py's rules name it; llama4_text has no expert parallelism)
    mla: LatentAttention | None = None  # multi-head latent attention (DeepSeek-V3) instead of q/k/v projections
    sink_features: int = 0  # gpt-oss: features its sink attention adds to each query and key
    linear: LinearAttention | None = None  # Qwen3.5's linear-attention layers beside its softmax ones

    def attention_elements(self, kv: float) -> float:
        """Saved attention elements per token of a decoder layer, averaged over the layers, with ``kv`` KV heads (as
        many as Ulysses' replicas make): (2 + 2 kv / heads) H for softmax attention (q and its output, k and v, each
        head hidden / heads wide); MLA's (:meth:`LatentAttention.elements`); with sinks, q and k (head_dim + the
        sink's features wide), v and the output (head_dim); a linear-attention layer's
        (:meth:`LinearAttention.elements`, its fp32 ones apart: :meth:`fp32_elements`)."""
        if self.mla is not None:
            return self.mla.elements(self.heads)
        if self.sink_features:
            d = self.head_dim or self.hidden // self.heads
            return (self.heads + kv) * (d + self.sink_features) + (kv + self.heads) * d
        softmax = (2 + 2 * kv / self.heads) * self.hidden
        if self.linear is None:
            return softmax
        n = self.linear.layers
        return ((self.layers - n) * softmax + n * self.linear.elements()) / self.layers

    def fp32_elements(self) -> float:
        """Saved fp32 elements per token of a decoder layer beyond :meth:`attention_elements`, averaged over the
        layers: the linear-attention layers' gated delta rule; 0 elsewhere."""
        if self.linear is None:
            return 0.0
        return self.linear.layers * self.linear.fp32_elements() / self.layers

    def stage_experts(self, layers: int) -> float:
        """Routed-expert parameters of a stage with ``layers`` decoder layers (the layers' share of the model's)."""
        return self.moe.expert_params * layers / self.layers if self.moe is not None and layers else 0.0

    def mlp_elements(self) -> float:
        """Saved MLP activation elements per token of a decoder layer, averaged over the layers: the dense SwiGLU's
        4 F; a MoE layer's, for the r experts each token runs through (``MoEShape.experts_per_token``: top_k, all E
        for llama4_text), 2 r H (gathered inputs, expert outputs) + 4 r I (the experts' SwiGLU) + 2 E (router
        logits and probabilities) + a shared expert's SwiGLU, 4 I_shared."""
        if self.moe is None:
            return 4 * self.ffn
        m = self.moe
        r = m.experts_per_token
        routed = 2 * r * self.hidden + 4 * r * m.expert_width + 2 * m.num_experts + 4 * m.shared_width
        return ((self.layers - m.moe_layers) * 4 * self.ffn + m.moe_layers * routed) / self.layers

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of a decoder layer, by its Hugging Face name (MLA: its q/kv latent
        projections instead of q_proj, k_proj, v_proj)."""
        d = self.head_dim or self.hidden // self.heads
        h, f, q, kv = self.hidden, self.ffn, self.heads * d, self.kv_heads * d
        if self.mla is not None:
            m, n = self.mla, self.heads
            query = {"q_a_proj": (h, m.q_rank), "q_b_proj": (m.q_rank, n * (m.nope_dim + m.rope_dim))}
            return {
                **(query if m.q_rank else {"q_proj": (h, n * (m.nope_dim + m.rope_dim))}),
                "kv_a_proj_with_mqa": (h, m.kv_rank + m.rope_dim),
                "kv_b_proj": (m.kv_rank, n * (m.nope_dim + m.v_dim)),
                "o_proj": (n * m.v_dim, h),
                "gate_proj": (h, f),
                "up_proj": (h, f),
                "down_proj": (f, h),
            }
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, f),
            "up_proj": (h, f),
            "down_proj": (f, h),
        }

    def linear_params_per_layer(self) -> int:
        """Weights of a decoder layer's linear layers: what QLoRA stores in 4 bits."""
        return sum(i * o for i, o in self.linear_dims().values())

    def lora_params_per_layer(self, rank: int, targets: tuple[str, ...]) -> int:
        """Adapter parameters of one decoder layer: A [r, in] and B [out, r] per target the layer has (MLA has no
        q_proj, k_proj, v_proj)."""
        dims = self.linear_dims()
        return sum(rank * (dims[t][0] + dims[t][1]) for t in targets if t in dims)


@dataclass
class Estimate:
    """Bytes per GPU of one pipeline stage (``estimate``: the most loaded one)."""

    params: float
    grads: float
    optimizer: float
    activations: float | None  # None: no architecture given (a bare parameter count)
    stage: int
    host: float = 0.0  # offloaded model states, in host memory (per rank)
    buffers: float = 0.0  # ZeRO-2/3's gradient reduce bucket (the paper's "temporary buffers"): ZeRO-2
    # allocates it for each backward and releases it after (a peak), ZeRO-3 keeps it
    loss: float = 0.0  # the last stage's logits and cross-entropy buffers (see loss_bytes)
    # gradient temporaries: the largest parameter's gradient as backward computes it (grad_temp_bytes),
    # or ZeRO-1/2's optimizer step beyond the activations and loss buffer it follows (optimizer_step_bytes)
    grad_temp: float = 0.0
    parameters: float = 0.0  # the stage's parameter count
    experts: float = 0.0  # of those, routed-expert parameters held per GPU (the stage's / ep)
    snapshot: float = 0.0  # save_async: the host copy of what the rank writes at a save (per rank; host memory)
    # train_objective=grpo (parallel/generation_memory.py): the generation's peak, its KV cache of it, and the
    # reference weights (grpo.beta > 0), resident the whole run
    generation: float = 0.0
    kv_cache: float = 0.0
    reference: float = 0.0
    fp8: float = 0.0  # fp8: the widest Float8Linear's backward casts (fp8_work_bytes), beside the activations

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def training(self) -> float:
        """What the training step holds beyond the resident weights, states and bucket."""
        return (self.activations or 0.0) + self.loss + self.grad_temp + self.fp8

    @property
    def total(self) -> float:
        """The resident bytes and the larger of the training step's and the generation's: GRPO generates before the
        step and frees the KV cache first (parallel/pipeline_generation.py), so the two never meet."""
        return self.model_states + self.buffers + self.reference + max(self.training, self.generation)


def model_state_bytes(psi: float, layout: Layout, experts: float = 0.0) -> tuple[float, float, float, float]:
    """(weights, gradients, optimizer states) bytes per GPU, and offloaded bytes per rank on the host,
    for ``psi`` parameters of one stage, ``experts`` of them routed experts: 1/ep of those on each rank, their
    states sharded over the data axis / ep ranks that hold the same experts."""
    if not experts:
        return replica_state_bytes(psi, layout, layout.data_axis)
    dense = replica_state_bytes(psi - experts, layout, layout.data_axis)
    routed = replica_state_bytes(experts / layout.ep, layout, layout.data_axis / layout.ep)
    return tuple(a + b for a, b in zip(dense, routed))


def replica_state_bytes(psi: float, layout: Layout, nd: float) -> tuple[float, float, float, float]:
    """:func:`model_state_bytes` of ``psi`` parameters that ``nd`` ranks hold alike (ZeRO's data-parallel degree)."""
    w, g, k = (4, 4, 8 if layout.zero == 0 else 12) if layout.dtype == "fp32" else (2, 2, 12)
    shard = {0: (1, 1, 1), 1: (1, 1, nd), 2: (1, nd, nd), 3: (nd, nd, nd)}[layout.zero]
    if layout.dtype == "bf16" and layout.zero == 0:
        g, shard = g + 2, (1, 1, nd)  # DeepSpeed's BF16_Optimizer: + accumulation buffer, states sharded
    params, grads, optim = w * psi / shard[0], g * psi / shard[1], k * psi / shard[2]
    host = 0.0
    if layout.offload_optimizer:
        host, optim = optim, 0.0
        if layout.zero in (1, 2):
            host += 4 * psi / nd  # fp32 gradient partition for CPU Adam
    if layout.offload_params:
        host, params = host + params, 0.0
    return params, grads, optim, host


def local_params(psi: float, layout: Layout, shape: Shape | None, layers: int | None) -> tuple[float, float]:
    """(parameters, routed-expert parameters) of a stage's ``psi`` parameters and ``layers`` decoder layers on one of
    its tensor-parallel ranks, before expert parallelism divides the experts."""
    psi = psi / layout.tp
    experts = min(psi, shape.stage_experts(layers) / layout.tp) if shape is not None and layers is not None else 0.0
    return psi, experts


def frozen_weight_bytes(psi: float, experts: float, layout: Layout) -> float:
    """Bytes of frozen weights (no gradient, no optimizer state) held per GPU: :func:`local_params`' ``psi``, its
    routed ``experts`` divided over ``layout.ep``, in the training precision."""
    return elem_bytes(layout) * (psi - experts + experts / layout.ep)


def elem_bytes(layout: Layout) -> int:
    """Bytes of one activation element: fp32, or 16-bit in mixed precision."""
    return 4 if layout.dtype == "fp32" else 2


def local_tokens(layout: Layout) -> float:
    """Tokens of one micro-batch on each rank: B*S (2B*S for B preference pairs), or that / N with sequence
    parallelism."""
    return layout.micro_batch * layout.rows_per_sample * layout.seq_len / layout.sp


def ulysses_heads(shape: Shape, layout: Layout) -> tuple[float, float, int]:
    """(q heads, k/v heads, head_dim) of one rank before Ulysses' all-to-all: heads/tp and kv_heads/tp,
    the KV heads replicated up to sp where there are fewer (DeepSpeed's UlyssesSPAttentionHF)."""
    kv = shape.kv_heads / layout.tp
    return (
        shape.heads / layout.tp,
        max(kv, layout.sp) if layout.sp > 1 else kv,
        shape.head_dim or shape.hidden // shape.heads,
    )


def layer_activation_bytes(shape: Shape, layout: Layout) -> float:
    """Saved activations of one decoder layer for one micro-batch (see the module's docstring). With
    tensor parallelism the norms' inputs and outputs (4 H per token) stay whole on every rank; q, the
    attention output, k/v and the SwiGLU tensors are split over the tp ranks (Megatron's count). With
    sequence parallelism every term is that of B*S/sp tokens (k/v with DeepSpeed's replicated KV heads)."""
    kv = ulysses_heads(shape, layout)[1] * layout.tp  # kv_heads, or as many as DeepSpeed's replicas make
    split = shape.attention_elements(kv) + shape.mlp_elements()
    saved = (4 * shape.hidden + split / layout.tp) * local_tokens(layout) * elem_bytes(layout)
    fp32 = shape.fp32_elements()
    return saved + 4 * fp32 / layout.tp * local_tokens(layout) if fp32 else saved


def expert_buffer_bytes(shape: Shape, layout: Layout) -> float:
    """One MoE layer's all-to-all working memory with expert parallelism (0 without): send and receive buffers of
    the routed tokens' copies, tokens x top_k x H, for the dispatch and for the combine."""
    if layout.ep == 1 or shape.moe is None:
        return 0.0
    return 4 * local_tokens(layout) * shape.moe.top_k * shape.hidden * elem_bytes(layout)


def expert_all_to_all_bytes(shape: Shape, layout: Layout) -> float:
    """Bytes each rank sends in one MoE layer's all-to-alls for one micro-batch, forward: its tokens' top_k copies
    to the experts' ranks and their outputs back, the (ep-1)/ep that leave the rank; backward sends as much again.
    0 without expert parallelism."""
    if shape.moe is None:
        return 0.0
    ep = layout.ep
    return 2 * local_tokens(layout) * shape.moe.top_k * shape.hidden * elem_bytes(layout) * (ep - 1) / ep


def expert_all_to_all_step_bytes(shape: Shape, layout: Layout, layers_on_stage: int) -> float:
    """Bytes each rank of a stage with ``layers_on_stage`` decoder layers (their share of the MoE layers) sends in the
    experts' all-to-alls per optimizer step: every micro-batch's forward and backward, and with activation
    checkpointing the recomputed forward."""
    if shape.moe is None:
        return 0.0
    moe_layers = layers_on_stage * shape.moe.moe_layers / shape.layers
    passes = 3 if layout.checkpointing else 2
    return expert_all_to_all_bytes(shape, layout) * moe_layers * layout.grad_accum * passes


def ulysses_buffer_bytes(shape: Shape, layout: Layout) -> float:
    """One layer's all-to-all working memory with sequence parallelism (0 without): send and receive
    copies of q, k, v and the attention output, 2 (2 h + 2 kv) head_dim B*S/sp elements."""
    if layout.sp == 1:
        return 0.0
    q, kv, head_dim = ulysses_heads(shape, layout)
    return 2 * (2 * q + 2 * kv) * head_dim * local_tokens(layout) * elem_bytes(layout)


def all_to_all_bytes(shape: Shape, layout: Layout) -> float:
    """Bytes each rank sends in Ulysses' all-to-alls for one decoder layer and one micro-batch, forward
    (q, k, v and the output; the (sp-1)/sp of them other ranks take); backward sends as much again.
    0 without sequence parallelism."""
    q, kv, head_dim = ulysses_heads(shape, layout)
    sp = layout.sp
    return (q + 2 * kv + q) * head_dim * local_tokens(layout) * elem_bytes(layout) * (sp - 1) / sp


def all_to_all_step_bytes(shape: Shape, layout: Layout, layers_on_stage: int) -> float:
    """Bytes each rank of a stage with ``layers_on_stage`` decoder layers sends in Ulysses' all-to-alls
    per optimizer step: every micro-batch's forward and backward, and with activation checkpointing the
    recomputed forward."""
    passes = 3 if layout.checkpointing else 2
    return all_to_all_bytes(shape, layout) * layers_on_stage * layout.grad_accum * passes


def micro_batch_activation_bytes(shape: Shape, layout: Layout, layers_on_stage: int) -> float:
    """What one micro-batch in flight keeps on a stage of ``layers_on_stage`` decoder layers: every saved
    activation, or with activation checkpointing only the layer inputs."""
    if layout.checkpointing:
        return layers_on_stage * shape.hidden * local_tokens(layout) * elem_bytes(layout)
    return layers_on_stage * layer_activation_bytes(shape, layout)


def in_flight(layout: Layout, stage: int) -> list[int]:
    """The most micro-batches whose activations each piece of pipeline rank ``stage`` holds at once, in
    ``Layout.rank_pieces`` order: 1F1B min(stages - stage, grad_accum); DualPipeV from DeepSpeed's
    instruction streams (parallel/schedule_sim.py)."""
    if layout.schedule != "dualpipev":
        return [min(layout.stages - stage, layout.grad_accum)]
    return list(simulated("dualpipev", layout.stages, layout.grad_accum).in_flight[stage])


def activation_bytes(shape: Shape, layout: Layout, stage: int, layers_on_stage: int | list[int]) -> float:
    """Peak activation memory of stage ``stage``: the micro-batches it holds in flight (1F1B: min(stages -
    stage, grad_accum); DualPipeV: per piece, ``layers_on_stage`` then one count per piece, see
    :func:`in_flight`), plus one layer's backward working memory (the gradients of its activations,
    measured about one layer's saved activations), plus with activation checkpointing the one layer
    being recomputed, plus with sequence parallelism one layer's all-to-all buffers."""
    pieces = layers_on_stage if isinstance(layers_on_stage, list) else [layers_on_stage]
    if not sum(pieces):
        return 0.0
    held = sum(
        n * micro_batch_activation_bytes(shape, layout, layers) for n, layers in zip(in_flight(layout, stage), pieces)
    )
    layer = layer_activation_bytes(shape, layout)
    recompute = layer if layout.checkpointing else 0.0
    work = layer + ulysses_buffer_bytes(shape, layout) + expert_buffer_bytes(shape, layout)
    return held + recompute + work


def fp8_work_bytes(shape: Shape, layout: Layout, layers_on_stage: int | list[int] | None = None) -> float:
    """The FP8 working memory of a stage (see the module's docstring): its widest Float8Linear's backward casts, for
    the micro-batch's tokens on this rank and the linear's tensor-parallel share; 0 without ``Layout.fp8`` or where
    the stage has no decoder layer."""
    layers = sum(layers_on_stage) if isinstance(layers_on_stage, list) else layers_on_stage
    if not layout.fp8 or layers == 0:
        return 0.0
    t, worst = local_tokens(layout), 0.0
    for name, (i, o) in shape.linear_dims().items():
        i, o = (i / layout.tp, o) if name in ROW_PARALLEL else (i, o / layout.tp)
        if layout.fp8 == "rowwise_with_gw_hp":  # the weight gradient's matmul in high precision: no casts for it
            work = FP8_CAST_BYTES * max(t * o, i * o) + t * o + i * o
        else:
            work = FP8_CAST_BYTES * max(t * i, t * o, i * o) + t * i + 2 * t * o + i * o
        worst = max(worst, work)
    return worst


def loss_bytes(shape: Shape, layout: Layout) -> float:
    """The last stage's loss-side peak for one micro-batch, per logit of the tokens the LM head takes at once.

    Whole (``loss_chunk`` 0): the logits in the training precision and, for the cross entropy, their fp32
    copy, the fp32 log-probabilities it keeps for backward and their gradient: elem + 12 bytes (16 in
    fp32, where the copy is the logits themselves and backward makes one more). DeepSpeed's pipeline
    engine keeps a stage's outputs, here the previous micro-batch's logits, until the next forward has
    replaced them: elem more with several micro-batches per step. Chunked (models.loss.ChunkedLMHeadLoss):
    one chunk of fp32 logits, worked in place, plus its 16-bit matmul output in bf16: 4 + elem bytes (4
    in fp32). Measured in fp32: 16.1 and 4.5 bytes per logit for the loss alone
    (benchmarks/bench_loss_memory.py), 20 and 4 on a pipeline's last stage (benchmarks/bench_stage_memory.py).
    With sequence parallelism each rank takes the logits of its B*S/sp tokens.
    """
    tokens = local_tokens(layout)
    elem = elem_bytes(layout)
    if layout.loss_chunk and layout.loss_chunk < tokens:  # with tensor parallelism, this rank's vocabulary slice
        return layout.loss_chunk * shape.vocab / layout.tp * (4 + (0 if elem == 4 else elem))
    # DualPipeV frees a micro-batch's outputs after its backward: no previous logits kept
    kept = elem if layout.stages > 1 and layout.grad_accum > 1 and layout.schedule != "dualpipev" else 0
    return tokens * shape.vocab * (elem + 12 + kept)


def grad_temp_bytes(shape: Shape, layout: Layout, stage: int, layers_on_stage: int | list[int]) -> float:
    """One gradient of the stage's largest parameter, computed before it is added to the accumulated
    one (ZeRO-2/3: before it is reduced into the rank's partition), beyond what :func:`activation_bytes`
    already counts at that moment. None at ZeRO-0/1 with one micro-batch per step, where the first
    gradient becomes the accumulated one.

    The last stage's LM head runs backward first, with all of the micro-batch's activations alive: the
    whole [V,H] gradient counts. Elsewhere the largest is the first stage's [V,H] embedding, whose
    backward runs last, once the micro-batch has freed its activations and its layer's working memory,
    or a middle stage's widest layer matrix [F,H]: only what exceeds those counts (measured per stage by
    benchmarks/bench_stage_memory.py). DualPipeV: rank 0 holds the LM head (the last stage's case); elsewhere
    what its smaller piece frees counts (``layers_on_stage``: one count per piece)."""
    if layout.zero < 2 and layout.grad_accum == 1:
        return 0.0
    elem = (4 if layout.dtype == "fp32" else 2) / layout.tp  # every large matrix is split over the tp ranks
    experts = shape.moe.largest_expert_tensor / layout.ep if shape.moe is not None else 0  # [E/ep, 2I, H]
    if stage == layout.label_stage:
        return max(shape.vocab * shape.hidden, experts) * elem
    if isinstance(layers_on_stage, list):
        layers_on_stage = min((n for n in layers_on_stage if n), default=0)
    largest = max(shape.vocab * shape.hidden if stage == 0 else shape.ffn * shape.hidden, experts) * elem
    if layers_on_stage == 0:
        return largest if stage == 0 else 0.0
    freed = micro_batch_activation_bytes(shape, layout, layers_on_stage) + layer_activation_bytes(shape, layout)
    return max(0.0, largest - freed)


def optimizer_step_bytes(psi: float, layout: Layout) -> float:
    """ZeRO-1/2's optimizer step, beyond the model states: the rank's partition of the gradients
    flattened (training precision) and its fp32 copy, both beside the gradients (measured on CPU ranks,
    DeepSpeed 0.19.8, by benchmarks/bench_stage_memory.py). The activations are gone by then. With the
    optimizer offloaded the fp32 gradient partition is the host's (``model_state_bytes``)."""
    if layout.zero not in (1, 2) or layout.offload_optimizer:
        return 0.0
    return psi / layout.data_axis * ((4 if layout.dtype == "fp32" else 2) + 4)


def stage_estimate(
    stage: int, psi: float, layers: int | list[int] | None, layout: Layout, shape: Shape | None, total_params: float
) -> Estimate:
    """Per-GPU memory of stage ``stage`` holding ``psi`` parameters and ``layers`` decoder layers (with
    LoRA, ``psi`` counts the frozen base; the adapters come on top, from the shape). With tensor
    parallelism each GPU holds psi / tp (the whole RMSNorm weights it also keeps are a rounding error).
    DualPipeV: ``psi`` is the rank's two pieces' parameters, ``layers`` one count per piece."""
    pieces = layers if isinstance(layers, list) else None
    layers = sum(pieces) if pieces is not None else layers
    psi, experts = local_params(psi, layout, shape, layers)
    trained, frozen_bytes, trained_experts = psi, 0.0, experts
    if layout.lora_rank and shape is not None and layers is not None:
        trained, trained_experts = float(layers * shape.lora_params_per_layer(layout.lora_rank, layout.lora_targets)), 0
        frozen_bytes = frozen_weight_bytes(psi, experts, layout)
        if layout.nf4:  # the decoder's linear weights in 4 bits plus an fp32 absmax per block of 64
            linear = layers * shape.linear_params_per_layer()
            frozen_bytes -= ((4 if layout.dtype == "fp32" else 2) - NF4_BYTES) * linear
    params, grads, optim, host = model_state_bytes(trained, layout, trained_experts)
    snapshot = 0.0
    if layout.save_async:  # the trained weights it writes and its optimizer states (offloaded or not), until written
        on_gpu = dataclasses.replace(layout, offload_optimizer=False, offload_params=False)
        weights, _, states, _ = model_state_bytes(trained, on_gpu, trained_experts)
        snapshot = weights + states
    params += frozen_bytes
    acts, loss, grad_temp, fp8 = None, 0.0, 0.0, 0.0
    if shape is not None:
        by_piece = pieces if pieces is not None else layers
        acts = activation_bytes(shape, layout, stage, by_piece)
        loss = loss_bytes(shape, layout) if stage == layout.label_stage else 0.0
        # The larger of backward's gradient temporary and the optimizer step's, which runs once the
        # activations and the loss buffer are freed.
        step = optimizer_step_bytes(trained, layout) - (acts + loss)
        temp = 0.0 if layout.lora_rank else grad_temp_bytes(shape, layout, stage, by_piece)
        grad_temp = max(temp, step)
        fp8 = fp8_work_bytes(shape, layout, by_piece)
    buffers = 0.0
    if layout.zero >= 2:  # one 16-bit (fp32 for fp32 training) bucket per rank, allocated whole
        buffers = (4 if layout.dtype == "fp32" else 2) * reduce_bucket_elements(total_params)
    return Estimate(
        params,
        grads,
        optim,
        acts,
        stage,
        host,
        buffers,
        loss,
        grad_temp,
        psi + trained * bool(frozen_bytes),
        experts / layout.ep,
        snapshot,
        fp8=fp8,
    )


def stage_estimates(
    stage_params: list[float], layout: Layout, shape: Shape | None = None, stage_layers: list[int] | None = None
) -> list[Estimate]:
    """Per-GPU memory of every pipeline rank. ``stage_params[p]``, ``stage_layers[p]``: parameters and
    decoder layers of piece p (as ``parallel.partition.splitter`` gives them: a piece per stage, two per rank
    with DualPipeV, ``Layout.rank_pieces``)."""
    total = sum(stage_params)
    layers = stage_layers or [None] * len(stage_params)
    if layout.schedule != "dualpipev":
        return [stage_estimate(p, psi, layers[p], layout, shape, total) for p, psi in enumerate(stage_params)]
    out = []
    for rank in range(layout.stages):
        held = layout.rank_pieces(rank)
        rank_layers = None if stage_layers is None else [layers[p] for p in held]
        out.append(stage_estimate(rank, sum(stage_params[p] for p in held), rank_layers, layout, shape, total))
    return out


def estimate(
    stage_params: list[float], layout: Layout, shape: Shape | None = None, stage_layers: list[int] | None = None
) -> Estimate:
    """Per-GPU memory of the most loaded stage (the first of equals)."""
    return max(stage_estimates(stage_params, layout, shape, stage_layers), key=lambda e: e.total)


def layouts_for(
    gpus: int,
    num_layers: int | None,
    micro_batch: int,
    seq_len: int,
    grad_accum: int,
    dtype: str,
    loss_chunk: int = 0,
    lora: tuple = (0, (), False),
    tp_values: tuple[int, ...] = (1,),
    sp_values: tuple[int, ...] = (1,),
    shape: Shape | None = None,
    schedules: tuple[str, ...] = ("1f1b",),
    ep_values: tuple[int, ...] = (1,),
    zero_values: tuple[int, ...] = (0, 1, 2, 3),
    offload_values: tuple[str, ...] = OFFLOADS,
    refusals: list[str] | None = None,
    generation: GenerationBatch | None = None,
    fp8: str | None = None,
):
    """Every layout worth trying on ``gpus`` GPUs that train.py runs (:func:`refusals_of`: the rules its validation
    asks), cheapest in communication and compute first; with ``lora`` (rank, target modules, nf4) LoRA layouts;
    each pipeline with every schedule of ``schedules`` that train.py runs it with (DualPipeV: 2 stages or
    more, grad_accum >= 2 x stages, 2 x stages <= num_layers, no tensor or sequence parallelism); each ZeRO stage
    of ``zero_values`` and offload of ``offload_values`` (none, optimizer, params). ``refusals``: train.py's lines
    for the layouts it refuses that break the fewest of its rules are added to it (each line once). ``generation``:
    train_objective=grpo's (``Layout.generation``), whose rules the layouts keep. ``fp8``: every layout's recipe.

    Order: no offload before optimizer offload before parameter offload; no activation checkpointing
    before checkpointing (sequence parallelism saves the recomputation: its all-to-alls move less than tensor
    parallelism's all-reduces); lower ZeRO stage first; a smaller pipeline bubble (fewer pipeline stages;
    DualPipeV's is below 1F1B's on as many) first;
    less tensor parallelism (``tp_values``, each within a node) first; less sequence parallelism
    (``sp_values``, those :func:`sequence_parallel_fits` allows for ``shape``; none without one) first; less
    expert parallelism (``ep_values``, those train.py runs: ``ExpertParallelPlan.layout_problems``) first.
    """
    candidates, nearest, fewest = [], [], float("inf")
    for stages in (s for s in range(1, gpus + 1) if gpus % s == 0 and (num_layers is None or s <= num_layers)):
        options = itertools.product(
            tp_values, sp_values, ep_values, zero_values, offload_values, (False, True), schedules
        )
        for tp, sp, ep, zero, offload, ckpt, schedule in options:
            opt_off, par_off = offload != "none", offload == "params"  # parameter offload with optimizer offload
            if sp > 1 and shape is None:
                continue  # the planner's own: Ulysses needs the heads
            layout = Layout(
                stages,
                gpus // (stages * tp * sp),
                zero,
                opt_off,
                par_off,
                micro_batch,
                seq_len,
                grad_accum,
                ckpt,
                dtype,
                loss_chunk,
                *lora,
                tp=tp,
                sp=sp,
                ep=ep,
                schedule=schedule,
                generation=generation,
                fp8=fp8,
            )
            problems = refusals_of(layout, gpus, num_layers, shape)
            if problems:
                if refusals is not None:  # those of the layouts nearest to one train.py runs: the fewest lines
                    fewest = min(fewest, len(problems))
                    nearest += [problems]
                continue
            candidates.append(((par_off + opt_off, ckpt, zero, bubble_fraction(layout), tp, sp, ep), layout))
    if refusals is not None:
        refusals += dict.fromkeys(line for problems in nearest if len(problems) == fewest for line in problems)
    return [layout for _, layout in sorted(candidates, key=lambda c: c[0])]


def refusals_of(layout: Layout, gpus: int, num_layers: int | None, shape: Shape | None) -> list[str]:
    """train.py's lines refusing ``layout`` on ``gpus`` GPUs ([]: it runs it): the rules
    ``training.configuration.validate.resolve`` asks, on the layout alone (parallel/layout.py: its sizes, ZeRO stage and
    offload; each axis's ``layout_problems``, with the model's facts from ``shape``: parallel.axes.AXES), rows fed
    whole; LoRA's on the pipeline engine (models.lora_rules.peft_layout_problems); with ``Layout.generation``,
    train_objective=grpo's on the layout (the pipeline engine, each axis's ``objective_problems``); with ``Layout.fp8``,
    fp8's (the pipeline engine, each axis's ``fp8_problems``)."""
    problems = layout_problems(layout, gpus, "compute", num_layers)
    model = model_facts(shape, num_layers)
    for axis in AXES:
        problems += axis.layout_problems(layout, model)
    if layout.generation is not None:
        problems += grpo_layout_problems(layout)
    if layout.fp8:
        problems += fp8_layout_problems(layout, layout.fp8)
    return problems + peft_layout_problems(layout)


def model_facts(shape: Shape | None, num_layers: int | None = None) -> ModelFacts:
    """What the axes' rules read of the model (parallel.axis.ModelFacts), from ``shape``: 0 experts for a dense model
    or a bare parameter count (no heads known), which expert parallelism cannot split."""
    if shape is None:
        return ModelFacts(num_layers=num_layers, num_experts=0)
    experts = shape.moe.num_experts if shape.moe is not None else 0
    return ModelFacts(num_layers, shape.heads, shape.kv_heads, shape.model_type, experts)


def expert_parallel_sizes(shape: Shape | None, gpus: int) -> tuple[int, ...]:
    """The expert_parallel values the fit search tries: every divisor of the model's experts up to ``gpus`` (each
    layout keeps those train.py runs, ``ExpertParallelPlan.layout_problems``); 1 for a dense model."""
    if shape is None or shape.moe is None:
        return (1,)
    return tuple(n for n in range(1, min(gpus, shape.moe.num_experts) + 1) if shape.moe.num_experts % n == 0)


def bubble_fraction(layout: Layout) -> float:
    """The share of a step a stage idles with equal pieces: DeepSpeed's 1F1B (p - 1) / (m + p - 1);
    DualPipeV simulated from its instruction streams (parallel/schedule_sim.py)."""
    if layout.schedule == "dualpipev":
        return simulated("dualpipev", layout.stages, layout.grad_accum).idle_share
    return (layout.stages - 1) / (layout.grad_accum + layout.stages - 1)


def layout_bubble(layout: Layout, piece_layers: list[float] | None) -> float:
    """The share of a step the pipeline ranks idle, simulated from the instruction streams train.py runs with
    each piece's compute in decoder layers (``piece_layers``: ``parallel.partition.splitter``'s ``split.work``;
    None: equal pieces), backward twice forward, half of it DualPipeV's deferred weight gradients."""
    if layout.stages == 1:
        return 0.0
    if piece_layers is None or not any(piece_layers):
        return bubble_fraction(layout)
    return simulated(layout.schedule, layout.stages, layout.grad_accum, piece_layers).idle_share


def tensor_parallel_sizes(shape: Shape | None, node_gpus: int = 8) -> tuple[int, ...]:
    """The tensor_parallel values a model allows within one node: each divides its heads, KV heads,
    intermediate size and vocabulary (parallel.tensor_parallel.model_problems); any, for a bare count."""
    sizes = [t for t in (1, 2, 4, 8, 16) if t <= node_gpus]
    if shape is None:
        return tuple(sizes)
    if shape.moe is not None:  # no tensor parallelism with experts (ExpertParallelPlan.layout_problems)
        return (1,)
    return tuple(tp_dividing((shape.heads, shape.kv_heads, shape.ffn, shape.vocab), sizes))


SEQUENCE_PARALLEL_SIZES = (1, 2, 4, 8)  # what the fit search tries (tensor x sequence may span nodes)


def sequence_parallel_fits(shape: Shape, tp: int, sp: int, seq_len: int) -> bool:
    """Whether Ulysses can split ``seq_len`` tokens over ``sp`` ranks after tensor parallelism ``tp``:
    each rank gets whole attention heads (sp divides heads/tp), the KV heads split or are replicated (sp
    and kv_heads/tp, one divides the other) and the sequence splits evenly: the model-side rules of
    ``SequenceParallelPlan.layout_problems``, which also has train.py's lines for them."""
    model = ModelFacts(heads=shape.heads, kv_heads=shape.kv_heads)
    return not SequenceParallelPlan.layout_problems(Layout(tp=tp, sp=sp, seq_len=seq_len), model)


def fitting(
    split,
    shape: Shape | None,
    gpus: int,
    gpu_mem_gb: float,
    num_layers: int | None,
    micro_batch: int,
    seq_len: int,
    grad_accum: int,
    dtype: str,
    loss_chunk: int = 0,
    lora: tuple = (0, (), False),
    max_sp: int = SEQUENCE_PARALLEL_SIZES[-1],
    schedules: tuple[str, ...] = ("1f1b",),
    ep_values: tuple[int, ...] | None = None,
    zero_values: tuple[int, ...] = (0, 1, 2, 3),
    offload_values: tuple[str, ...] = OFFLOADS,
    refusals: list[str] | None = None,
    generation: GenerationBatch | None = None,
    plan=None,
    fp8: str | None = None,
) -> list[tuple[Layout, Estimate]]:
    """Layouts whose most loaded GPU fits ``gpu_mem_gb``, cheapest first (see layouts_for).

    ``split(layout)`` gives (parameters per piece, decoder layers per piece or None); ``max_sp``: the largest
    sequence parallelism tried (1: none); ``schedules``: the pipeline schedules tried; ``ep_values``: the expert
    parallelism tried (None: every one the model allows, :func:`expert_parallel_sizes`); ``zero_values`` and
    ``offload_values``: the ZeRO stages and offloads tried. ``refusals``, where train.py refuses every layout tried:
    filled with its lines for them (left empty where it runs any, whether or not it fits). ``generation``: each
    layout's (train_objective=grpo, ``layouts_for``); ``plan(params, layout, shape, layers)``: the per-stage estimates
    (None: :func:`stage_estimates`; one that adds the generation: parallel.generation_memory.with_generation);
    ``fp8``: the recipe of ``Layout.fp8`` (None: off).
    """
    plan = plan or stage_estimates
    lines: list[str] = []
    out = []
    tp_values = tensor_parallel_sizes(shape)
    tried = layouts_for(
        gpus,
        num_layers,
        micro_batch,
        seq_len,
        grad_accum,
        dtype,
        loss_chunk,
        lora,
        tp_values,
        tuple(n for n in SEQUENCE_PARALLEL_SIZES if n <= max_sp) if shape is not None else (1,),
        shape,
        schedules,
        expert_parallel_sizes(shape, gpus) if ep_values is None else ep_values,
        zero_values,
        offload_values,
        lines,
        generation,
        fp8,
    )
    if refusals is not None and not tried:
        refusals += lines
    for layout in tried:
        params, layers = split(layout)
        e = max(plan(params, layout, shape, layers), key=lambda s: s.total)
        if e.total <= gpu_mem_gb * GB:
            out.append((layout, e))
    return out


def shape_of(config) -> Shape | None:
    """What the activation estimate needs from a model config; None without one (a bare parameter count)."""
    if config is None:
        return None
    return Shape(
        config.hidden_size,
        getattr(config, "intermediate_size", 0),  # none where every layer is routed (Qwen3.5 MoE)
        config.num_hidden_layers,
        config.num_attention_heads,
        largest(config, "num_key_value_heads"),
        config.vocab_size,
        largest(config, "head_dim") or 0,  # (Gemma 4's layers differ: the widest, models/family_gemma4.py)
        moe_shape(config),
        config.model_type,
        latent_attention(config),
        SINK_FEATURES if config.model_type == "gpt_oss" else 0,
        linear_attention(config),
    )


def latent_attention(config) -> LatentAttention | None:
    """A config's multi-head latent attention (``kv_lora_rank``: DeepSeek-V3's); None for other attention."""
    if getattr(config, "kv_lora_rank", None) is None:
        return None
    return LatentAttention(
        config.q_lora_rank or 0,
        config.kv_lora_rank,
        config.qk_nope_head_dim,
        config.qk_rope_head_dim,
        config.v_head_dim,
    )


def linear_attention(config) -> LinearAttention | None:
    """A config's linear-attention layers (Qwen3.5's ``layer_types``); None without any."""
    layers = sum(kind == LINEAR_ATTENTION for kind in getattr(config, "layer_types", None) or ())
    if not layers:
        return None
    c = config
    return LinearAttention(
        layers, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    )


def stage_table(estimates: list[Estimate], stage_layers: list[int] | None, layout: Layout | None = None) -> list[str]:
    """The planner's per-stage table (GB per GPU; host memory per rank where states are offloaded or save_async
    copies a checkpoint), the
    most loaded stage marked: what scripts/estimate_memory.py and scripts/preflight.py print (g.tmp:
    gradient temporaries, :attr:`Estimate.grad_temp`; experts, for a MoE model: the routed-expert parameters each
    GPU of the stage holds, of its params). With a DualPipeV ``layout`` a row is a pipeline rank and its layers are
    those of its two pieces (``stage_layers``: per piece). train_objective=grpo adds gen (the generation's peak,
    which the training step's does not meet: the total counts the larger) and ref (the reference weights, with
    grpo.beta > 0); fp8 the FP8 casts' working memory (:func:`fp8_work_bytes`)."""
    host, experts = any(e.host + e.snapshot for e in estimates), any(e.experts for e in estimates)
    fp8 = any(e.fp8 for e in estimates)
    grpo = any(e.generation + e.reference for e in estimates)
    head = f"{'stage':>5} {'params':>8}" + (f" {'experts':>8}" if experts else "")
    head += f" {'layers':>6} {'weights':>8} {'grads':>7} {'optim':>7} {'acts':>7} {'loss':>6}"
    head += f" {'g.tmp':>6}" + (f" {'fp8':>6}" if fp8 else "") + (f" {'gen':>6} {'ref':>6}" if grpo else "")
    head += f" {'bucket':>6} {'total':>7}" + (f" {'host':>7}" if host else "")
    rows = [head + "  (params in B, memory in GB)"]
    worst = max(estimates, key=lambda e: e.total)
    for e in estimates:
        held = layout.rank_pieces(e.stage) if layout is not None else [e.stage]
        layers = "-" if stage_layers is None else "+".join(str(stage_layers[p]) for p in held)
        acts = "-" if e.activations is None else f"{e.activations / GB:.2f}"
        row = f"{e.stage:>5} {e.parameters / 1e9:>8.3f}" + (f" {e.experts / 1e9:>8.3f}" if experts else "")
        row += f" {layers:>6} {e.params / GB:>8.2f} {e.grads / GB:>7.2f}"
        row += f" {e.optimizer / GB:>7.2f} {acts:>7} {e.loss / GB:>6.2f} {e.grad_temp / GB:>6.2f}"
        row += f" {e.fp8 / GB:>6.2f}" if fp8 else ""
        row += f" {e.generation / GB:>6.2f} {e.reference / GB:>6.2f}" if grpo else ""
        row += f" {e.buffers / GB:>6.2f} {e.total / GB:>7.2f}"
        row += (f" {(e.host + e.snapshot) / GB:>7.2f}" if host else "") + ("  <- most loaded" if e is worst else "")
        rows.append(row)
    return rows


def sequence_report(layout: Layout, shape: Shape | None, stage_layers: list[int] | None) -> list[str]:
    """What sequence parallelism sends on ``layout``: each rank's all-to-all bytes per layer and per step on its
    most loaded stage (``stage_layers``: decoder layers per stage). Nothing without it, or without an
    architecture."""
    if layout.sp <= 1 or stage_layers is None:
        return []
    most = max(range(layout.stages), key=lambda p: stage_layers[p])
    return [
        f"sequence parallelism (Ulysses all-to-all of q, k, v and the output): each rank sends "
        f"{all_to_all_bytes(shape, layout) / 1e6:.1f} MB per layer per micro-batch forward, "
        f"{all_to_all_step_bytes(shape, layout, stage_layers[most]) / GB:.2f} GB per step on stage {most} "
        f"({stage_layers[most]} layers x {layout.grad_accum} micro-batches x forward, backward"
        f"{', recomputation' if layout.checkpointing else ''})"
    ]


def expert_report(layout: Layout, shape: Shape | None, stage_layers: list[int] | None) -> list[str]:
    """What a Mixture-of-Experts model holds and sends on ``layout``: its experts per rank and, with expert
    parallelism, each rank's all-to-all bytes per MoE layer and per step on its most loaded stage. Nothing for a
    dense model."""
    if shape is None or shape.moe is None or stage_layers is None:
        return []
    m, ep = shape.moe, layout.ep
    every = f" (each token runs all {m.experts_per_token})" if m.experts_per_token != m.top_k else ""
    lines = [
        f"experts: {m.num_experts} per MoE layer on {m.moe_layers} layers, top {m.top_k}{every}, width "
        f"{m.expert_width}; "
        f"{m.expert_params / 1e9:.2f} B routed-expert parameters, {m.num_experts // ep} experts per layer on each rank "
        f"(expert parallelism {ep}; their gradients and optimizer states over {layout.data_axis // ep} ranks each)"
    ]
    if ep == 1:
        return lines + ["  no expert all-to-all (expert parallelism 1: each rank runs every expert of its layers)"]
    most = max(range(layout.stages), key=lambda p: stage_layers[p])
    step = expert_all_to_all_step_bytes(shape, layout, stage_layers[most])
    recomputed = ", recomputation" if layout.checkpointing else ""
    return lines + [
        f"  expert all-to-all (dispatch + combine): each rank sends {expert_all_to_all_bytes(shape, layout) / 1e6:.1f} "
        f"MB per MoE layer per micro-batch forward, {step / GB:.2f} GB per step on stage {most} ({stage_layers[most]} "
        f"layers x {layout.grad_accum} micro-batches x forward, backward{recomputed})"
    ]


def schedule_report(split, layout: Layout, shape: Shape | None) -> list[str]:
    """What the pipeline schedule costs and saves on ``layout`` (``split``: ``parallel.partition.splitter``'s): its
    bubble and, with DualPipeV, the activations of its most loaded rank against 1F1B's on the same layout.
    Nothing for one stage (no pipeline schedule)."""
    if layout.stages == 1:
        return []
    how = "the schedule simulated, each piece's compute from its layers"
    bubble = f"bubble {layout_bubble(layout, split.work(layout)):.0%} of the step"
    if layout.schedule != "dualpipev":
        return [f"pipeline schedule {layout.schedule}: {bubble} ({how})"]
    one_f_one_b = dataclasses.replace(layout, schedule="1f1b")
    params_1f1b, layers_1f1b = split(one_f_one_b)
    base_bubble = layout_bubble(one_f_one_b, split.work(one_f_one_b))
    line = f"pipeline schedule dualpipev: {bubble}, 1F1B's on this layout {base_bubble:.0%} ({how})"
    if shape is None:
        return [line]
    params, layers = split(layout)
    acts = max(e.activations for e in stage_estimates(params, layout, shape, layers))
    base = max(e.activations for e in stage_estimates(params_1f1b, one_f_one_b, shape, layers_1f1b))
    return [
        line,
        f"  largest activations of a rank: {acts / GB:.2f} GB with DualPipeV, {base / GB:.2f} GB with 1F1B "
        f"({(acts - base) / GB:+.2f} GB: rank r holds 2 x stages - r micro-batches of its phase-0 piece and r + 1 of "
        "its phase-1 piece)",
    ]
