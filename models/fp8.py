"""``fp8``: a stage's decoder-layer linears trained in FP8 through torchao's ``Float8Linear``, and the rules of it.

torchao rather than our own casts: its ``convert_to_float8_training`` is what torchtitan trains FP8 with (+25%
tensorwise, +10% rowwise on Llama-3 8B, its published tables), its scaled matmuls, scale recipes and compiled
kernels are maintained against each torch release, and its ``Float8Linear`` keeps the weight a high-precision
parameter under its own name, so master weights, layer files, resume, resharding and export are untouched (a run
saved with fp8 resumes without it and the other way). On CPU its float8 matmul is emulated exactly
(``torch._scaled_mm``), which is what the parity tests (tests/test_fp8.py) run.

Converted: each decoder layer's attention and MLP projections (:data:`PROJECTIONS`, MLA's included). Never the
embedding, the LM head or a router (``mlp.gate``, ``router``), never a subclass of ``nn.Linear`` (LoRA's, a
quantised or a tensor-parallel layer), and not a projection whose in or out features are not multiples of 16
(torchao's own rule: its scaled matmul needs them), which is listed as skipped.

Objectives: sft, and dpo, whose reference pass runs the same converted stages; grpo is refused
(:func:`fp8_objective_problems`: its generation and log-probabilities are not checked against TRL with fp8).
"""

from __future__ import annotations

import torch
from torch import nn

# torchao's recipe names (torchao.float8.Float8LinearRecipeName), the values of ``fp8``
RECIPES = ("rowwise", "tensorwise", "rowwise_with_gw_hp")
# The decoder layers' projections: attention (MLA's low-rank ones too) and the gated MLP
PROJECTIONS = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
    }
)
FP8_CAPABILITY = (8, 9)  # CUDA compute capability with float8 matmuls (Ada, Hopper and later)
MULTIPLE = 16  # torchao's scaled matmul needs in and out features divisible by this


def float8_filter(module: nn.Module, fqn: str) -> bool:
    """Whether torchao converts ``module`` (named ``fqn`` in the module being converted): a plain ``nn.Linear``
    named as a decoder layer's projection whose features torchao can take."""
    return (
        type(module) is nn.Linear
        and fqn.rsplit(".", 1)[-1] in PROJECTIONS
        and module.in_features % MULTIPLE == 0
        and module.out_features % MULTIPLE == 0
    )


def skipped_projections(module: nn.Module) -> list[str]:
    """The projections of ``module`` :func:`float8_filter` leaves for their sizes, each with them."""
    return [
        f"{fqn} ({m.in_features} -> {m.out_features}, not multiples of {MULTIPLE})"
        for fqn, m in module.named_modules()
        if type(m) is nn.Linear and fqn.rsplit(".", 1)[-1] in PROJECTIONS and not float8_filter(m, fqn)
    ]


def float8_config(recipe: str):
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig.from_recipe_name(recipe)


def convert_to_float8_(module: nn.Module, recipe: str, module_filter_fn=float8_filter) -> nn.Module:
    """torchao's ``convert_to_float8_training`` of ``module`` in place with ``recipe`` and ``module_filter_fn``."""
    from torchao.float8 import convert_to_float8_training

    return convert_to_float8_training(module, module_filter_fn=module_filter_fn, config=float8_config(recipe))


def convert_stage_to_float8_(module: nn.Module, recipe: str) -> tuple[list[str], list[str]]:
    """This rank's stage (or any module holding decoder layers) with its decoder-layer projections made torchao
    ``Float8Linear`` s of ``recipe``, in place; the weights stay the same parameters under the same names. Returns
    (the converted names, the skipped projections with their sizes)."""
    skipped = skipped_projections(module)
    convert_to_float8_(module, recipe)
    from torchao.float8.float8_linear import Float8Linear

    return [fqn for fqn, m in module.named_modules() if isinstance(m, Float8Linear)], skipped


def fp8_objective_problems(recipe: str | None, train_objective: str) -> list[str]:
    """What ``fp8`` = ``recipe`` does not run with of the training objectives, one line; sft and dpo run (their
    parity: tests/test_fp8.py, DPO's reference pass through the same converted stages)."""
    if recipe not in RECIPES or train_objective != "grpo":
        return []
    return [
        f"fp8={recipe} with train_objective=grpo: the completions generated through the stages' Float8Linears and "
        "the old and reference log-probabilities are not checked against TRL's GRPOTrainer with a torchao-converted "
        "model: leave fp8 off (fp8=null)"
    ]


def fp8_problems(
    recipe: str | None, precision: str, peft_method: str, model_type: str | None, moe: bool, kernels: str = "none"
) -> list[str]:
    """What ``fp8`` = ``recipe`` does not run with (the settings' own names; the parallel axes' rules are theirs),
    one line each with the setting to change; [] when fp8 is off."""
    if recipe is None:
        return []
    if recipe not in RECIPES:
        return [f"fp8={recipe} is not a torchao recipe: set fp8 to one of {', '.join(RECIPES)}, or null (off)"]
    problems = []
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < FP8_CAPABILITY:
            problems.append(
                f"fp8={recipe} on {torch.cuda.get_device_name()} (compute capability {major}.{minor}): float8 "
                f"matmuls need {'.'.join(map(str, FP8_CAPABILITY))} or later (L4, L40S, H100, H200, B200): set "
                "fp8=null"
            )
    if precision == "fp16":
        problems.append(
            f"fp8={recipe} with precision=fp16: torchao's float8 training keeps bf16 or fp32 master weights "
            "(fp16's loss scaling is not checked with it): set precision=bf16, or fp8=null"
        )
    if peft_method != "none":
        problems.append(
            f"fp8={recipe} with peft.method={peft_method}: PEFT wraps the projections FP8 would convert (and "
            "QLoRA's are 4-bit), not checked together: set peft.method=none, or fp8=null"
        )
    if moe:
        problems.append(
            f"fp8={recipe} with the Mixture-of-Experts model_type {model_type}: its experts are 3-D parameters "
            "torchao does not convert, only the attention (and any shared-expert MLP) would be, and that is not "
            "checked against the reference: set fp8=null (dense families: llama, mistral, qwen2, qwen3)"
        )
    if kernels != "none":
        problems.append(
            f"fp8={recipe} with kernels={kernels}: Liger's fused modules and torchao's Float8Linear are not checked "
            "together (Liger runs on CUDA only; the GPU check has not run them): set kernels=none, or fp8=null"
        )
    return problems
