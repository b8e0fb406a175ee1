"""LoRA's files: PEFT's adapter format in and out, and what a LoRA run's checkpoint holds and records.

The adapter file's key of a spec's state-dict key (models/lora.py injects the layers) is the spec's Hugging Face
prefix with PEFT's model prefix, without the adapter name:

    spec 3, self_attn.q_proj.lora_A.default.weight  <->  base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight
    spec L+2 (modules_to_save lm_head), weight      <->  base_model.model.lm_head.weight

which is what ``PeftModel.save_pretrained`` writes and ``PeftModel.from_pretrained`` reads. A LoRA checkpoint's
layer files hold the trained tensors only; each rank records the base it loaded (paths and SHA-256s), which resume
and export check.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import torch
from torch import nn

from models.families import family_of
from models.files.hf_convert import (
    atomic_output,
    check_output,
    converted_from,
    hf_differences,
    load_config,
    log,
    stages_to_hf,
)
from models.files.pipeline_dir import (
    CheckpointError,
    check_state_dict,
    copy_tokenizer_files,
    full_shape,
    load_layer_file,
    open_safetensors,
    read_tag,
)
from models.lora import ADAPTER_NAME, lora_config, trainable_state
from models.peft_targets import DECODER_LINEARS
from models.specs import SpecInfo, layer_file_name, spec_layout

PEFT_PREFIX = "base_model.model."  # PeftModelForCausalLM's prefix of the wrapped model's keys
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
DORA_MAGNITUDE = "lora_magnitude_vector"


def adapter_key(info: SpecInfo, key: str) -> str:
    """PEFT's adapter-file key of a spec's state-dict key (module docstring); DoRA's magnitude vector is
    saved without its ``.weight``, as PEFT's ``get_peft_model_state_dict`` writes it."""
    key = key.replace(f"{DORA_MAGNITUDE}.{ADAPTER_NAME}.weight", DORA_MAGNITUDE)
    return PEFT_PREFIX + info.hf_prefix + key.replace(f".{ADAPTER_NAME}.", ".")


def spec_key(layout: list[SpecInfo], peft_key: str) -> tuple[int, str]:
    """(spec index, state-dict key) of an adapter-file key: the inverse of :func:`adapter_key`. The LoRA
    weights get the adapter name back (``lora_A.weight`` -> ``lora_A.default.weight``)."""
    if not peft_key.startswith(PEFT_PREFIX):
        raise KeyError(f"{peft_key}: not a PEFT causal-LM key (no {PEFT_PREFIX!r} prefix)")
    name = peft_key[len(PEFT_PREFIX) :]
    info = max((i for i in layout if i.owns_file and name.startswith(i.hf_prefix)), key=lambda i: len(i.hf_prefix))
    key = name[len(info.hf_prefix) :]
    if key.endswith(DORA_MAGNITUDE):
        return info.index, f"{key}.{ADAPTER_NAME}.weight"
    for part in ("lora_A", "lora_B"):
        key = key.replace(f".{part}.", f".{part}.{ADAPTER_NAME}.")
    return info.index, key


def load_adapter_(local: list[tuple[int, nn.Module]], config, adapter_dir: str) -> int:
    """Set this stage's adapters from a PEFT adapter directory (``peft.init_from``); returns the tensors
    set. Every adapter tensor of the stage must be in the file with its shape; all problems are raised
    together."""
    layout = spec_layout(config)
    path = os.path.join(adapter_dir, ADAPTER_WEIGHTS)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: peft.init_from needs {ADAPTER_WEIGHTS} beside {ADAPTER_CONFIG}")
    problems, count = [], 0
    with open_safetensors(path) as f:
        wanted = {}
        for key in f.keys():
            index, local_key = spec_key(layout, key)
            wanted[(index, local_key)] = key
        for index, module in local:
            info = layout[index]
            for name, param in trainable_state(module).items():
                key = wanted.get((info.file_index, name))
                if key is None:
                    problems.append(f"{adapter_key(info, name)} is not in {path}")
                    continue
                t = f.get_tensor(key)
                if t.shape != param.shape:
                    problems.append(f"{key}: {tuple(t.shape)} in {path}, {tuple(param.shape)} in the model")
                    continue
                with torch.no_grad():
                    param.copy_(t)
                count += 1
    if problems:
        raise ValueError(f"cannot start from the adapter in {adapter_dir}:\n  " + "\n  ".join(problems))
    return count


def adapter_model_problems(adapter_dir: str, config) -> list[str]:
    """An adapter made for another model (another layer count or hidden size), found from its file's keys
    and shapes before start, instead of a key that maps to no stage in every rank."""
    import re

    path = os.path.join(adapter_dir, ADAPTER_WEIGHTS)
    if not os.path.isfile(path):
        return [f"{path} not found: peft.init_from needs {ADAPTER_WEIGHTS} beside {ADAPTER_CONFIG}"]
    layers, wide = set(), set()
    try:
        with open_safetensors(path) as f:
            for key in f.keys():
                m = re.search(r"\.layers\.(\d+)\.", key)
                if m:
                    layers.add(int(m.group(1)))
                if re.search(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.lora_A\.weight$", key):
                    wide.add(f.get_slice(key).get_shape()[1])  # [r, hidden]
    except CheckpointError as e:
        return [f"peft.init_from: {e}"]
    problems = []
    if layers and max(layers) >= config.num_hidden_layers:
        problems.append(
            f"{path} has adapters for decoder layers up to {max(layers)}, the model has {config.num_hidden_layers}"
        )
    if wide - {config.hidden_size}:
        problems.append(
            f"{path}'s adapters take inputs of width {sorted(wide)}, the model's hidden size is {config.hidden_size}"
        )
    return [p + ": an adapter of another model; give one trained on this model's architecture" for p in problems]


def read_adapter_config(adapter_dir: str) -> dict:
    """The adapter directory's ``adapter_config.json``; a file that is not a JSON object raises ValueError naming it."""
    path = os.path.join(adapter_dir, ADAPTER_CONFIG)
    try:
        with open(path) as f:
            saved = json.load(f)
    except ValueError as e:
        raise ValueError(
            f"{path}: not valid JSON ({e}): copy the adapter directory again (save_pretrained's output)"
        ) from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path}: not a JSON object: copy the adapter directory again (save_pretrained's output)")
    return saved


# adapter_config.json's keys compared with the peft settings, and the types PEFT writes them as
_ADAPTER_TYPES = {
    "peft_type": (str,),
    "r": (int,),
    "lora_alpha": (int, float),
    "use_rslora": (bool,),
    "use_dora": (bool,),
}


_TYPE_WORDS = {str: "a string", int: "an integer", bool: "true or false"}


def _module_list(path: str, key: str, value, problems: list[str]) -> list[str] | None:
    """adapter_config.json's target_modules / modules_to_save as a list of names; None (with a problem) for a
    value this pipeline cannot compare. PEFT writes a string as a regex over module names, or "all-linear"."""
    if value is None:
        return []
    if key == "target_modules" and value == "all-linear":
        return list(DECODER_LINEARS)  # PEFT: every linear layer but the output layer
    if isinstance(value, str):
        problems.append(
            f"{key} {value!r} in {path} is a regex over module names, which this pipeline does not match: write "
            f"the modules it selects there as a list (for example {list(DECODER_LINEARS)})"
        )
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        problems.append(f"{key} {value!r} in {path} is not a list of module names: the file is damaged; copy it again")
        return None
    return value


def adapter_settings_problems(adapter_dir: str, peft_cfg) -> tuple[list[str], list[str]]:
    """(what is wrong with the adapter directory's ``adapter_config.json`` itself, how it differs from the ``peft``
    settings it must match). A value of the wrong type is the file's fault, said as such (not as a setting to
    change)."""
    path = os.path.join(adapter_dir, ADAPTER_CONFIG)
    try:
        saved = read_adapter_config(adapter_dir)
    except ValueError as e:
        return [f"peft.init_from: {e}"], []
    now = lora_config(peft_cfg).to_dict()
    problems, damaged = [], []
    for key in ("peft_type", "r", "lora_alpha", "use_rslora", "use_dora"):
        value, types = saved.get(key), _ADAPTER_TYPES[key]
        if key in saved and (not isinstance(value, types) or (bool not in types and isinstance(value, bool))):
            damaged.append(
                f"{key} {value!r} in {path} is not {_TYPE_WORDS[types[0]]}: "
                "the file is damaged or hand-edited; write the value the adapter was trained with, or copy it again"
            )
        elif saved.get(key) != now.get(key) and not (key == "lora_alpha" and saved.get(key) == float(now[key])):
            problems.append(f"{key} {saved.get(key)!r} in {adapter_dir}, {now.get(key)!r} here")
    for key in ("target_modules", "modules_to_save"):
        names = _module_list(path, key, saved.get(key), damaged)
        if names is not None and sorted(names) != sorted(now.get(key) or []):
            problems.append(f"{key} {sorted(names)} in {adapter_dir}, {sorted(now.get(key) or [])} here")
    return damaged, problems


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def adapter_file_problems(local: list[tuple[int, nn.Module]], config, tag_dir: str) -> list[str]:
    """Problems of this stage's layer files in a LoRA checkpoint: each must hold exactly the stage's
    trained tensors (adapters, modules_to_save) with their shapes; the frozen base is not saved there."""
    layout, problems = spec_layout(config), []
    for index, module in local:
        if not layout[index].owns_file:
            continue  # a tied head: the embedding's file holds the one copy
        path = os.path.join(tag_dir, layer_file_name(index))
        try:
            state = load_layer_file(path)
        except Exception as e:  # noqa: BLE001 (CheckpointError, or a damaged file: reported with the rest)
            problems.append(str(e))
            continue
        problems += check_state_dict(path, state, {k: full_shape(p) for k, p in trainable_state(module).items()})
    return problems


def load_checkpoint_adapters_(local: list[tuple[int, nn.Module]], config, tag_dir: str) -> None:
    """Set this stage's trained tensors from a LoRA checkpoint's layer files (a resume on another layout,
    where DeepSpeed's own load does not apply); every file is checked first, all problems raised together."""
    problems = adapter_file_problems(local, config, tag_dir)
    if problems:
        raise CheckpointError(f"cannot resume from {tag_dir}:\n  " + "\n  ".join(problems))
    layout = spec_layout(config)
    for index, module in local:
        if layout[index].owns_file:
            with torch.no_grad():
                for key, t in load_layer_file(os.path.join(tag_dir, layer_file_name(index))).items():
                    trainable_state(module)[key].copy_(t)


def saved_base_record(tag_dir: str) -> dict | None:
    """The base a LoRA checkpoint adapts, as every rank recorded it (each its own stage's layer files)."""
    records = []
    for name in sorted(os.listdir(tag_dir)):
        if name.startswith("trainer_state_rank") and name.endswith(".json"):
            with open(os.path.join(tag_dir, name)) as f:
                records.append(json.load(f).get("peft_base"))
    if not records or not all(records):
        return None
    return {
        "path": records[0]["path"],
        "tag": records[0].get("tag"),  # None in records written before the tag was kept
        "sha256": {k: v for r in records for k, v in r["sha256"].items()},
    }


def base_record(ckpt_dir: str, files: list[str]) -> dict:
    """What a LoRA checkpoint records of the base this rank loaded: its path, tag and each layer file's SHA-256."""
    tags = {os.path.basename(os.path.dirname(f)) for f in files}
    return {
        "path": os.path.abspath(ckpt_dir),
        "tag": tags.pop() if len(tags) == 1 else None,
        "sha256": {os.path.basename(f): file_sha256(f) for f in files},
    }


def checked_base(tag_dir: str, base_checkpoint: str | None = None) -> tuple[str, str]:
    """(directory, tag) of the base a LoRA checkpoint's adapters were trained on: the recorded one (or
    ``base_checkpoint``, the same base moved), its layer files checked against the recorded SHA-256s.
    The recorded tag, not the base's ``latest``: a base trained on since then still gives the right one."""
    record = saved_base_record(tag_dir)
    if record is None:
        raise CheckpointError(f"{tag_dir} is not a checkpoint of a LoRA run (peft.method=lora)")
    base = base_checkpoint or record["path"]
    fix = "pass --base-checkpoint DIR: the base's pipeline checkpoint, checked against the run's SHA-256 record"
    if not os.path.isdir(base):
        where = "--base-checkpoint" if base_checkpoint else "the base this LoRA run adapts,"
        raise CheckpointError(f"{where} {base} does not exist (moved or deleted?): {fix}")
    tag = record["tag"] or read_tag(base)
    if not os.path.isdir(os.path.join(base, tag)):
        raise CheckpointError(
            f"{base} no longer holds {tag}, the base checkpoint the adapters were trained on (save_total_limit "
            f"may have removed it): restore it, or {fix}"
        )
    changed = []
    for name, sha in sorted(record["sha256"].items()):
        path = os.path.join(base, tag, name)
        if not os.path.isfile(path):
            changed.append(f"{path} is missing")
        elif file_sha256(path) != sha:
            changed.append(f"{path} differs in content (SHA-256) from the file the adapters were trained on")
    if changed:
        raise CheckpointError(
            f"{tag_dir}'s adapters were trained on {record['path']} ({tag}); the base found now differs:\n  "
            + "\n  ".join(changed)
            + f"\n  {fix}"
        )
    return base, tag


def base_mismatch(saved: dict | None, now: dict) -> list[str]:
    """How the base loaded now differs from the one a checkpoint's adapters were trained on."""
    if not saved:
        return ["it records no base model (not a LoRA checkpoint of this version)"]
    unknown = sorted(f for f in now["sha256"] if f not in saved["sha256"])
    if unknown:
        return [f"it records no hash of the base's {', '.join(unknown)} (a checkpoint of another model?)"]
    changed = sorted(f for f, h in now["sha256"].items() if saved["sha256"][f] != h)
    if not changed:
        return []
    return [
        f"its adapters were trained on the base in {saved['path']}, and {', '.join(changed)} of the base loaded "
        f"now ({now['path']}) differ(s) in content (SHA-256): resume on the same base weights, or start a new "
        "output_dir from peft.init_from=<an exported adapter>"
    ]


def lora_run_base(tag_dir: str) -> str | None:
    """The base checkpoint a LoRA run's checkpoint adapts (rank 0's record), or None for any other checkpoint."""
    path = os.path.join(tag_dir, "trainer_state_rank00000.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        record = json.load(f).get("peft_base")
    return record["path"] if record else None


def saved_peft_settings(tag_dir: str):
    """The ``peft`` settings a checkpoint was trained with (its train_config.yaml holds every field of
    training.configuration.schema.PeftConfig), as attributes."""
    from types import SimpleNamespace

    import yaml

    with open(os.path.join(tag_dir, "train_config.yaml")) as f:
        return SimpleNamespace(**(yaml.safe_load(f) or {})["peft"])


def export_adapter(
    run_dir: str,
    output: str,
    tag: str | None = None,
    base_model: str | None = None,
    merge: bool = False,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    base_checkpoint: str | None = None,
) -> None:
    """A LoRA run's checkpoint -> a PEFT adapter directory (``adapter_config.json``,
    ``adapter_model.safetensors`` with PEFT's keys), or with ``merge`` a Hugging Face model directory
    with the adapters merged into the base (PEFT's ``merge_and_unload``: the whole model in memory).

    Always on the base the adapters were trained on (``checked_base``). The adapter's
    ``base_model_name_or_path`` must be a model ``AutoPeftModelForCausalLM`` can load: ``base_model`` (a
    local directory is checked tensor by tensor against the base), else the Hugging Face directory the
    base was converted from (checked likewise), else the pipeline checkpoint, with a line saying how to
    set a loadable one."""
    from safetensors.torch import save_file

    check_output(run_dir, output, overwrite)
    tag = read_tag(run_dir, tag)
    tag_dir = os.path.join(run_dir, tag)
    base, base_tag = checked_base(tag_dir, base_checkpoint)
    config, peft_cfg = load_config(run_dir), saved_peft_settings(tag_dir)
    export_hint = f"convert2ckpt.py --to-hf --input {base} --tag {base_tag} --output BASE_HF"
    note = None
    if merge:
        if base_model:
            raise CheckpointError("--base-model names the base of an adapter export; --merge writes a whole model")
    elif base_model and os.path.isdir(base_model):
        diffs = hf_differences(base_model, base, base_tag, config)
        if diffs:
            raise CheckpointError(
                f"--base-model {base_model} is not the base the adapters were trained on ({base}, {base_tag}):\n  "
                + "\n  ".join(diffs)
                + f"\n  pass that base's Hugging Face directory, or write one: {export_hint}"
            )
    elif base_model:
        note = f"--base-model {base_model} is not a local directory: written as given, not checked against the base"
    else:
        source = converted_from(base)
        if source and not hf_differences(source, base, base_tag, config):
            base_model = source
        else:
            base_model = base
            note = (
                f"adapter_config.json names the pipeline checkpoint {base} as its base, which transformers cannot "
                f"load: write its Hugging Face form ({export_hint}) and export again with --base-model BASE_HF"
            )
    layout = spec_layout(config)
    tensors = {}
    for info in layout:
        if info.owns_file:
            for key, t in load_layer_file(os.path.join(tag_dir, layer_file_name(info.index))).items():
                tensors[adapter_key(info, key)] = (t if dtype is None else t.to(dtype)).contiguous()
    with atomic_output(run_dir, output, overwrite, "lora-to-merged-hf" if merge else "lora-to-peft") as tmp:
        adapter_dir = os.path.join(tmp, "adapter") if merge else tmp
        os.makedirs(adapter_dir, exist_ok=True)
        lora_config(peft_cfg, base_model or base).save_pretrained(adapter_dir)
        save_file(tensors, os.path.join(adapter_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        if merge:
            from peft import PeftModel

            base_hf = os.path.join(tmp, "base")
            stages_to_hf(base, base_hf, tag=base_tag)
            model = family_of(config).causal_lm.from_pretrained(base_hf, dtype="auto")
            merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
            if dtype is not None:
                merged = merged.to(dtype)
            merged.save_pretrained(tmp)
            copy_tokenizer_files(base_hf, tmp)
            shutil.rmtree(adapter_dir)
            shutil.rmtree(base_hf)
    what = "merged into the base" if merge else f"PEFT adapter, base_model_name_or_path {base_model}"
    log(f"wrote {output} ({what}: {len(tensors)} adapter tensors of {tag}, trained on {base} {base_tag})")
    if note:
        log(f"note: {note}")
