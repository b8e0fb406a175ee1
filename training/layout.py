"""The one description of how a job is laid out over its ranks, and the batch arithmetic that follows.

Validation, the DeepSpeed JSON, the memory planner, preflight and the start-up announcement all read
these numbers from a ``Layout`` (in the spirit of torchtitan's ParallelDims) instead of multiplying
micro x grad_acc x dp where they need it.
"""

from __future__ import annotations

from dataclasses import dataclass


def offloads(zero: dict) -> tuple[bool, bool]:
    """(optimizer offloaded, parameters offloaded) for a DeepSpeed JSON's ``zero_optimization`` section."""
    return tuple(zero.get(k, {}).get("device", "none") != "none" for k in ("offload_optimizer", "offload_param"))


@dataclass(frozen=True)
class Layout:
    """One way to run the job: pipe x data over ``stages * dp`` ranks, and what each step holds."""

    stages: int = 1
    dp: int = 1
    zero: int = 0  # 0..3
    offload_optimizer: bool = False
    offload_params: bool = False  # ZeRO-3 only
    micro_batch: int = 1  # samples per micro-batch per data-parallel rank
    seq_len: int = 2048
    grad_accum: int = 8  # micro-batches per step per data-parallel rank: how many are in flight in the pipeline
    checkpointing: bool = False
    dtype: str = "bf16"  # bf16 | fp16 (mixed precision, K=12) | fp32 (K=8)
    loss_chunk: int = 0  # tokens the last stage's LM head and loss take at once; 0 = all (loss_chunk_tokens)
    lora_rank: int = 0  # LoRA (peft.method=lora): the adapters' rank; 0 = every weight trained
    lora_targets: tuple[str, ...] = ()  # the decoder linear layers that get adapters (peft.target_modules)
    nf4: bool = False  # QLoRA (peft.quantize=nf4): the decoder's frozen linear weights stored in 4 bits

    @classmethod
    def of(cls, cfg, world_size: int, ds_json: dict) -> Layout:
        """The layout of a training config on ``world_size`` ranks (dp 0 when they do not divide)."""
        zero = ds_json.get("zero_optimization", {})
        offload_opt, offload_par = offloads(zero)
        k = cfg.num_stages
        return cls(
            stages=k,
            dp=world_size // k if k >= 1 and world_size % k == 0 else 0,
            zero=zero.get("stage", 0),
            offload_optimizer=offload_opt,
            offload_params=offload_par,
            micro_batch=cfg.micro_batch_size,
            seq_len=cfg.data.max_seq_length,
            grad_accum=cfg.gradient_accumulation_steps,
            checkpointing=cfg.activation_checkpoint_interval > 0,
            dtype=cfg.precision,
            loss_chunk=cfg.loss_chunk_tokens,
            lora_rank=cfg.peft.r if cfg.peft.method == "lora" else 0,
            lora_targets=tuple(cfg.peft.target_modules) if cfg.peft.method == "lora" else (),
            nf4=cfg.peft.method == "lora" and cfg.peft.quantize == "nf4",
        )

    @property
    def world_size(self) -> int:
        return self.stages * self.dp

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self.micro_batch * self.grad_accum * self.dp

    @property
    def tokens_per_step(self) -> int:
        """Row tokens per optimizer step (padding included)."""
        return self.global_batch * self.seq_len

    @property
    def uses_pipeline(self) -> bool:
        """DeepSpeed's pipeline engine (ZeRO 0/1), or its data-parallel engine (num_stages=1, ZeRO 2/3)."""
        return self.stages > 1 or self.zero < 2

    @property
    def engine(self) -> str:
        return "pipeline engine" if self.uses_pipeline else "data-parallel engine"

    def batch_line(self) -> str:
        return (
            f"global batch {self.global_batch} samples = micro {self.micro_batch} x grad_acc {self.grad_accum} "
            f"x dp {self.dp} | {self.tokens_per_step} tokens/step"
        )

    def describe(self) -> str:
        off = "+offload(opt" + ("+params" if self.offload_params else "") + ")" if self.offload_optimizer else ""
        chunk = f", loss chunk {self.loss_chunk}" if self.loss_chunk else ""
        return (
            f"pipe {self.stages} x data {self.dp}, ZeRO-{self.zero}{off}, micro {self.micro_batch} x seq {self.seq_len}"
            f"{', act. ckpt' if self.checkpointing else ''}{chunk}, {self.dtype}"
            + (f", {'QLoRA (NF4)' if self.nf4 else 'LoRA'} r={self.lora_rank}" if self.lora_rank else "")
        )
