"""Per-GPU memory of a training layout, before booking the GPUs.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, section 3/5): with mixed-precision Adam
every parameter costs 2 bytes (bf16/fp16 weights) + 2 (gradients) + K=12 (fp32 master weights,
momentum, variance). Per GPU, for the parameters Psi of its pipeline stage and data-parallel degree Nd:

    ZeRO-0   (2 + 2 + K) Psi            ZeRO-2   2 Psi + (2 + K) Psi / Nd
    ZeRO-1   (2 + 2) Psi + K Psi / Nd   ZeRO-3   (2 + 2 + K) Psi / Nd

That is the paper's mixed precision (fp16). DeepSpeed trains bf16 at ZeRO-0 differently: its
pipeline engine then uses BF16_Optimizer, which shards the fp32 master weights and Adam moments over
data-parallel ranks as ZeRO-1 does and keeps a bf16 gradient-accumulation buffer beside the
gradients: 2 Psi + (2 + 2) Psi + K Psi / Nd (measured with training/memory_census.py; the sweep
prints estimate and measurement side by side).

Optimizer offload moves the K part to host memory; ZeRO-3 parameter offload moves the weights too
(the GPU keeps about one layer). What moves is counted as host memory per rank; with ZeRO-1/2 the host
also holds an fp32 copy of the rank's gradient partition for CPU Adam, 4 Psi / Nd (measured; ZeRO-3
writes gradients into its fp32 partitions in place). fp32 training uses 4 + 4 bytes for weights and gradients and K=8
(momentum, variance; the weights are their own master copy).

Activations are estimated for Llama in 16-bit (SDPA/flash attention, so no S x S score matrix is
kept): per decoder layer and micro-batch of B x S tokens, the saved tensors are about
(6 + 2 * kv_heads / heads) * B*S*H + 4 * B*S*F elements (norm inputs/outputs, q/k/v, attention and
projection outputs, the three SwiGLU tensors of width F). Activation checkpointing keeps only the
layer inputs (B*S*H each) plus one layer being recomputed. With the 1F1B pipeline schedule stage p
holds min(stages - p, micro-batches) micro-batches in flight. The last stage also holds the logits
(B*S*V in 16-bit plus the fp32 copy the loss uses).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from training.layout import Layout

GB = 1e9  # the ZeRO paper and GPU vendors count decimal gigabytes
DS_REDUCE_BUCKET_DEFAULT = 500_000_000  # elements: DeepSpeed's reduce_bucket_size when the JSON has none


def reduce_bucket_elements(total_params: float) -> int:
    """ZeRO-2/3's gradient reduce bucket as train.py sets it: DeepSpeed's default, capped at the model's
    size (the bucket is allocated whole; a larger one holds nothing more)."""
    return int(min(DS_REDUCE_BUCKET_DEFAULT, total_params))


@dataclass(frozen=True)
class Shape:
    """What the activation estimate needs from the architecture."""

    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int


@dataclass
class Estimate:
    """Bytes per GPU on the most loaded stage."""

    params: float
    grads: float
    optimizer: float
    activations: float | None  # None: no architecture given (a bare parameter count)
    stage: int  # which stage is the most loaded
    host: float = 0.0  # offloaded model states, in host memory (per rank)
    buffers: float = 0.0  # ZeRO-2/3's gradient reduce bucket (the paper's "temporary buffers"): ZeRO-2
    # allocates it for each backward and releases it after (a peak), ZeRO-3 keeps it

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.buffers + (self.activations or 0.0)


def model_state_bytes(psi: float, layout: Layout) -> tuple[float, float, float, float]:
    """(weights, gradients, optimizer states) bytes per GPU, and offloaded bytes per rank on the host,
    for ``psi`` parameters of one stage."""
    w, g, k = (4, 4, 8) if layout.dtype == "fp32" else (2, 2, 12)
    nd = layout.dp
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


def activation_bytes(shape: Shape, layout: Layout, stage: int, layers_on_stage: int, last: bool) -> float:
    tokens = layout.micro_batch * layout.seq_len
    elem = 4 if layout.dtype == "fp32" else 2
    per_layer = ((6 + 2 * shape.kv_heads / shape.heads) * shape.hidden + 4 * shape.ffn) * tokens * elem
    if layout.checkpointing:
        per_micro = layers_on_stage * shape.hidden * tokens * elem + per_layer  # inputs + one recomputed layer
    else:
        per_micro = layers_on_stage * per_layer
    in_flight = min(layout.stages - stage, layout.grad_accum)
    logits = tokens * shape.vocab * (elem + 4) if last else 0.0  # 16-bit logits + fp32 copy for the loss
    return in_flight * per_micro + logits


def estimate(
    stage_params: list[float], layout: Layout, shape: Shape | None = None, stage_layers: list[int] | None = None
) -> Estimate:
    """Per-GPU memory of the most loaded stage. ``stage_params[p]``: parameters of stage p."""
    best = None
    for p, psi in enumerate(stage_params):
        params, grads, optim, host = model_state_bytes(psi, layout)
        acts = None
        if shape is not None:
            acts = activation_bytes(shape, layout, p, stage_layers[p], last=p == len(stage_params) - 1)
        buffers = 0.0
        if layout.zero >= 2:  # one 16-bit (fp32 for fp32 training) bucket per rank, allocated whole
            buffers = (4 if layout.dtype == "fp32" else 2) * reduce_bucket_elements(sum(stage_params))
        e = Estimate(params, grads, optim, acts, p, host, buffers)
        if best is None or e.total > best.total:
            best = e
    return best


def layouts_for(gpus: int, num_layers: int | None, micro_batch: int, seq_len: int, grad_accum: int, dtype: str):
    """Every layout worth trying on ``gpus`` GPUs, cheapest in communication and compute first.

    Order: no offload before optimizer offload before parameter offload; no activation checkpointing
    before checkpointing; lower ZeRO stage first; fewer pipeline stages first.
    """
    candidates = []
    for stages in (s for s in range(1, gpus + 1) if gpus % s == 0 and (num_layers is None or s <= num_layers)):
        for zero, opt_off, par_off, ckpt in itertools.product(range(4), (False, True), (False, True), (False, True)):
            if stages > 1 and zero > 1:
                continue  # DeepSpeed's pipeline engine: ZeRO 0 and 1 only
            if (opt_off and zero == 0) or (par_off and (zero != 3 or not opt_off)):
                continue  # offload needs ZeRO; parameter offload needs ZeRO-3 with optimizer offload
            layout = Layout(
                stages, gpus // stages, zero, opt_off, par_off, micro_batch, seq_len, grad_accum, ckpt, dtype
            )
            candidates.append(((par_off + opt_off, ckpt, zero, stages), layout))
    return [layout for _, layout in sorted(candidates, key=lambda c: c[0])]


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
) -> list[tuple[Layout, Estimate]]:
    """Layouts whose most loaded GPU fits ``gpu_mem_gb``, cheapest first (see layouts_for).

    ``split(stages)`` gives (parameters per stage, decoder layers per stage or None).
    """
    out = []
    for layout in layouts_for(gpus, num_layers, micro_batch, seq_len, grad_accum, dtype):
        params, layers = split(layout.stages)
        e = estimate(params, layout, shape, layers)
        if e.total <= gpu_mem_gb * GB:
            out.append((layout, e))
    return out


def shape_of(config) -> Shape | None:
    """What the activation estimate needs from a LlamaConfig; None without one (a bare parameter count)."""
    if config is None:
        return None
    return Shape(
        config.hidden_size,
        config.intermediate_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.vocab_size,
    )


def splitter(config, total: float | None, method: str | None = None):
    """stages -> (parameters per stage, decoder layers per stage), split as train.py's
    ``partition_method`` splits (models.llama_pipe.stage_boundaries; ``method`` None: its default);
    a bare count (``config`` None, ``total`` parameters) splits evenly. The ``split`` of ``fitting``."""
    if config is None:
        return lambda stages: ([total / stages] * stages, None)
    # Imported here: models.llama_pipe brings torch and DeepSpeed, which the planner's formulas do not need.
    from models.llama_pipe import DEFAULT_PARTITION_METHOD, spec_layout, spec_parameter_counts, stage_boundaries

    if method is None:
        method = DEFAULT_PARTITION_METHOD
    counts, kinds = spec_parameter_counts(config), [info.kind for info in spec_layout(config)]

    def split(stages: int):
        parts = stage_boundaries(config, stages, method)
        params = [float(sum(counts[parts[p] : parts[p + 1]])) for p in range(stages)]
        layers = [kinds[parts[p] : parts[p + 1]].count("decoder") for p in range(stages)]
        return params, layers

    return split
