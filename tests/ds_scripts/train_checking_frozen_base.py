"""train.py (a LoRA run), checking at exit on every rank that its stage's frozen base weights still equal
the base checkpoint's layer files, bit for bit: training moved the adapters only.

Prints ``FROZEN_BASE rank R: N equal, M differ [names]`` at exit. A base weight under PEFT's layer is
``<module>.base_layer.weight`` in the model and ``<module>.weight`` in the layer file.
"""

import atexit
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import train  # noqa: E402  (first: it filters known-harmless output before deepspeed is imported)

# isort: split
import torch  # noqa: E402

from models.files.pipeline_dir import load_layer_file, local_modules, read_tag  # noqa: E402
from models.llama_pipe import layer_file_name, spec_layout  # noqa: E402

seen = {}
add_lora = train.add_lora


def recording_add_lora(model, resolved):
    seen.update(model=model, resolved=resolved)
    return add_lora(model, resolved)


def check() -> None:
    model, resolved = seen["model"], seen["resolved"]
    ckpt = resolved.cfg.model_name_or_path
    tag_dir = os.path.join(ckpt, read_tag(ckpt, None))
    layout = spec_layout(resolved.model_config)
    equal, differ = 0, []
    for index, module in local_modules(model):
        if not layout[index].owns_file:
            continue
        original = load_layer_file(os.path.join(tag_dir, layer_file_name(index)))
        for name, p in module.named_parameters():
            if p.requires_grad:
                continue
            same = torch.equal(p.detach().cpu(), original[name.replace(".base_layer.", ".")])
            equal += same
            if not same:
                differ.append(f"{index}:{name}")
    print(f"FROZEN_BASE rank {os.environ.get('RANK')}: {equal} equal, {len(differ)} differ {differ}", flush=True)


train.add_lora = recording_add_lora
atexit.register(check)
train.main()
