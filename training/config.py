"""The one typed training config, and the cross-field checks run before any process group starts.

Hydra merges ``conf/config.yaml`` and command-line overrides onto these dataclasses (unknown keys
and wrong types are refused by Hydra itself). :func:`validate` then checks the rules that involve
several fields, the world size, the DeepSpeed JSON or files on disk, and reports every problem at
once, each with the numbers involved and the knob to change.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field, fields
from enum import Enum, StrEnum
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore

from data.checks import LOADABLE_TOKENIZER_FILES, data_problems, default_packing
from data.settings import prepared_problems, tokenizer_dir  # noqa: F401 (tokenizer_dir: read from here too)
from models.peft_targets import DECODER_LINEARS
from parallel.layout import Layout, layout_problems
from training.ds_json import ds_json_conflicts, fp16_supported, load_ds_json

HANG_TIMEOUT_MIN_S = 5.0  # hang_timeout_s below this (other than 0) is refused: see resolve's range checks

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_CONF_DIR = os.path.join(REPO_ROOT, "conf", "model")  # the Hydra model group

# Checkpoint bytes per parameter besides the weights: AdamW's two moments and the fp32 master copy
# (ZeRO keeps one even in fp32), 4 bytes each, in DeepSpeed's optimizer-state files. Measured: a
# tiny fp32 ZeRO-1 pipe 2 x data 2 checkpoint is 16.8 bytes per parameter (4 weights + 12 + JSON).
OPTIMIZER_BYTES_PER_PARAM = 12
CHECKPOINT_OVERHEAD_BYTES_PER_RANK = 64 << 10  # trainer state JSON (RNG states, ~34 KB), engine file, YAML


# Typed choices: Hydra/OmegaConf refuse any other value with the list of valid ones, before this module
# sees the config. StrEnum members compare and format as their strings ("bf16").
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


class TrainObjective(StrEnum):
    sft = "sft"
    dpo = "dpo"


class DPOLossType(StrEnum):
    sigmoid = "sigmoid"
    ipo = "ipo"


class NonfinitePolicy(StrEnum):
    stop = "stop"
    skip = "skip"


class LossNormalization(StrEnum):
    tokens = "tokens"
    micro_batch = "micro_batch"


class Attention(StrEnum):
    documents = "documents"
    dense_mask = "dense_mask"


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

    lr: float = 3e-4  # peak learning rate
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW (beta1, beta2)
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.0  # decoupled weight decay; never applied to norm weights (1-D tensors)
    max_grad_norm: float = 1.0  # clip the global gradient L2 norm to this; 0 = no clipping
    scheduler: Scheduler = (
        Scheduler.constant
    )  # after warm-up: constant | linear | cosine (decay to min_lr at the last step)
    warmup_steps: int = 0  # optimizer steps of linear warm-up to lr
    min_lr: float = 0.0  # learning rate reached at the last step by linear and cosine


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
    """DeepSpeed's own monitors, written under ``output_dir/monitor``, and Weights & Biases (training/tracking.py)."""

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
    alpha: float = 16.0  # LoRA scaling numerator: the update is (alpha / r) B A (alpha / sqrt(r) with use_rslora)
    dropout: float = 0.0  # dropout on the LoRA branch's input
    target_modules: list[str] = field(default_factory=lambda: list(DECODER_LINEARS))  # decoder linears with adapters
    modules_to_save: list[str] = field(default_factory=list)  # trained fully beside the adapters: embed_tokens, lm_head
    use_rslora: bool = False  # rank-stabilised scaling alpha / sqrt(r)
    use_dora: bool = False  # weight-decomposed LoRA (a trained magnitude vector per adapted layer)
    quantize: Quantize = Quantize.none  # nf4: QLoRA, the decoder's frozen linear layers in 4 bits (bitsandbytes)
    init_from: str = ""  # a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start from


@dataclass
class DPOConfig:
    """Direct preference optimisation (train_objective=dpo): TRL DPOTrainer's loss, metrics and defaults."""

    beta: float = 0.1  # how far the policy may move from the reference (the KL penalty's inverse temperature)
    # sigmoid: -log sigmoid(beta x margin), DPO's loss | ipo: (margin per completion token - 1 / (2 beta))^2
    loss_type: DPOLossType = DPOLossType.sigmoid
    label_smoothing: float = 0.0  # sigmoid only: the share of pairs assumed mislabelled (conservative DPO), [0, 0.5)


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
    format: DataFormat = (
        DataFormat.tokens
    )  # tokens: {"input_ids"} | text: {"text"} or .txt | sft: {"prompt","response"} or {"messages"} | dpo: pairs
    max_seq_length: int = 512  # tokens per sample row
    packing: Optional[bool] = None  # pack examples into rows with per-document attention; None: true for text only
    shuffle: bool = True  # reshuffle the samples each epoch (seeded with `seed`)
    # The source's column names, where they differ from the formats' (data.text_field=content reads each
    # row's "content" as its text); a ShareGPT "conversations" column is found as it is.
    text_field: str = "text"  # format=text: the document
    prompt_field: str = "prompt"  # format=sft: the prompt of a prompt/response pair; format=dpo: a pair's prompt
    response_field: str = "response"  # format=sft: its response (trained)
    messages_field: str = "messages"  # format=sft: a chat's list of {role, content}
    input_ids_field: str = "input_ids"  # format=tokens: the token ids
    chosen_field: str = "chosen"  # format=dpo: the preferred completion (a string, or a list of assistant messages)
    rejected_field: str = "rejected"  # format=dpo: the dispreferred completion
    # A weighted mixture instead of train_file: [{path: a.jsonl, weight: 3}, {path: 'b/*.parquet', weight: 1}];
    # each step draws samples by weight (exact proportions over each epoch of the mixture), deterministic.
    sources: list[SourceConfig] = field(default_factory=list)
    eval_file: str = ""  # separate eval data (same format and sources as train_file); exclusive with eval_fraction
    eval_sources: list[SourceConfig] = field(default_factory=list)  # an eval loss for each (their weights unused)
    eval_fraction: float = 0.0  # fraction of the training samples split off for eval (fixed seed), 0 = none
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

    model_name_or_path: str = ""  # pipeline checkpoint made by convert2ckpt.py (or saved by train.py)
    output_dir: str = "outputs/run"  # checkpoints, metrics.jsonl and the resolved config go here
    num_stages: int = 1  # pipeline stages; data-parallel degree = world size / num_stages
    # How specs are split into stages: compute (balance work; the embedding, a lookup, weighs nothing) |
    # parameters (balance stored parameters, DeepSpeed's default) | memory (balance the planner's
    # predicted per-GPU peak for this run's layout) | uniform | type:DecoderLayerPipe.
    # The default equals parallel.partition.DEFAULT_PARTITION_METHOD (the planner's; a test checks).
    partition_method: str = "compute"
    # Tensor parallelism inside each stage: every decoder layer's q/k/v/gate/up split by columns and o/down
    # by rows over this many ranks (one node's GPUs), the embedding and LM head by vocabulary (DeepSpeed's
    # TP layers, parallel/tensor_parallel.py). World size = num_stages x tensor_parallel x data-parallel.
    tensor_parallel: int = 1
    # Sequence parallelism (DeepSpeed Ulysses): each sample's sequence split into this many contiguous slices
    # over as many ranks of the same stage, which exchange heads for tokens around every attention
    # (parallel/sequence_parallel.py). World size = num_stages x tensor_parallel x sequence_parallel x
    # data-parallel; the global batch counts each sample once.
    sequence_parallel: int = 1
    # 1f1b: DeepSpeed's pipeline schedule, a stage per pipeline rank | dualpipev: DeepSpeed's DualPipeV, the
    # model cut into 2 x num_stages pieces, rank r holding piece r and its mirror 2 x num_stages - 1 - r, so
    # micro-batches go out and come back and the first pipeline rank reads the data and computes the loss
    # (less idle time per step; parallel/dualpipev.py). Needs gradient_accumulation_steps >= 2 x num_stages.
    pipeline_schedule: str = "1f1b"
    # documents: attention within each packed document found from position_ids, with no S x S mask
    # (models/attention.py) | dense_mask: transformers' sdpa with a per-document [B,1,S,S] mask per layer
    # (the earlier path, for comparison; not with sequence_parallel).
    attention: Attention = Attention.documents
    ds_config: str = "zero1"  # DeepSpeed JSON: a name in ds_configs/ (without .json) or a path
    precision: Precision = Precision.bf16  # fp32 | bf16 | fp16 (fp16 needs a device that supports it)
    micro_batch_size: int = 1  # samples per micro-batch per data-parallel rank
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step per data-parallel rank
    # tokens: an optimizer step's loss is its summed token losses / label tokens of the whole global
    # batch (every micro-batch, every data-parallel rank), as Hugging Face Trainer computes it; eval
    # weighs every token alike too | micro_batch: the mean of per-micro-batch means (DeepSpeed's
    # convention and this project's before; a micro-batch of 3 label tokens weighs as much as one of 300).
    loss_normalization: LossNormalization = LossNormalization.tokens
    # sft: next-token loss on the label tokens | dpo: preference pairs (data=dpo), the DPO loss against a
    # reference whose log-probabilities one forward pass computes before training (training/preference.py)
    train_objective: TrainObjective = TrainObjective.sft
    # The LM head and its cross entropy run this many tokens at a time on the last stage, so the
    # [B,S,V] logits are never held whole nor kept for backward (recomputed per chunk); 0 = off.
    loss_chunk_tokens: int = 1024
    max_steps: int = 100  # optimizer steps to train; 0 with num_epochs 0: load everything, train nothing
    num_epochs: float = (
        0.0  # stop after this many passes over the training data (fractions allowed); 0 = max_steps alone decides
    )
    seed: int = 42  # seeds the data order and a from-scratch initialisation
    activation_checkpoint_interval: int = 0  # recompute activations in chunks of this many decoder layers; 0 = off
    log_steps: int = 1  # print a progress line every this many steps (metrics.jsonl gets every step)
    eval_steps: int = 0  # evaluate every this many steps and at the end, when there is eval data; 0 = only at the end
    save_steps: int = 0  # save a checkpoint every this many steps (and always at the end); 0 = only at the end
    save_total_limit: int = 0  # keep only the newest this many checkpoints; 0 = keep all
    # Also save when this many minutes have passed since the last checkpoint (rank 0's clock, agreed by all ranks
    # after each step), whichever of it and save_steps comes first; 0 = steps only.
    save_every_minutes: float = 0.0
    # After SIGTERM or SIGUSR1 (SLURM's warning before a time limit or preemption) every rank finishes the step,
    # a checkpoint is saved and the job exits with code 75 (training/preemption.py); a second signal, or no
    # checkpoint within this many seconds of the first, exits at once with code 76, the last complete
    # checkpoint untouched.
    preempt_grace_s: float = 600.0
    # A training step running longer than this dumps every rank's Python stacks to output_dir/hang/rank<R>.txt
    # and rank 0 prints where each rank is (training/hang.py); 0 = 20 x the median step so far, at least 600 s;
    # otherwise at least 5 s. Checkpoint saves and evaluations are not timed, and its exit never cuts a save short.
    hang_timeout_s: float = 0.0
    hang_action: HangAction = HangAction.exit  # exit: every rank exits with code 78 | wait: keep waiting
    resume: ResumeMode = (
        ResumeMode.auto
    )  # auto: continue from output_dir's latest checkpoint if there is one | never: refuse to reuse it
    # Seconds a collective (all-reduce, barrier, pipeline send/recv, the start-up rendezvous) waits for
    # the other ranks before it fails and the job exits. It bounds how long a hung or unreachable rank
    # (another node gone, a stopped process) can stall the others; a rank that dies on the same node is
    # noticed by the DeepSpeed launcher within seconds anyway. It must exceed the longest legitimate
    # wait: the tokenized-cache build on the first start (other ranks wait for it) and a checkpoint save.
    dist_timeout_s: int = 1800
    # A non-finite loss or gradient: stop (name the last good checkpoint) | skip (the optimizer skips the step; logged).
    nonfinite_loss: NonfinitePolicy = NonfinitePolicy.stop
    min_free_disk_gb: float = (
        -1.0
    )  # refuse to start with less free space under output_dir; -1 = the estimated size of one checkpoint, 0 = no check
    # Seconds a rank may take from start to joining the process group (loading or building DeepSpeed's
    # ops, the rendezvous) before it says where it waits and exits; 0 = no limit. A stale op-build lock
    # would otherwise hang every job silently, before dist_timeout_s applies.
    startup_timeout_s: int = 900
    log_level: LogLevel = LogLevel.warning  # DeepSpeed's own log lines shown: debug | info | warning | error
    # Peak TFLOP/s of one device for MFU in the progress line and metrics.jsonl; 0 = from the table of known
    # GPUs (training/metrics.py: H200, H100, A100, L40S, ...), none on CPU (MFU omitted there unless set).
    mfu_peak_tflops: float = 0.0
    # The second step's peak of allocated tensor bytes above its start is logged per rank (gradients,
    # activations, the loss buffer, temporaries: what the planner predicts beside the model states). On
    # a GPU it comes from the allocator, always; on CPU there is no allocator count, so only with this
    # on, which counts every tensor the step creates (training/memory_census.py; that step runs slower).
    count_step_memory: bool = False
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


def register_configs() -> None:
    """Make the dataclass schema available to ``conf/config.yaml`` as ``train_schema``."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


class ConfigError(ValueError):
    """One or more invalid settings; the message lists all of them."""


@dataclass
class Resolved:
    """A validated config with what was read to validate it (read once, used by train.py)."""

    cfg: TrainConfig
    layout: Layout  # world, stages, dp, batch arithmetic, engine
    ds_json: dict  # the DeepSpeed JSON as written by the user (batch keys not yet filled)
    model_config: object  # Hugging Face config: model_name_or_path's config.json, or model.architecture
    warnings: list[str]
    resume_tag: Optional[str] = None  # checkpoint in output_dir to continue from (resume=auto)
    resume_changes: ResumeChanges = field(
        default_factory=lambda: ResumeChanges()
    )  # settings changed since it was saved
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
    def uses_pipeline(self) -> bool:
        return self.layout.uses_pipeline

    @property
    def lora(self) -> bool:
        """peft.method=lora: the base frozen, PEFT's LoRA adapters trained (models/lora.py)."""
        return self.cfg.peft.method == "lora"


# Fields that define the modules and tensor shapes: a checkpoint and a chosen architecture must agree.
SHAPE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
)


def model_group_names() -> list[str]:
    """The entries of the ``model=`` group (conf/model/*.yaml)."""
    return sorted(f[: -len(".yaml")] for f in os.listdir(MODEL_CONF_DIR) if f.endswith(".yaml"))


def model_group_config(name: str, **overrides):
    """The Hugging Face config (its family's class, ``models.families``) of ``conf/model/<name>.yaml``'s
    architecture, with ``overrides`` applied; None for an entry that takes its architecture from a
    checkpoint (``checkpoint``). For scripts and tests; train.py reads the same file through Hydra."""
    import yaml

    from models.families import config_from_dict

    path = os.path.join(MODEL_CONF_DIR, f"{name}.yaml")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model {name!r}: no {path} (choose one of {model_group_names()})")
    with open(path) as f:
        arch = yaml.safe_load(f)["architecture"]
    return None if arch is None else config_from_dict({**arch, **overrides}, where=path)


def resolve_model(cfg: TrainConfig) -> tuple[object, list[str]]:
    """(Hugging Face config or None, problems): from model_name_or_path, or from the model group's
    architecture; either must be of a family in models.families."""
    # Heavy import (transformers' model modules), only once the config parsed.
    from models.families import UnsupportedModelError, config_from_dict, load_config

    arch = dict(cfg.model.architecture) if cfg.model.architecture is not None else None
    if cfg.model_name_or_path:
        if not os.path.isfile(os.path.join(cfg.model_name_or_path, "config.json")):
            name = cfg.model_name_or_path
            if not os.path.isdir(name) and name in model_group_names():  # the group's name taken for a checkpoint
                return None, [
                    f"model_name_or_path {name} is not a directory, and {name} is conf/model/{name}.yaml: did you "
                    f"mean model={name}? (an architecture from scratch, with model.tokenizer=DIR; to fine-tune, "
                    "model_name_or_path is a checkpoint directory made by convert2ckpt.py)"
                ]
            return None, [f"model_name_or_path {name}: no config.json there"]
        try:
            config = load_config(cfg.model_name_or_path)
        except UnsupportedModelError as e:
            return None, [str(e)]
        if arch is None:
            return config, []
        try:
            chosen = config_from_dict(arch)
        except (UnsupportedModelError, TypeError, ValueError) as e:
            return config, [f"model.architecture is not a valid model config: {e}"]
        return config, [
            f"model={cfg.model.name} has {f}={getattr(chosen, f)} but {cfg.model_name_or_path}/config.json has "
            f"{getattr(config, f)}: drop the model= override or use a checkpoint of that architecture"
            for f in SHAPE_FIELDS
            if getattr(chosen, f) != getattr(config, f)
        ]
    if arch is None:
        return None, [
            "no model: set model_name_or_path=CKPT_DIR (made by convert2ckpt.py) or, to train from "
            "scratch, model=<architecture in conf/model/> and model.tokenizer=DIR"
        ]
    problems = []
    if not cfg.model.tokenizer or not any(
        os.path.isfile(os.path.join(cfg.model.tokenizer, f)) for f in LOADABLE_TOKENIZER_FILES
    ):
        problems.append(
            f"model.tokenizer {cfg.model.tokenizer!r} holds no tokenizer ({' or '.join(LOADABLE_TOKENIZER_FILES)}): "
            f"training from scratch needs one (it is saved with every checkpoint)"
        )
    try:
        return config_from_dict(arch), problems
    except UnsupportedModelError as e:
        return None, problems + [str(e)]
    except (TypeError, ValueError) as e:
        return None, problems + [f"model.architecture is not a valid model config: {e}"]


def input_checkpoint_problems(cfg: TrainConfig) -> list[str]:
    """model_name_or_path that is not a model to start from: the run's own output_dir, or a LoRA run
    (whose layer files hold adapters, not a model)."""
    path = cfg.model_name_or_path
    if not path or not os.path.isdir(path):
        return []
    from models.layer_files import latest_tag
    from models.lora import lora_run_base

    if os.path.realpath(path) == os.path.realpath(cfg.output_dir):
        return [
            f"output_dir {cfg.output_dir} is model_name_or_path: the run would write its checkpoints into its input; "
            "set output_dir to a new directory"
        ]
    tag = latest_tag(path)
    if tag and os.path.isdir(os.path.join(path, tag)) and lora_run_base(os.path.join(path, tag)):
        return [
            f"model_name_or_path {path} is a LoRA run, whose layer files hold adapters, not a model: continue it "
            f"with output_dir={path} and its base as model_name_or_path, start from its adapters (convert2ckpt.py "
            f"--to-hf --input {path} --output ADAPTER_DIR, then peft.init_from=ADAPTER_DIR), or merge it into a model "
            f"first (convert2ckpt.py --to-hf --merge --input {path} --output MERGED_HF, then convert2ckpt.py "
            "--input MERGED_HF --output CKPT_DIR)"
        ]
    return []


def find_resume(cfg: TrainConfig, model_config) -> tuple[Optional[str], ResumeChanges, list[str]]:
    """(tag to resume from, settings changed since it was saved, problems) for output_dir's ``latest``
    checkpoint, if any."""
    from models.layer_files import LATEST_FILE, latest_tag  # heavy import (torch, deepspeed), only once parsed

    tag = latest_tag(cfg.output_dir)
    if tag is None:
        return None, ResumeChanges(), []
    if cfg.resume == "never":
        return (
            None,
            ResumeChanges(),
            [
                f"output_dir {cfg.output_dir} already holds a checkpoint ({tag}): set resume=auto to continue "
                f"it, or choose another output_dir"
            ],
        )
    problems = []
    if not os.path.isdir(os.path.join(cfg.output_dir, tag)):
        problems.append(f"{os.path.join(cfg.output_dir, LATEST_FILE)} names {tag}, which is not in {cfg.output_dir}")
    saved = os.path.join(cfg.output_dir, "config.json")
    if model_config is not None and os.path.isfile(saved):
        from models.families import UnsupportedModelError, load_config

        try:
            old = load_config(cfg.output_dir)
        except UnsupportedModelError as e:
            return None, ResumeChanges(), problems + [str(e)]
        problems += [
            f"output_dir {cfg.output_dir} holds a checkpoint with {f}={getattr(old, f)}, this model has "
            f"{getattr(model_config, f)}: choose another output_dir"
            for f in SHAPE_FIELDS
            if getattr(old, f) != getattr(model_config, f)
        ]
        problems += [
            f"output_dir {cfg.output_dir}/{tag}: {line}" for line in tensor_shape_differences(old, model_config)
        ]
    changes, change_problems = resume_changes(cfg, tag)
    return tag, changes, problems + change_problems


# How each setting may differ from the checkpoint being resumed (its train_config.yaml). Keys not listed
# are "free": they take effect as given (step counts, cadences, outputs, timeouts, eval data).
#   layout: taken as given. Where the optimizer states' layout changed (RESHARD_KEYS, or the world size)
#           they are read per parameter (training/reshard.py); the data position counts samples, so
#           the run continues at the next unseen one; a changed global batch is said at start.
#   optim:  refused unless resume_allow_changes has "optim"; then applied exactly from the next step
#           (train.py sets them on the restored optimizer and recomputes the schedule).
#   data:   refused unless resume_allow_changes has "data"; then the new sample stream continues at the
#           saved epoch and micro-batch position.
#   model:  refused unless resume_allow_changes has "model"; the checkpoint's weights are used either way
#           (shapes that differ are refused separately).
RESUME_KEY_CLASSES = {
    "layout": (
        "num_stages",
        "tensor_parallel",
        "sequence_parallel",
        "pipeline_schedule",
        "partition_method",
        "ds_config",
        "precision",
        "micro_batch_size",
        "gradient_accumulation_steps",
    ),
    "optim": (
        "optim.lr",
        "optim.betas",
        "optim.eps",
        "optim.weight_decay",
        "optim.max_grad_norm",
        "optim.scheduler",
        "optim.warmup_steps",
        "optim.min_lr",
        "loss_normalization",
        "dpo.beta",
        "dpo.loss_type",
        "dpo.label_smoothing",
    ),
    "data": (
        "data.train_file",
        "data.sources",
        "data.text_field",
        "data.prompt_field",
        "data.response_field",
        "data.messages_field",
        "data.input_ids_field",
        "data.chosen_field",
        "data.rejected_field",
        "train_objective",
        "data.format",
        "data.max_seq_length",
        "data.packing",
        "data.shuffle",
        "data.eval_fraction",
        "data.skip_bad_lines",
        "data.group_by_length",
        "seed",
    ),
    "model": ("model_name_or_path", "model.name", "model.architecture", "model.tokenizer"),
}
ACCEPTABLE_CHANGES = ("optim", "data", "model")
# Layout keys that change how optimizer states are cut into files: with any of them (or the world size)
# changed, resume reads the saved states per parameter instead of DeepSpeed's own load.
RESHARD_KEYS = ("num_stages", "tensor_parallel", "pipeline_schedule", "partition_method", "ds_config", "precision")


@dataclass
class ResumeChanges:
    """Settings that differ from the checkpoint being resumed, by class: key -> (saved, now)."""

    changed: dict[str, dict[str, tuple[Any, Any]]] = field(default_factory=dict)

    def lines(self, cls: str) -> list[str]:
        return [f"{key} {old!r} -> {new!r}" for key, (old, new) in self.changed.get(cls, {}).items()]


def _plain(value):
    """A config value as it reads in train_config.yaml (an enum by its string)."""
    return value.value if isinstance(value, Enum) else value


def _dotted(tree: dict, key: str):
    """The value at a dotted key of a nested config dict."""
    for part in key.split("."):
        tree = tree[part]
    return tree


def resume_changes(cfg: TrainConfig, tag: str) -> tuple[ResumeChanges, list[str]]:
    """(what changed since ``output_dir/tag`` was saved, problems) from its train_config.yaml."""
    import yaml

    path = os.path.join(cfg.output_dir, tag, "train_config.yaml")
    if not os.path.isfile(path):
        return ResumeChanges(), []  # not written by train.py (a converted checkpoint has no optimizer states)
    with open(path) as f:
        saved = yaml.safe_load(f) or {}
    now = dataclasses.asdict(cfg)
    changes, classed = ResumeChanges(), {k for keys in RESUME_KEY_CLASSES.values() for k in keys}
    free = tuple(sorted(set(_leaf_keys(now)) - classed - {"resume_allow_changes"}))  # the knob itself is no change
    for cls, keys in [*RESUME_KEY_CLASSES.items(), ("free", free)]:
        for key in keys:
            try:
                old = _dotted(saved, key)
            except (KeyError, TypeError):
                continue  # a checkpoint from a version without this key (or without its section)
            new = _plain(_dotted(now, key))
            if old != new and not (isinstance(new, (list, tuple)) and list(old or []) == list(new)):
                changes.changed.setdefault(cls, {})[key] = (old, new)
    problems = []
    where = f"{cfg.output_dir}/{tag}"
    for cls in ACCEPTABLE_CHANGES:
        if changes.changed.get(cls) and cls not in cfg.resume_allow_changes:
            problems.append(
                f"{where} was saved with other {cls} settings: {', '.join(changes.lines(cls))}: set the saved "
                f"values, or add {cls} to resume_allow_changes (resume_allow_changes=[{cls}]) to "
                f"{RESUME_EFFECT[cls]}"
            )
    return changes, problems


def reshard_reason(
    cfg: TrainConfig, tag: str, changes: ResumeChanges, world_size: int, model_config
) -> tuple[str, list[str]]:
    """(why ``output_dir/tag``'s optimizer states must be read per parameter, "" when DeepSpeed's own load
    applies; problems of those states: files of some rank missing, an unreadable or unsafe file), before
    any process group starts."""
    path = os.path.join(cfg.output_dir, tag, "trainer_state_rank00000.json")
    if not os.path.isfile(path):
        return "", []  # not written by train.py: read_trainer_state says so once the ranks run
    with open(path) as f:
        saved = json.load(f)
    if saved.get("portable"):
        reasons = ["portable, written by convert2ckpt.py --reshard"]
    else:
        layout = changes.changed.get("layout", {})
        reasons = [f"{key} {old!r} -> {new!r}" for key, (old, new) in layout.items() if key in RESHARD_KEYS]
        if saved["world_size"] != world_size:
            reasons.append(f"world size {saved['world_size']} -> {world_size}")
    if not reasons:
        return "", []
    from training.reshard import SavedOptimizerState  # heavy import (torch), only when resharding

    saved_states = SavedOptimizerState(os.path.join(cfg.output_dir, tag))
    found = saved_states.problems + (saved_states.missing_layer_files(model_config) if model_config else [])
    problems = [f"cannot resume {cfg.output_dir}/{tag} on this layout: {p}" for p in found]
    return ", ".join(reasons), problems


RESUME_EFFECT = {
    "optim": "apply them exactly from the next step (the schedule recomputed from the new settings)",
    "data": "continue the new sample stream at the saved epoch and micro-batch position",
    "model": "resume the checkpoint's weights under the new model settings",
}


def _leaf_keys(tree: dict, prefix: str = "") -> list[str]:
    """Dotted keys of a config dict's leaves (a dict-typed field such as model.architecture is one leaf)."""
    keys = []
    for k, v in tree.items():
        if isinstance(v, dict) and f"{prefix}{k}" != "model.architecture":
            keys += _leaf_keys(v, f"{prefix}{k}.")
        else:
            keys.append(f"{prefix}{k}")
    return keys


def unknown_key_problems(given: dict, schema: type | None = None, prefix: str = "") -> list[str]:
    """Keys of the composed config that TrainConfig does not have (``+key=value`` adds them past Hydra's
    own check, and OmegaConf.to_object drops them silently), each with the nearest valid key."""
    defaults = (schema or TrainConfig)()
    problems = []
    for key, value in given.items():
        if not hasattr(defaults, key):
            near = difflib.get_close_matches(
                f"{prefix}{key}", _leaf_keys(dataclasses.asdict(TrainConfig())), n=1, cutoff=0.6
            )
            hint = f": did you mean {near[0]}?" if near else ": `python train.py --cfg job` lists the keys"
            problems.append(f"unknown key {prefix}{key}{hint}")
        elif dataclasses.is_dataclass(getattr(defaults, key)) and isinstance(value, dict):
            problems += unknown_key_problems(value, type(getattr(defaults, key)), f"{prefix}{key}.")
    return problems


def override_key_problems(overrides: list[str]) -> list[str]:
    """Command-line ``key=value`` overrides whose key TrainConfig does not have, found before Hydra
    composes the config (Hydra's own error would suggest adding the typo with ``+``), in
    ``unknown_key_problems``' words. Groups (``model=``, ``ds=``, ``data=``), Hydra's own keys and
    ``+``/``~`` overrides are left to Hydra and to ``unknown_key_problems``."""
    groups = {d for d in os.listdir(os.path.dirname(MODEL_CONF_DIR)) if not d.endswith(".yaml")}
    given, sources = {}, []
    for arg in overrides:
        key = arg.split("=", 1)[0]
        if "=" not in arg or arg.startswith(("-", "+", "~")) or key in groups or key.split(".")[0] == "hydra":
            continue
        node, parts = TrainConfig(), key.split(".")
        for depth, part in enumerate(parts):
            if not dataclasses.is_dataclass(node) or not hasattr(node, part):
                break
            node = getattr(node, part)
        else:
            if key in ("data.sources", "data.eval_sources"):
                sources += source_override_problems(key, arg.split("=", 1)[1])
            continue
        if not dataclasses.is_dataclass(node) and depth > 0 and parts[depth - 1] == "architecture":
            continue  # below model.architecture: a Hugging Face config field, checked when the config is built
        tree = given
        for part in parts[:-1]:
            tree = tree.setdefault(part, {})
        tree[parts[-1]] = None
    return unknown_key_problems(given) + sources


def source_override_problems(key: str, value: str) -> list[str]:
    """Entries of a data.sources / data.eval_sources override that are not sources (a mistyped key, a format
    no reader knows, a weight that is no number, a bare path), each named with a source's keys: Hydra would
    advise ``+data.sources`` or say only that it could not merge the override."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        entries = OverridesParser.create().parse_override(f"{key}={value}").value()
    except Exception:  # not parsable: Hydra's message names where
        return []
    keys = [f.name for f in fields(SourceConfig)]
    valid = f"a source's keys are {', '.join(keys)}"
    if not isinstance(entries, list):
        return [f"{key} is a list of sources, e.g. {key}='[{{path: a.jsonl, weight: 3}}]' ({valid})"]
    problems = []
    for i, entry in enumerate(entries):
        where = f"{key}[{i}]"
        if not isinstance(entry, dict):
            problems.append(f"{where} {entry!r} is not a source: write it as {{path: {entry}}} ({valid})")
            continue
        for name in entry:
            if name not in keys:
                near = difflib.get_close_matches(str(name), keys, n=1, cutoff=0.6)
                hint = f": did you mean {near[0]}?" if near else ""
                problems.append(f"unknown key {name} in {where}{hint} ({valid})")
        fmt = entry.get("format")
        if fmt is not None and fmt not in [f.value for f in DataFormat]:
            problems.append(
                f"{where} format {fmt!r}: set one of {', '.join(f.value for f in DataFormat)}, or leave it out "
                "(the source then has data.format)"
            )
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            problems.append(f"{where} weight {weight!r} is not a number: set e.g. weight: 3")
    return problems


def tensor_shape_differences(old, new, limit: int = 3) -> list[str]:
    """Layer files whose tensors would change shape between two configs: file, tensor, both shapes.

    Compared spec by spec when both have the same layer list (same layer count and tying); otherwise
    the layer files do not even correspond and the config fields say it all.
    """
    if old.num_hidden_layers != new.num_hidden_layers or old.tie_word_embeddings != new.tie_word_embeddings:
        return []
    from models.llama_pipe import build_specs, expected_state_shapes, layer_file_name, spec_layout

    old_specs, new_specs, lines = build_specs(old), build_specs(new), []
    for info in spec_layout(new):
        if info.owns_file:
            a, b = expected_state_shapes(old_specs[info.index]), expected_state_shapes(new_specs[info.index])
            lines += [
                f"{layer_file_name(info.index)} tensor {k!r} has shape {tuple(a[k])} in the checkpoint, "
                f"{tuple(b[k])} in this model"
                for k in b
                if k in a and tuple(a[k]) != tuple(b[k])
            ]
    if len(lines) > limit:
        lines = lines[:limit] + [f"... and {len(lines) - limit} more tensors of other shapes"]
    return lines


def nearest_existing_dir(path: str) -> str:
    """``path`` itself if it exists, else its closest existing ancestor (what creating it would write into)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def output_dir_problems(cfg: TrainConfig) -> list[str]:
    """output_dir must be (or be creatable as) a directory this process can write: probed by creating
    and removing a temporary entry, so permissions, read-only mounts and full quotas all show."""
    out = cfg.output_dir
    where = nearest_existing_dir(out)
    if not os.path.isdir(where):
        return [f"output_dir {out}: {where} exists and is not a directory: choose another output_dir"]
    try:
        if where == os.path.abspath(out):
            fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=where)
            os.close(fd)
            os.remove(probe)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=where))
    except OSError as e:
        return [
            f"output_dir {out} is not writable ({e.strerror} in {where}): choose another output_dir or make it writable"
        ]
    return []


def checkpoint_size_bytes(model_config, precision: str, uses_pipeline: bool, world_size: int) -> tuple[int, str]:
    """(estimated bytes of one checkpoint, how it was estimated).

    Layer files hold the weights in the training dtype; DeepSpeed's optimizer-state files hold
    AdamW's two moments and an fp32 master copy (OPTIMIZER_BYTES_PER_PARAM); the data-parallel engine
    (ZeRO 2/3) also writes its own copy of the module's weights.
    """
    from models.llama_pipe import model_parameters

    params = model_parameters(model_config)
    weight_bytes = 4 if precision == "fp32" else 2
    per_param = weight_bytes * (1 if uses_pipeline else 2) + OPTIMIZER_BYTES_PER_PARAM
    how = (
        f"{params / 1e6:.1f} M parameters x {per_param} bytes: {precision} weights"
        f"{'' if uses_pipeline else ' twice (layer files + engine file)'} + AdamW moments and fp32 master weights"
    )
    return params * per_param + world_size * CHECKPOINT_OVERHEAD_BYTES_PER_RANK, how


def disk_problems(cfg: TrainConfig, model_config, uses_pipeline: bool, world_size: int) -> tuple[list[str], list[str]]:
    """(problems, warnings): free space under output_dir against one checkpoint (``min_free_disk_gb``)."""
    if cfg.min_free_disk_gb == 0 or model_config is None:
        return [], []
    where = nearest_existing_dir(cfg.output_dir)
    if not os.path.isdir(where):
        return [], []  # output_dir_problems reports it
    free = shutil.disk_usage(where).free
    one, how = checkpoint_size_bytes(model_config, cfg.precision, uses_pipeline, world_size)
    need = one if cfg.min_free_disk_gb < 0 else cfg.min_free_disk_gb * 1e9
    if free < need:
        why = (
            f"one checkpoint needs about {need / 1e9:.3g} GB ({how})"
            if cfg.min_free_disk_gb < 0
            else f"min_free_disk_gb={cfg.min_free_disk_gb:g} asks for {need / 1e9:.3g} GB"
        )
        return [
            f"output_dir {cfg.output_dir}: {free / 1e9:.3g} GB free on its file system ({where}), but {why}: "
            f"free space or choose another output_dir (min_free_disk_gb=0 skips this check)"
        ], []
    kept = (
        cfg.save_total_limit + 1
        if cfg.save_total_limit
        else (cfg.max_steps // cfg.save_steps + 1 if cfg.save_steps and cfg.max_steps and not cfg.num_epochs else 1)
    )
    if kept > 1 and free < kept * one:
        return [], [
            f"output_dir {cfg.output_dir}: {free / 1e9:.3g} GB free, but {kept} checkpoints of about {one / 1e9:.3g} "
            "GB "
            f"each will be on disk at once (save_total_limit={cfg.save_total_limit}, the new one is written before "
            f"the oldest is deleted): a later save will fail; lower save_total_limit or free space"
        ]
    return [], []


def given_keys(overrides: list[str]) -> set[str]:
    """The dotted keys a list of Hydra overrides sets (``++data.pad_to_multiple_of=8`` -> data.pad_to_multiple_of)."""
    return {arg.split("=", 1)[0].lstrip("+~") for arg in overrides if "=" in arg}


def adapt_defaults(cfg: TrainConfig, given: set[str] | None) -> list[str]:
    """Defaults the user left that a feature they set cannot run with, changed in ``cfg`` to values it runs with
    (DualPipeV's gradient accumulation, a sequence-parallel pad multiple): one line each, for the start-up log.
    Only a value the user left adapts; one they set (an override naming it, or a value other than the default)
    stays, and the rule beside the feature refuses it."""
    from parallel.dualpipev import dualpipev_defaults
    from parallel.sequence_parallel import sequence_parallel_defaults

    now, default = dataclasses.asdict(cfg), dataclasses.asdict(TrainConfig())

    def is_set(key: str) -> bool:
        return key in (given or ()) or _plain(_dotted(now, key)) != _plain(_dotted(default, key))

    lines = []
    for key, value, why in dualpipev_defaults(cfg, is_set) + sequence_parallel_defaults(cfg, is_set):
        *path, name = key.split(".")
        node = cfg
        for part in path:
            node = getattr(node, part)
        lines.append(f"{key} {getattr(node, name)} -> {value} (the default; {why}): set {key} to choose")
        setattr(node, name, value)
    return lines


def resolve(
    cfg: TrainConfig, world_size: int, problems: list[str] | None = None, given: set[str] | None = None
) -> Resolved:
    """Check every cross-field rule; raise :class:`ConfigError` listing all problems together (with
    ``problems`` found before, such as unknown keys). ``given``: the keys the user set (their overrides), so that
    a default they left adapts to the features they set (:func:`adapt_defaults`, which changes ``cfg``)."""
    adapted = adapt_defaults(cfg, given)
    from models.layer_files import tags_newer_than_latest  # heavy import (torch, deepspeed), only once parsed
    from training.run_lock import RunLock

    in_use = RunLock(cfg.output_dir).holder()  # acquired after the process group starts; said here first
    problems, warnings = ([in_use] if in_use else []) + list(problems or []), []
    model_config, model_problems = resolve_model(cfg)
    problems += model_problems + input_checkpoint_problems(cfg)
    resume_tag, resume_changes_, resume_problems = find_resume(cfg, model_config)
    problems += resume_problems
    reshard = ""
    if resume_tag and not resume_problems:
        reshard, reshard_problems = reshard_reason(cfg, resume_tag, resume_changes_, world_size, model_config)
        problems += reshard_problems
    ds_json, ds_problem = load_ds_json(cfg.ds_config)
    if ds_problem:
        problems.append(ds_problem)

    k = cfg.num_stages
    # The layout's rules (sizes, stages, ZeRO stage, offload, partition method) live beside the Layout, shared
    # with preflight and scripts/estimate_memory.py.
    layout = Layout.of(cfg, world_size, ds_json or {})
    num_layers = model_config.num_hidden_layers if model_config is not None else None
    problems += layout_problems(layout, world_size, cfg.partition_method, num_layers)
    for name, minimum in (
        ("max_steps", 0),
        ("num_epochs", 0),
        ("activation_checkpoint_interval", 0),
        ("log_steps", 1),
        ("eval_steps", 0),
        ("save_steps", 0),
        ("save_total_limit", 0),
        ("save_every_minutes", 0),
        ("dist_timeout_s", 1),
        ("preempt_grace_s", 1),
        ("hang_timeout_s", 0),
    ):
        if getattr(cfg, name) < minimum:
            problems.append(f"{name} {getattr(cfg, name)} is out of range: set {name} >= {minimum}")
    # A bound below a few seconds names healthy steps hung (the first step alone warms up for seconds; the watchdog
    # looks every 0.5 s) and its exit lands anywhere, e.g. in the middle of the run's work.
    if 0 < cfg.hang_timeout_s < HANG_TIMEOUT_MIN_S:
        problems.append(
            f"hang_timeout_s {cfg.hang_timeout_s:g} is too small to mean a hang: set hang_timeout_s >= "
            f"{HANG_TIMEOUT_MIN_S:g} (seconds one training step may run), or 0 = automatic (20 x the median step "
            "so far, at least 600 s)"
        )
    if cfg.mfu_peak_tflops < 0:
        problems.append(
            f"mfu_peak_tflops {cfg.mfu_peak_tflops} < 0: set the device's peak TFLOP/s, or 0 for the known-GPU table"
        )
    if cfg.startup_timeout_s < 0:
        problems.append(f"startup_timeout_s {cfg.startup_timeout_s} < 0: set it >= 0 (0 = no limit)")
    unknown_classes = sorted(set(cfg.resume_allow_changes) - set(ACCEPTABLE_CHANGES))
    if unknown_classes:
        problems.append(
            f"resume_allow_changes {unknown_classes} unknown: choose from {list(ACCEPTABLE_CHANGES)} "
            f"({', '.join(RESUME_KEY_CLASSES['layout'])} may change on resume without it)"
        )
    if model_config is not None and cfg.data.max_seq_length > model_config.max_position_embeddings:
        rope = getattr(model_config, "rope_parameters", None) or getattr(model_config, "rope_scaling", None) or {}
        kind = rope.get("rope_type", "default")
        scaling = (
            "no rope scaling"
            if kind == "default"
            else f"rope scaling {kind}: " + ", ".join(f"{k}={v}" for k, v in rope.items() if k != "rope_type")
        )
        warnings.append(
            f"data.max_seq_length {cfg.data.max_seq_length} > max_position_embeddings "
            f"{model_config.max_position_embeddings} of the model ({scaling}): positions past "
            f"{model_config.max_position_embeddings} were never trained; lower data.max_seq_length unless "
            f"this run is meant to extend the context"
        )
    if cfg.precision == "fp16" and not fp16_supported():
        problems.append("precision fp16 is not supported on this device: set precision=bf16 or precision=fp32")
    if len(cfg.optim.betas) != 2 or not all(0 <= b < 1 for b in cfg.optim.betas):
        problems.append(
            f"optim.betas {list(cfg.optim.betas)} must be two numbers in [0, 1), e.g. optim.betas=[0.9,0.95]"
        )
    for name in ("eps", "weight_decay"):
        if getattr(cfg.optim, name) < 0:
            problems.append(f"optim.{name} {getattr(cfg.optim, name)} < 0: set it >= 0")
    if cfg.optim.max_grad_norm < 0:
        problems.append(f"optim.max_grad_norm {cfg.optim.max_grad_norm} < 0: set it >= 0 (0 = no clipping)")
    if not 0 <= cfg.optim.min_lr <= cfg.optim.lr:
        problems.append(f"optim.min_lr {cfg.optim.min_lr} must be in [0, optim.lr={cfg.optim.lr}]")
    if cfg.monitor.tensorboard and importlib.util.find_spec("tensorboard") is None:
        problems.append("monitor.tensorboard=true needs the tensorboard package: pip install tensorboard")
    if cfg.monitor.wandb and importlib.util.find_spec("wandb") is None:
        problems.append("monitor.wandb=true needs the wandb package: pip install wandb==0.31.0")
    elif cfg.monitor.wandb and int(os.environ.get("RANK", "0")) == 0:  # the rank that logs (train.py's tracking_run)
        from training.tracking import wandb_problems

        problems += wandb_problems(cfg.output_dir)
    problems += data_problems(cfg) + prepared_problems(cfg, model_config) + objective_problems(cfg, layout)
    if cfg.min_free_disk_gb < 0 and cfg.min_free_disk_gb != -1:
        problems.append(
            f"min_free_disk_gb {cfg.min_free_disk_gb} < 0: set it to -1 (one checkpoint's estimated size), 0 (no "
            "check) or a size in GB"
        )
    output_problems = output_dir_problems(cfg)
    problems += output_problems
    if not output_problems and ds_json is not None:
        disk, disk_warnings = disk_problems(cfg, model_config, layout.uses_pipeline, world_size)
        problems += disk
        warnings += disk_warnings
    warnings += (
        [
            f"{cfg.output_dir}/{tag} is not a complete checkpoint (newer than the one `latest` names: a save "
            f"was interrupted): not resumed from; it is replaced or removed when this run saves"
            for tag in tags_newer_than_latest(cfg.output_dir)
        ]
        if not resume_problems
        else []
    )
    from parallel.dualpipev import dualpipev_problems
    from parallel.sequence_parallel import sequence_parallel_problems
    from parallel.tensor_parallel import tensor_parallel_problems, tensor_parallel_warnings

    problems += tensor_parallel_problems(cfg, model_config, layout)
    problems += sequence_parallel_problems(cfg, model_config, layout)
    problems += dualpipev_problems(cfg, model_config, layout)
    warnings += tensor_parallel_warnings(layout, int(os.environ.get("LOCAL_WORLD_SIZE", "0")))
    inert, harmless = inert_settings(cfg, layout)
    problems += inert + noop_value_problems(cfg)
    warnings += harmless

    if layout.dp:
        micro_batches = cfg.gradient_accumulation_steps
        if k > 1 and micro_batches < k and layout.schedule == "1f1b":
            warnings.append(
                f"gradient_accumulation_steps {micro_batches} < num_stages {k}: the pipeline bubble dominates "
                f"(ideal efficiency {micro_batches}/{micro_batches + k - 1}); raise gradient_accumulation_steps"
            )
        if ds_json is not None:
            problems += ds_json_conflicts(cfg, ds_json, layout)
    from models.lora import peft_change_problems, peft_problems
    from parallel.partition import frozen_stage_problems

    problems += peft_change_problems(cfg, resume_changes_)
    if cfg.peft.method != "none":
        peft = peft_problems(cfg, model_config, layout)
        if model_config is not None and layout.stages >= 1 and not peft:
            peft = frozen_stage_problems(cfg, model_config, layout)  # where the split leaves a stage nothing to train
        problems += peft
    if problems:
        # dict.fromkeys: a rule two checks share (layout_problems and ds_json_conflicts or data_problems) said once
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(dict.fromkeys(problems)))
    return Resolved(cfg, layout, ds_json, model_config, warnings, resume_tag, resume_changes_, reshard, adapted)


def objective_problems(cfg: TrainConfig, layout: Layout) -> list[str]:
    """train_objective=dpo: its data, its settings and what it does not run with."""
    problems, dpo = [], cfg.train_objective == "dpo"
    if dpo != (cfg.data.format == "dpo"):
        problems.append(
            f"train_objective={cfg.train_objective} with data.format={cfg.data.format}: preference pairs train with "
            "the DPO loss and nothing else does; use data=dpo (it sets both), or set both to sft"
        )
    for key in ("sources", "eval_sources"):  # the same rule for each source's own format
        for i, source in enumerate(getattr(cfg.data, key)):
            if source.format == "dpo" and not dpo:
                problems.append(
                    f"data.{key}[{i}] ({source.path}) has format dpo, and train_objective is {cfg.train_objective}: "
                    "its preference pairs would train as two SFT rows each (the rejected completion a target); drop "
                    f"the source from the mixture, or train on it alone (data=dpo data.train_file={source.path})"
                )
    if not dpo:
        return problems
    if cfg.data.packing:
        problems.append("data.packing=true with train_objective=dpo: each pair's rows stand alone; drop data.packing")
    if cfg.data.sources or cfg.data.eval_sources:
        problems.append(
            "data.sources/eval_sources with train_objective=dpo: the reference pass covers one source; use "
            "data.train_file (and data.eval_file or data.eval_fraction)"
        )
    if layout.sp > 1:
        problems.append(
            f"sequence_parallel {layout.sp} with train_objective=dpo: DPO sums each sequence's log-probabilities, "
            "which sequence parallelism splits over ranks; set sequence_parallel=1"
        )
    if not cfg.dpo.beta > 0:
        problems.append(f"dpo.beta {cfg.dpo.beta} must be > 0 (TRL's default: 0.1)")
    if not 0 <= cfg.dpo.label_smoothing < 0.5:
        problems.append(f"dpo.label_smoothing {cfg.dpo.label_smoothing} must be in [0, 0.5)")
    elif cfg.dpo.label_smoothing and cfg.dpo.loss_type != "sigmoid":
        problems.append(
            f"dpo.label_smoothing {cfg.dpo.label_smoothing} smooths the sigmoid loss, and dpo.loss_type is "
            f"{cfg.dpo.loss_type}: drop dpo.label_smoothing or set dpo.loss_type=sigmoid"
        )
    return problems


# Settings that act only in some configurations: (keys, whether they act in ``cfg``, why not and the fix).
# A key set away from its default where it cannot act is refused before start: the user believes in a
# setting they would not get (QLoRA settings without peft.method=lora train the full model, or run out of
# memory, with no word).
INERT_RULES = (
    (
        tuple(f"peft.{f.name}" for f in fields(PeftConfig) if f.name != "method"),
        lambda cfg, layout: cfg.peft.method != "none",
        "LoRA settings, but LoRA is off (peft.method=none): add peft.method=lora, or drop them",
    ),
    (
        tuple(f"dpo.{f.name}" for f in fields(DPOConfig)),
        lambda cfg, layout: cfg.train_objective == "dpo",
        "DPO settings, but train_objective is sft: use data=dpo (preference pairs, train_objective=dpo), or drop them",
    ),
    (
        ("loss_normalization",),
        lambda cfg, layout: cfg.train_objective == "sft",
        "normalises the next-token loss over label tokens; DPO's loss is the mean over the global batch's pairs "
        "(TRL's): drop loss_normalization",
    ),
    (
        ("optim.min_lr",),
        lambda cfg, layout: cfg.optim.scheduler != "constant",
        "where linear and cosine decay end, but the constant schedule stays at optim.lr: set "
        "optim.scheduler=linear or cosine, or drop it",
    ),
    (
        ("model.tokenizer",),
        lambda cfg, layout: not cfg.model_name_or_path,
        "for training from scratch, but the tokenizer in model_name_or_path is the one used: drop model.tokenizer "
        "(or copy that tokenizer into the checkpoint)",
    ),
    (
        ("eval_steps",),
        lambda cfg, layout: bool(cfg.data.eval_file or cfg.data.eval_fraction or cfg.data.eval_sources),
        "evaluation needs eval data, and there is none: set data.eval_file, data.eval_fraction or data.eval_sources, "
        "or drop eval_steps",
    ),
    (
        ("resume_allow_changes",),
        lambda cfg, layout: cfg.resume != "never",
        "applies when a run is resumed, but resume=never never resumes: drop one of them",
    ),
)
# Harmless where they cannot act (a check or a report with nothing to do): one warning line each.
HARMLESS_RULES = (
    # data.group_by_length: one rule per reason it cannot act, exclusive, so that one line says the first
    (
        ("data.group_by_length",),
        lambda cfg, layout: layout.schedule != "dualpipev",
        "groups rows of similar length so micro-batches are cut short, but DualPipeV feeds every row whole "
        "(it only reorders the samples): drop data.group_by_length",
    ),
    (
        ("data.group_by_length",),
        lambda cfg, layout: layout.schedule == "dualpipev" or not default_packing(cfg.data),
        "groups rows of similar length, but packed rows are all data.max_seq_length long (it only reorders the "
        "samples): drop data.group_by_length, or set data.packing=false",
    ),
    (
        ("data.group_by_length",),
        lambda cfg, layout: (
            cfg.data.pad_to_multiple_of > 0 or layout.schedule == "dualpipev" or default_packing(cfg.data)
        ),
        "groups rows of similar length so micro-batches are cut short, but data.pad_to_multiple_of=0 feeds every "
        "row whole (it only reorders the samples): set data.pad_to_multiple_of=8",
    ),
    (
        ("data.order_check_steps",),
        lambda cfg, layout: layout.stages > 1 or layout.tp > 1,
        "the order check compares the batches of the first and last stages (and their tensor-parallel peers); with "
        "one stage and one rank per layer it has nothing to compare",
    ),
)


def inert_settings(cfg: TrainConfig, layout: Layout) -> tuple[list[str], list[str]]:
    """(problems, warnings): settings given a non-default value where they cannot take effect."""
    now, default = dataclasses.asdict(cfg), dataclasses.asdict(TrainConfig())
    out = []
    for rules in (INERT_RULES, HARMLESS_RULES):
        found = []
        for keys, acts, why in rules:
            given = [k for k in keys if _plain(_dotted(now, k)) != _plain(_dotted(default, k))]
            if given and not acts(cfg, layout):
                found.append(", ".join(f"{k}={_plain(_dotted(now, k))}" for k in given) + f": {why}")
        out.append(found)
    return out[0], out[1]


def noop_value_problems(cfg: TrainConfig) -> list[str]:
    """Values that would make the whole run train nothing, refused rather than run for nothing (peft.alpha 0:
    models.lora.peft_problems)."""
    problems = []
    if cfg.optim.lr <= 0:
        problems.append(
            f"optim.lr {cfg.optim.lr} trains nothing: set optim.lr > 0 (to load and evaluate without training, "
            "set max_steps=0)"
        )
    return problems
