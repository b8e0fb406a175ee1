"""The DeepSpeed JSON (``ds_config``): where it is found, and its rules against the Hydra config, beside
``training.optim.fill_ds_config``, which writes the keys train.py owns. Checked before start, with every
other problem, by ``training.configuration.validate.resolve``."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from parallel.layout import Layout
    from training.configuration.schema import TrainConfig

DS_CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ds_configs")


def resolve_ds_config_path(name: str) -> str | None:
    """``ds_config`` -> existing JSON path, or None. A bare name is looked up in ``ds_configs/``."""
    candidates = [name] if name.endswith(".json") or os.sep in name else []
    candidates.append(os.path.join(DS_CONFIG_DIR, f"{name}.json"))
    return next((c for c in candidates if os.path.isfile(c)), None)


def available_ds_configs() -> list[str]:
    return sorted(f[: -len(".json")] for f in os.listdir(DS_CONFIG_DIR) if f.endswith(".json"))


def accelerator_name() -> str:
    """DeepSpeed's accelerator: "cuda", "cpu", ... (what train.py runs on)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def fp16_supported() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().is_fp16_supported()


def precision_problems(precision: str) -> list[str]:
    """fp16 is for CUDA GPUs. DeepSpeed's CPU accelerator says it supports fp16 on a CPU with AVX512-FP16 and not
    otherwise, and nothing here tests fp16 training on a CPU: refused on every CPU alike, not by the CPU model."""
    if precision != "fp16":
        return []
    accelerator = accelerator_name()
    if accelerator == "cpu":
        return [
            "precision fp16 needs a CUDA GPU (on the CPU, DeepSpeed's fp16 exists only where the CPU has AVX512-FP16 "
            "and is not tested here, so it is refused on every CPU): set precision=bf16 or precision=fp32"
        ]
    if not fp16_supported():
        return [f"precision fp16 is not supported on this device ({accelerator}): set precision=bf16 or precision=fp32"]
    return []


# The DeepSpeed JSON may leave these to train.py or say "auto" (Hugging Face's spelling of the same).
AUTO = "auto"
# Monitor sections that training.optim.fill_ds_config writes from monitor.* (enabled, output_path, job_name).
MONITOR_SECTIONS = {"tensorboard": "monitor.tensorboard", "csv_monitor": "monitor.csv"}


def ds_json_conflicts(cfg: TrainConfig, ds_json: dict, layout: Layout) -> list[str]:
    """Values in the DeepSpeed JSON that contradict the Hydra config, in either direction.

    The Hydra config is the source of truth for every key ``training.optim.fill_ds_config`` writes;
    the JSON may omit such a key, say "auto", or agree, but never say otherwise: a setting that one
    side silently overrides is a setting the user believes in and does not get.
    """
    problems = []
    train_batch = layout.ds_train_batch  # DeepSpeed counts a sample once per rank of its sequence group
    owned = {
        "train_micro_batch_size_per_gpu": (cfg.micro_batch_size, "micro_batch_size"),
        "gradient_accumulation_steps": (cfg.gradient_accumulation_steps, "gradient_accumulation_steps"),
        "gradient_clipping": (cfg.optim.max_grad_norm, "optim.max_grad_norm"),
    }
    for key, (value, knob) in owned.items():
        if ds_json.get(key, AUTO) not in (AUTO, value):
            problems.append(
                f"ds_config sets {key}={ds_json[key]} but {knob}={value}: remove {key} from the JSON or set {knob}"
            )
    if ds_json.get("train_batch_size", AUTO) not in (AUTO, train_batch):
        b = ds_json["train_batch_size"]
        fix = ""
        per_step = layout.micro_batch * layout.data_axis
        if isinstance(b, int) and b % per_step == 0:
            fix = f": set gradient_accumulation_steps={b // per_step}"
        problems.append(
            f"train_batch {b} != {layout.ds_batch_factors()} (={train_batch}){fix}, or remove train_batch_size from "
            "the JSON"
        )
    for section in ("optimizer", "scheduler"):
        if section in ds_json:
            problems.append(f"ds_config has an '{section}' section: remove it, optim.* configures it")
    for key in ("bf16", "fp16"):
        enabled = ds_json.get(key, {}).get("enabled", AUTO)
        if enabled != AUTO and bool(enabled) != (cfg.precision == key):
            fix = f"set precision={key}" if enabled else "set precision to the one you mean (fp32, bf16 or fp16)"
            problems.append(
                f"ds_config sets {key}.enabled={str(enabled).lower()} but precision={cfg.precision}: "
                f"remove {key}.enabled from the JSON (precision decides it) or {fix}"
            )
    if ds_json.get("amp", {}).get("enabled", False):
        problems.append(
            f"ds_config enables amp but precision={cfg.precision} decides the precision: remove the 'amp' section"
        )
    for section, knob in MONITOR_SECTIONS.items():
        if section not in ds_json:
            continue
        value = getattr(cfg.monitor, knob.split(".")[1])
        extra = sorted(set(ds_json[section]) - {"enabled"})
        if ds_json[section].get("enabled", False) != value or extra:
            problems.append(
                f"ds_config has a '{section}' section ({json.dumps(ds_json[section])}) but "
                f"{knob}={str(value).lower()}: "
                f"remove the section and set {knob}=true (it writes to output_dir/monitor)"
            )
    zero = ds_json.get("zero_optimization", {})
    if zero.get("zero_quantized_weights") and accelerator_name() == "cpu":
        problems.append(
            "ds_config uses ZeRO++ quantized weights (zero_quantized_weights), whose quantizer kernel the CPU "
            "accelerator "
            "lacks ('This op had not been implemented on CPU backend'): run on GPUs, or use ds=zero3 here"
        )
    return problems


def load_ds_json(name: str) -> tuple[dict | None, str | None]:
    """(parsed JSON, None) or (None, problem line) for the ``ds_config`` setting."""
    path = resolve_ds_config_path(name)
    if path is None:
        return (
            None,
            f"ds_config {name!r} not found: choose one of {available_ds_configs()} or give a path to a JSON file",
        )
    try:
        with open(path) as f:
            ds_json = json.load(f)
    except json.JSONDecodeError as e:
        return None, f"ds_config {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
    unknown = unknown_key_problems(os.path.basename(path), ds_json) if isinstance(ds_json, dict) else []
    return ds_json, "; ".join(unknown) or None


_KNOWN_KEYS: set[str] = set()


def deepspeed_top_level_keys() -> set[str]:
    """The top-level keys DeepSpeed reads from its JSON, from DeepSpeed itself: the keys its config reader asks
    for (DeepSpeedConfig._initialize_params run on an empty dict that records every key asked for), the key
    names in its constants/config modules, and the removed ones it refuses in its own words. Generous: a key
    missing here is refused, a name listed that is not top-level only lets a typo of it through."""
    if _KNOWN_KEYS:
        return _KNOWN_KEYS
    import re

    import deepspeed

    root = os.path.dirname(deepspeed.__file__)
    named = re.compile(r"^[A-Z][A-Z0-9_]* *= *[\"']([a-z][a-z0-9_]*)[\"']", re.M)
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(("constants.py", "config.py")):
                with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                    _KNOWN_KEYS.update(named.findall(f.read()))
    try:
        from deepspeed.runtime import config as ds_config_module

        _KNOWN_KEYS.update(getattr(ds_config_module, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}))
        _KNOWN_KEYS.update(_asked_keys(ds_config_module.DeepSpeedConfig))
    except Exception:  # noqa: BLE001 - another DeepSpeed version: the constants above still name its keys
        pass
    _KNOWN_KEYS.update(("zero_optimization", "train_batch_size", "optimizer", "scheduler", "bf16", "fp16"))
    return _KNOWN_KEYS


def _asked_keys(config_class) -> set[str]:
    """The keys ``config_class._initialize_params`` asks an empty param dict for."""
    asked: set[str] = set()

    class Asked(dict):
        def get(self, key, default=None):
            asked.add(key)
            return super().get(key, default)

        def __getitem__(self, key):
            asked.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            asked.add(key)
            return super().__contains__(key)

        def keys(self):
            return self  # `key in d.keys()` asks too

    config = config_class.__new__(config_class)
    config._param_dict = Asked()
    try:
        config._initialize_params(config._param_dict)
    except Exception:  # noqa: BLE001 - the keys asked before it stopped still count
        pass
    return {k for k in asked if isinstance(k, str)}


def unknown_key_problems(name: str, ds_json: dict) -> list[str]:
    """Top-level keys of the DeepSpeed JSON that DeepSpeed does not read: it ignores them without a word, so a
    misspelt section (zero_optimisation) would run with DeepSpeed's defaults."""
    import difflib

    known = deepspeed_top_level_keys()
    problems = []
    for key in ds_json:
        if key in known:
            continue
        near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
        fix = f"did you mean {near[0]!r}?" if near else "remove it, or name a key DeepSpeed reads"
        problems.append(f"ds_config {name}: unknown key {key!r} (DeepSpeed ignores it): {fix}")
    return problems
