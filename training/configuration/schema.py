"""The one typed training config: the schema Hydra fills, and what a validated config carries.

Hydra merges ``conf/config.yaml`` and command-line overrides onto these dataclasses (unknown keys
and wrong types are refused by Hydra itself). The rules that involve several fields, the world size,
the DeepSpeed JSON or files on disk are checked by ``training.configuration.validate.resolve``, which reports every
problem at once, each with the numbers involved and the knob to change, and returns a :class:`Resolved`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore

from models.peft_targets import DECODER_LINEARS
from parallel.layout import Layout, PartitionMethod, PipelineSchedule

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_CONF_DIR = os.path.join(REPO_ROOT, "conf", "model")  # the Hydra model group


# Typed choices: Hydra/OmegaConf refuse any other value with the list of valid ones, before any rule
# sees the config. StrEnum members compare and format as their strings ("bf16"). pipeline_schedule's and
# partition_method's (PipelineSchedule, PartitionMethod) are parallel/layout.py's, beside their rules.
class Precision(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Scheduler(StrEnum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class ResumeMode(StrEnum):
    auto = "auto"
    never = "never"


class DataFormat(StrEnum):
    tokens = "tokens"
    text = "text"
    sft = "sft"
    dpo = "dpo"
    grpo = "grpo"


class TrainObjective(StrEnum):
    sft = "sft"
    dpo = "dpo"
    grpo = "grpo"


class DPOLossType(StrEnum):
    sigmoid = "sigmoid"
    ipo = "ipo"


class GRPOLossType(StrEnum):  # models/grpo.py's LOSS_TYPES
    dapo = "dapo"
    grpo = "grpo"
    dr_grpo = "dr_grpo"
    bnpo = "bnpo"


class ScaleRewards(StrEnum):  # models/grpo.py's SCALE_REWARDS
    group = "group"
    batch = "batch"
    none = "none"


class NonfinitePolicy(StrEnum):
    stop = "stop"
    skip = "skip"


class LossNormalization(StrEnum):
    tokens = "tokens"
    micro_batch = "micro_batch"


class Attention(StrEnum):
    documents = "documents"
    dense_mask = "dense_mask"


class Kernels(StrEnum):
    none = "none"
    liger = "liger"


class AdamWImpl(StrEnum):
    torch_fused = "torch_fused"
    deepspeed = "deepspeed"


class LossImpl(StrEnum):
    chunked = "chunked"
    liger = "liger"


class HangAction(StrEnum):
    exit = "exit"
    wait = "wait"


class PeftMethod(StrEnum):
    none = "none"
    lora = "lora"


class Quantize(StrEnum):
    none = "none"
    nf4 = "nf4"


class LogLevel(StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    lr: float = 3e-4  # peak learning rate, in (0, 1]
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW (beta1, beta2), each in [0, 1)
    eps: float = 1e-8  # AdamW epsilon, in (0, 1)
    # decoupled weight decay, >= 0 (and optim.lr x it < 1); never applied to norm weights (1-D tensors)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # clip the global gradient L2 norm to this, >= 0; 0 = no clipping
    # after warm-up: constant | linear | cosine (decay to min_lr at the last step)
    scheduler: Scheduler = Scheduler.constant
    warmup_steps: int = 0  # optimizer steps of linear warm-up to lr, >= 0; 0 = no warm-up
    min_lr: float = 0.0  # learning rate reached at the last step by linear and cosine, in [0, optim.lr]


@dataclass
class ModelConfig:
    """Architecture for training from scratch (conf/model/*.yaml); unused when loading a checkpoint."""

    name: str = (
        "checkpoint"  # the conf/model entry: checkpoint (take config.json from model_name_or_path) or an architecture
    )
    # Hugging Face config fields (model_type: llama | mistral | qwen2 | qwen3, default llama);
    # None: from model_name_or_path.
    architecture: Optional[Dict[str, Any]] = None
    tokenizer: str = ""  # directory with the tokenizer files, for training from scratch


@dataclass
class MonitorConfig:
    """DeepSpeed's own monitors, written under ``output_dir/monitor``, and Weights & Biases
    (training/observation/tracking.py)."""

    tensorboard: bool = False  # TensorBoard event files (needs the tensorboard package)
    csv: bool = False  # one CSV file per metric
    # Weights & Biases: every metrics.jsonl record (train and eval), the resolved config and the layout, from
    # rank 0; a resumed run continues the same W&B run (its id in output_dir/wandb_run_id). WANDB_API_KEY
    # or `wandb login` online; WANDB_MODE=offline writes it under output_dir/wandb for `wandb sync`.
    wandb: bool = False
    wandb_project: str = "llama-pipeline"  # the W&B project the run is logged to
    wandb_entity: str = ""  # team or user; "" = W&B's default for the key
    wandb_run_name: str = ""  # "" = output_dir's name
    wandb_group: str = ""  # W&B's run group (e.g. one sweep's runs); "" = none
    wandb_tags: list[str] = field(default_factory=list)  # W&B tags, e.g. [sft,llama3]


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning with Hugging Face PEFT's own LoRA layers (docs/lora.md)."""

    method: PeftMethod = PeftMethod.none  # none: train every weight | lora: frozen base, LoRA adapters trained
    r: int = 8  # LoRA rank
    # LoRA scaling numerator, > 0: the update is (alpha / r) B A (alpha / sqrt(r) with use_rslora)
    alpha: float = 16.0
    dropout: float = 0.0  # dropout on the LoRA branch's input, in [0, 1)
    target_modules: list[str] = field(default_factory=lambda: list(DECODER_LINEARS))  # decoder linears with adapters
    modules_to_save: list[str] = field(default_factory=list)  # trained fully beside the adapters: embed_tokens, lm_head
    use_rslora: bool = False  # rank-stabilised scaling alpha / sqrt(r)
    use_dora: bool = False  # weight-decomposed LoRA (a trained magnitude vector per adapted layer)
    quantize: Quantize = Quantize.none  # nf4: QLoRA, the decoder's frozen linear layers in 4 bits (bitsandbytes)
    init_from: str = ""  # a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start from


@dataclass
class DPOConfig:
    """Direct preference optimisation (train_objective=dpo): TRL DPOTrainer's loss, metrics and defaults."""

    beta: float = 0.1  # how far the policy may move from the reference (the KL penalty's inverse temperature), > 0
    # sigmoid: -log sigmoid(beta x margin), DPO's loss | ipo: (margin per completion token - 1 / (2 beta))^2
    loss_type: DPOLossType = DPOLossType.sigmoid
    label_smoothing: float = 0.0  # sigmoid only: the share of pairs assumed mislabelled (conservative DPO), in [0, 0.5)


@dataclass
class GRPOConfig:
    """Group relative policy optimisation (train_objective=grpo): TRL 1.16 GRPOTrainer's names, defaults and loss;
    its settings that are not here are refused by name (training/configuration/overrides.py's TRL_GRPO_ONLY)."""

    num_generations: int = 8  # completions generated per prompt, >= 2; the global batch counts completions
    max_completion_length: int = 512  # most tokens generated per completion, in [1, data.max_seq_length)
    temperature: float = 1.0  # sampling temperature, > 0; the log-probabilities are taken at it too
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens with this probability, in (0, 1]; 1 = off
    top_k: int = 0  # sample among the k most likely tokens, >= 0; 0 = off
    beta: float = 0.0  # the KL penalty's coefficient against the starting weights, >= 0; 0 = no reference model
    epsilon: float = 0.2  # the probability ratio's lower clip 1 - epsilon, > 0
    epsilon_high: Optional[float] = None  # the ratio's upper clip 1 + epsilon_high, >= 0; None: = grpo.epsilon
    # how the summed token losses are normalised: dapo (the step's completion tokens) | grpo (per-sequence means) |
    # dr_grpo (rows x max_completion_length) | bnpo (the micro-batch's completion tokens)
    loss_type: GRPOLossType = GRPOLossType.dapo
    scale_rewards: ScaleRewards = ScaleRewards.group  # advantages divided by the std of: group | batch | none
    num_iterations: int = 1  # optimizer steps per generated batch, >= 1; above 1 the ratio is to the generating weights
    mask_truncated_completions: bool = False  # completions cut at max_completion_length are left out of the loss
    reward_funcs: list[str] = field(default_factory=list)  # reward functions, importable 'module:function' names
    reward_weights: Optional[list[float]] = None  # one weight per reward function, finite; None: each 1.0
    generation_micro_batches: int = 0  # chunks of rows in flight during generation, >= 0; 0 = the pipeline stages


@dataclass
class MoEConfig:
    """Mixture-of-Experts settings beyond the model config's (docs/moe.md)."""

    # DeepSeek-V3's auxiliary-loss-free balancing: after each step every router's e_score_correction_bias moves by
    # this towards balance (+ under the mean load, - over it; training/moe_balance.py), >= 0; 0 = off (the bias stays
    # as loaded, as in Hugging Face's model); the DeepSeek-V3 report's 0.001. deepseek_v3 only.
    bias_update_speed: float = 0.0
    # DeepSeek-V3's complementary sequence-wise balance loss: the loss adds this (the report's alpha) x sum over the MoE
    # layers of sum_e f_e P_e, per packed document (each a sequence) averaged over the micro-batch's documents
    # (models/family_deepseek_v3.py), >= 0; 0 = off (as Hugging Face's model computes no such loss); the report's
    # 0.0001. deepseek_v3 only, on the pipeline engine; logged as sequence_balance_loss.
    sequence_balance_coef: float = 0.0


@dataclass
class SourceConfig:
    """One source of a weighted mixture (data.sources, data.eval_sources)."""

    path: str = ""  # a file, directory, glob, saved dataset or prepared directory, as data.train_file takes
    weight: float = 1.0  # this source's share of the samples drawn: weight / the sum of the weights
    name: str = ""  # in the logs and metrics.jsonl; empty: the path's file name
    format: Optional[DataFormat] = None  # empty: data.format


@dataclass
class DataConfig:
    """Training data: formats and rules in ``data/sources.py`` and ``data/packing.py``."""

    # The training data: a .jsonl file (.txt for format=text), a .parquet/.arrow/.json file, a directory of
    # such files, a glob ("shards/*.parquet"), or a directory written by datasets' save_to_disk.
    train_file: str = ""
    # tokens: {"input_ids"} | text: {"text"} or .txt | sft: {"prompt","response"} or {"messages"} | dpo: pairs |
    # grpo: prompts {"prompt"} (text or messages), the other columns passed to the reward functions
    format: DataFormat = DataFormat.tokens
    max_seq_length: int = 512  # tokens per sample row
    packing: Optional[bool] = None  # pack examples into rows with per-document attention; None: true for text only
    shuffle: bool = True  # reshuffle the samples each epoch (seeded with `seed`)
    # The source's column names, where they differ from the formats' (data.text_field=content reads each
    # row's "content" as its text); a ShareGPT "conversations" column is found as it is.
    text_field: str = "text"  # format=text: the document
    # format=sft: the prompt of a prompt/response pair | dpo: a pair's prompt | grpo: the prompt completions continue
    prompt_field: str = "prompt"
    response_field: str = "response"  # format=sft: its response (trained)
    messages_field: str = "messages"  # format=sft: a chat's list of {role, content}
    input_ids_field: str = "input_ids"  # format=tokens: the token ids
    chosen_field: str = "chosen"  # format=dpo: the preferred completion (a string, or a list of assistant messages)
    rejected_field: str = "rejected"  # format=dpo: the dispreferred completion
    # A weighted mixture instead of train_file: [{path: a.jsonl, weight: 3}, {path: 'b/*.parquet', weight: 1}];
    # each step draws samples by weight (exact proportions over each epoch of the mixture), deterministic; weights > 0.
    sources: list[SourceConfig] = field(default_factory=list)
    eval_file: str = ""  # separate eval data (same format and sources as train_file); exclusive with eval_fraction
    # an eval loss for each; set their weights to any finite number (eval sources' weights are unused)
    eval_sources: list[SourceConfig] = field(default_factory=list)
    eval_fraction: float = 0.0  # fraction of the training samples split off for eval (fixed seed), in [0, 1); 0 = none
    cache_dir: str = ""  # tokenized cache location; empty: $XDG_CACHE_HOME or ~/.cache, then llama-pipe/tokenized
    skip_bad_lines: bool = False  # skip and count malformed lines instead of stopping with their file:line
    order_check_steps: int = 10  # steps during which first and last stage compare batch fingerprints; 0 = off
    # Pad each micro-batch only to its longest row, rounded up to a multiple of this (64 suits GPU kernels),
    # not every row to max_seq_length: compute follows the real tokens. 0 = every row max_seq_length long.
    pad_to_multiple_of: int = 8
    group_by_length: bool = False  # sort each run of 4096 shuffled samples by length: micro-batches of similar rows


@dataclass
class TrainConfig:
    """Everything ``train.py`` needs; ``python train.py --cfg job`` prints it resolved."""

    model_name_or_path: str = ""  # Hugging Face directory (safetensors) or checkpoint of convert2ckpt.py or train.py
    output_dir: str = "outputs/run"  # checkpoints, metrics.jsonl and the resolved config go here
    num_stages: int = 1  # pipeline stages; data-parallel degree = world size / num_stages
    # How specs are split into stages: compute (balance work; the embedding, a lookup, weighs nothing) |
    # parameters (balance stored parameters, DeepSpeed's default) | memory (balance the planner's
    # predicted per-GPU peak for this run's layout) | uniform | type:DecoderLayerPipe.
    # The default equals parallel.partition.DEFAULT_PARTITION_METHOD (the planner's; a test checks).
    partition_method: PartitionMethod = PartitionMethod.compute
    # Tensor parallelism inside each stage: every decoder layer's q/k/v/gate/up split by columns and o/down
    # by rows over this many ranks (one node's GPUs), the embedding and LM head by vocabulary (DeepSpeed's
    # TP layers, parallel/tensor_parallel.py). World size = num_stages x tensor_parallel x data-parallel.
    tensor_parallel: int = 1
    # Sequence parallelism (DeepSpeed Ulysses): each sample's sequence split into this many contiguous slices
    # over as many ranks of the same stage, which exchange heads for tokens around every attention
    # (parallel/sequence_parallel.py). World size = num_stages x tensor_parallel x sequence_parallel x
    # data-parallel; the global batch counts each sample once.
    sequence_parallel: int = 1
    # Expert parallelism (Mixture-of-Experts models): each MoE layer's experts divided over this many
    # data-parallel ranks of its stage, tokens sent to their experts' rank and back (all-to-all, none dropped;
    # parallel/expert_parallel.py). Divides the data-parallel degree and the number of experts.
    expert_parallel: int = 1
    # 1f1b: DeepSpeed's pipeline schedule, a stage per pipeline rank | dualpipev: DeepSpeed's DualPipeV, the
    # model cut into 2 x num_stages pieces, rank r holding piece r and its mirror 2 x num_stages - 1 - r, so
    # micro-batches go out and come back and the first pipeline rank reads the data and computes the loss
    # (less idle time per step; parallel/dualpipev.py). Needs gradient_accumulation_steps >= 2 x num_stages.
    pipeline_schedule: PipelineSchedule = PipelineSchedule["1f1b"]
    # documents: attention within each packed document found from position_ids, with no S x S mask
    # (models/attention.py) | dense_mask: transformers' sdpa with a per-document [B,1,S,S] mask per layer
    # (the earlier path, for comparison; not with sequence_parallel).
    attention: Attention = Attention.documents
    # none: the Hugging Face modules as they are | liger: Liger-Kernel's fused Triton kernels for RMSNorm, the SwiGLU
    # MLP and RoPE in every decoder layer (CUDA only, the liger-kernel package; dense families: llama, mistral,
    # qwen2, qwen3), the weights unchanged (models/kernels.py).
    kernels: Kernels = Kernels.none
    # AdamW's implementation: torch_fused: torch.optim.AdamW(fused=True) | deepspeed: DeepSpeed's FusedAdam (its op
    # JIT-built at the first run that uses it: the CUDA op needs the CUDA toolkit, nvcc; on CPU DeepSpeed's C++ op).
    # With offload_optimizer DeepSpeed's CPU Adam runs whichever is set (training/optim.py).
    adamw_impl: AdamWImpl = AdamWImpl.torch_fused
    # Every layer of each rank's stage compiled with torch.compile through DeepSpeed's engine.compile() (backend
    # inductor), compiled in the first step; the same numbers as eager. Not with tensor or sequence parallelism,
    # DualPipeV, LoRA, MoE models or the ZeRO 2/3 data-parallel engine (training/compile.py).
    compile: bool = False
    ds_config: str = "zero1"  # DeepSpeed JSON: a name in ds_configs/ (without .json) or a path
    precision: Precision = Precision.bf16  # fp32 | bf16 | fp16 (fp16 needs a CUDA GPU: refused on every CPU)
    # null: off | rowwise | tensorwise | rowwise_with_gw_hp (torchao's float8 recipes): each stage's decoder-layer
    # attention and MLP projections trained in FP8 through torchao's Float8Linear, the master weights, checkpoints
    # and the embedding, LM head and routers as they are (models/fp8.py). Needs compute capability >= 8.9 on CUDA
    # (emulated on CPU); sft and dpo (its reference pass converted too); not with train_objective=grpo, fp16, LoRA,
    # MoE models, tensor or sequence parallelism, DualPipeV.
    fp8: str | None = None
    micro_batch_size: int = 1  # samples per micro-batch per data-parallel rank
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step per data-parallel rank
    # tokens: an optimizer step's loss is its summed token losses / label tokens of the whole global
    # batch (every micro-batch, every data-parallel rank), as Hugging Face Trainer computes it; eval
    # weighs every token alike too | micro_batch: the mean of per-micro-batch means (DeepSpeed's
    # convention and this project's before; a micro-batch of 3 label tokens weighs as much as one of 300).
    loss_normalization: LossNormalization = LossNormalization.tokens
    # sft: next-token loss on the label tokens | dpo: preference pairs (data=dpo), the DPO loss against a
    # reference whose log-probabilities one forward pass computes before training (training/dpo.py) | grpo: prompts
    # (data=grpo), completions generated on the pipeline's stages, TRL's GRPO loss (training/grpo.py)
    train_objective: TrainObjective = TrainObjective.sft
    # The LM head and its cross entropy run this many tokens at a time on the last stage, so the
    # [B,S,V] logits are never held whole nor kept for backward (recomputed per chunk); 0 = off.
    loss_chunk_tokens: int = 1024
    # What computes the LM head's cross entropy from the hidden states and the head weight: chunked: the chunked loss
    # above (models/loss.py) | liger: Liger-Kernel's fused linear cross entropy (CUDA only, the liger-kernel package;
    # the same tokens and normalisation; it sizes its own chunks, loss_chunk_tokens must stay > 0). Not with
    # tensor parallelism or the ZeRO 2/3 data-parallel engine (models/kernels.py).
    loss_impl: LossImpl = LossImpl.chunked
    max_steps: int = 100  # optimizer steps to train; 0 with num_epochs 0: load everything, train nothing
    # stop after this many passes over the training data (fractions allowed), >= 0; 0 = max_steps alone decides
    num_epochs: float = 0.0
    seed: int = 42  # seeds the data order and a from-scratch initialisation, in [0, 2**63 - 1]
    activation_checkpoint_interval: int = 0  # recompute activations in chunks of this many decoder layers; 0 = off
    log_steps: int = 1  # print a progress line every this many steps (metrics.jsonl gets every step)
    eval_steps: int = 0  # evaluate every this many steps and at the end, when there is eval data; 0 = only at the end
    save_steps: int = 0  # save a checkpoint every this many steps (and at the end, save_final); 0 = only at the end
    # false: no checkpoint after the last step (benchmarks and smoke runs, whose weights are not needed); save_steps,
    # save_every_minutes and a stop signal still save.
    save_final: bool = True
    save_total_limit: int = 0  # keep only the newest this many checkpoints; 0 = keep all
    # Also save when this many minutes have passed since the last checkpoint (rank 0's clock, agreed by all ranks
    # after each step), whichever of it and save_steps comes first; >= 0; 0 = steps only.
    save_every_minutes: float = 0.0
    # Copy each rank's checkpoint files to host memory at a save and write them in a background thread while
    # training goes on; latest names the checkpoint once every rank's files are written. The last step's save and a
    # stop signal's are written at once (training/checkpoints/async_save.py).
    save_async: bool = False
    # After SIGTERM or SIGUSR1 (SLURM's warning before a time limit or preemption) every rank finishes the step,
    # a checkpoint is saved and the job exits with code 75 (training/resilience/preemption.py); a second signal, or no
    # checkpoint within this many seconds of the first (>= 1), exits at once with code 76, the last complete
    # checkpoint untouched.
    preempt_grace_s: float = 600.0
    # A training step running longer than this dumps every rank's Python stacks to output_dir/hang/rank<R>.txt
    # and rank 0 prints where each rank is (training/resilience/hang.py); 0 = 20 x the median step so far, at least 600
    # s; set it to 0 or >= 5 (seconds). Checkpoint saves and evaluations are not timed, and its exit never cuts a save
    # short.
    hang_timeout_s: float = 0.0
    hang_action: HangAction = HangAction.exit  # exit: every rank exits with code 78 | wait: keep waiting
    # auto: continue from output_dir's latest checkpoint if there is one | never: refuse to reuse it
    resume: ResumeMode = ResumeMode.auto
    # Seconds a collective (all-reduce, barrier, pipeline send/recv, the start-up rendezvous) waits for
    # the other ranks before it fails and the job exits. It bounds how long a hung or unreachable rank
    # (another node gone, a stopped process) can stall the others; a rank that dies on the same node is
    # noticed by the DeepSpeed launcher within seconds anyway. It must exceed the longest legitimate
    # wait: the tokenized-cache build on the first start (other ranks wait for it) and a checkpoint save.
    dist_timeout_s: int = 1800
    # A non-finite loss or gradient: stop (name the last good checkpoint) | skip (the optimizer skips the step; logged).
    nonfinite_loss: NonfinitePolicy = NonfinitePolicy.stop
    # refuse to start with less free space under output_dir; set it to -1, 0 or > 0: -1 = the estimated size of one
    # checkpoint, 0 = no check
    min_free_disk_gb: float = -1.0
    # Seconds a rank may take from start to joining the process group (loading or building DeepSpeed's
    # ops, the rendezvous) before it says where it waits and exits; 0 = no limit. A stale op-build lock
    # would otherwise hang every job silently, before dist_timeout_s applies.
    startup_timeout_s: int = 900
    log_level: LogLevel = LogLevel.warning  # DeepSpeed's own log lines shown: debug | info | warning | error
    # Peak TFLOP/s of one device for MFU in the progress line and metrics.jsonl; 0 = from the table of known
    # GPUs (training/observation/metrics.py: H200, H100, A100, L40S, ...), none on CPU (MFU omitted there unless set);
    # set it to 0 or in [0.01, 100000].
    mfu_peak_tflops: float = 0.0
    # The second step's peak of allocated tensor bytes above its start is logged per rank (gradients,
    # activations, the loss buffer, temporaries: what the planner predicts beside the model states). On
    # a GPU it comes from the allocator, always; on CPU there is no allocator count, so only with this
    # on, which counts every tensor the step creates (training/observation/memory_census.py; that step runs slower).
    count_step_memory: bool = False
    # [first, last]: torch.profiler traces of training steps first..last, one Chrome trace per rank in
    # output_dir/profile (Perfetto and TensorBoard open them; scripts/plot_timeline.py draws a step's pipeline
    # instructions per rank and the bubble); each pipeline instruction a named range. [] = off; those steps run
    # slower (the profiler's own cost).
    profile_steps: list[int] = field(default_factory=list)
    # Classes of settings that may differ from the checkpoint being resumed (see RESUME_KEY_CLASSES):
    # optim (optimizer, schedule, loss normalisation: applied exactly from the next step) | data (the new
    # sample stream continues at the saved epoch and position) | model (the checkpoint's weights are used).
    resume_allow_changes: list[str] = field(default_factory=list)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)


def register_configs() -> None:
    """Make the dataclass schema available to ``conf/config.yaml`` as ``train_schema``."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


class ConfigError(ValueError):
    """One or more invalid settings; the message lists all of them."""


@dataclass
class ResumeChanges:
    """Settings that differ from the checkpoint being resumed, by class: key -> (saved, now)."""

    changed: dict[str, dict[str, tuple[Any, Any]]] = field(default_factory=dict)

    def lines(self, cls: str) -> list[str]:
        return [f"{key} {old!r} -> {new!r}" for key, (old, new) in self.changed.get(cls, {}).items()]


@dataclass
class Resolved:
    """A validated config with what was read to validate it (read once, used by train.py)."""

    cfg: TrainConfig
    layout: Layout  # world, stages, dp, batch arithmetic, engine
    ds_json: dict  # the DeepSpeed JSON as written by the user (batch keys not yet filled)
    model_config: object  # Hugging Face config: model_name_or_path's config.json, or model.architecture
    warnings: list[str]
    resume_tag: Optional[str] = None  # checkpoint in output_dir to continue from (resume=auto)
    # settings changed since it was saved
    resume_changes: ResumeChanges = field(default_factory=lambda: ResumeChanges())
    reshard: str = ""  # why the checkpoint's optimizer states are read per parameter ("" = DeepSpeed's own load)
    adapted: list[str] = field(default_factory=list)  # defaults changed for a feature the user set, one line each

    @property
    def from_scratch(self) -> bool:
        return not self.cfg.model_name_or_path

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def dp(self) -> int:
        """Data-parallel degree: the groups of ranks that read different samples (world size / (num_stages x
        tensor_parallel x sequence_parallel)); DeepSpeed's data axis is ``layout.data_axis``."""
        return self.layout.dp

    @property
    def zero_stage(self) -> int:
        return self.layout.zero

    @property
    def lora(self) -> bool:
        """peft.method=lora: the base frozen, PEFT's LoRA adapters trained (models/lora.py)."""
        return self.cfg.peft.method == "lora"


def plain(value):
    """A config value as it reads in train_config.yaml (an enum by its string)."""
    return value.value if isinstance(value, Enum) else value


def dotted(tree: dict, key: str):
    """The value at a dotted key of a nested config dict."""
    for part in key.split("."):
        tree = tree[part]
    return tree


def leaf_keys(tree: dict, prefix: str = "") -> list[str]:
    """Dotted keys of a config dict's leaves (a dict-typed field such as model.architecture is one leaf)."""
    keys = []
    for k, v in tree.items():
        if isinstance(v, dict) and f"{prefix}{k}" != "model.architecture":
            keys += leaf_keys(v, f"{prefix}{k}.")
        else:
            keys.append(f"{prefix}{k}")
    return keys
