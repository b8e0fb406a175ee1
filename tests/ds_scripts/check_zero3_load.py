"""train.py with ZeRO-3 (num_stages=1), checking on every rank what the partitioned build and load made.

After train.py's init_weights (its load report, peak RSS included, already taken), each rank writes
``$ZERO3_CHECK_OUT.<rank>`` (JSON):

- ``partitioned``: every parameter was partitioned at build (deepspeed.zero.Init);
- ``loaded``: every tensor, gathered spec by spec, equals its layer file's (cast to the training dtype);
- ``buffers``: the rotary buffers equal those of a decoder layer built outside zero.Init (fp32);
- ``scratch``: for a tiny untied and a tiny tied model, in bf16 and fp32, a partitioned stack initialised
  from scratch holds exactly the weights of the unpartitioned initialisation (init_weights_ in fp32, then
  the cast), and a tied head's weight is the embedding's own parameter.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import train  # noqa: E402  (first: it filters known-harmless output before deepspeed is imported)

# isort: split
import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from models.files.pipeline_dir import is_partitioned, load_layer_file, local_modules, read_tag  # noqa: E402
from models.files.zero3_load import build_partitioned_stack, init_partitioned_  # noqa: E402
from models.llama_pipe import LlamaStack, init_weights_, layer_file_name, spec_layout  # noqa: E402
from models.tiny import tiny_config  # noqa: E402


def gathered_states(model):
    """(spec index, {key: whole tensor}) per module, gathered from the partitions (a collective)."""
    for index, module in local_modules(model):
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            yield index, {k: v.detach().clone() for k, v in module.state_dict().items()}


def check_loaded(model, resolved) -> dict:
    config, ckpt = resolved.model_config, resolved.cfg.model_name_or_path
    tag, layout = read_tag(ckpt), spec_layout(config)
    mismatched, tensors = [], 0
    for index, state in gathered_states(model):
        on_disk = load_layer_file(os.path.join(ckpt, tag, layer_file_name(layout[index].file_index)))
        for key, value in state.items():
            tensors += 1
            if not torch.equal(value, on_disk[key].to(value.dtype)):
                mismatched.append(f"{index}.{key}")
    plain = model._layer_specs[1].build()  # decoder layer 0, outside zero.Init
    buffers = {k: v for k, v in model.forward_funcs[1].named_buffers()}
    same_buffers = all(
        b.dtype == buffers[k].dtype and torch.equal(b, buffers[k]) for k, b in plain.named_buffers()
    ) and set(buffers) == set(dict(plain.named_buffers()))
    return {
        "partitioned": all(is_partitioned(p) for p in model.parameters()),
        "loaded": not mismatched,
        "mismatched": mismatched[:10],
        "tensors": tensors,
        "buffers": same_buffers,
    }


def check_scratch(ds_config: dict) -> dict:
    """From-scratch weights of partitioned stacks against the unpartitioned initialisation."""
    results = {}
    for precision in ("bf16", "fp32"):
        ds = {**ds_config, "bf16": {"enabled": precision == "bf16"}}
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        for tied in (False, True):
            config = tiny_config(tie_word_embeddings=tied)
            layout = spec_layout(config)
            stack = build_partitioned_stack(config, ds)
            plain = LlamaStack(config)
            for index, module in local_modules(stack):
                init_partitioned_(module, stack._layer_specs[index], config, seed=7 + layout[index].file_index)
            for index, module in local_modules(plain):
                init_weights_(module, config, seed=7 + layout[index].file_index)
            expected = dict(local_modules(plain))
            equal = all(
                torch.equal(v, expected[index].state_dict()[k].to(dtype))
                for index, state in gathered_states(stack)
                for k, v in state.items()
            )
            head = stack.forward_funcs[-1]
            tied_ok = (head.args[0] is stack.forward_funcs[0]) if tied else isinstance(head, torch.nn.Module)
            unique = len({id(p) for p in stack.parameters()}) == len(list(plain.parameters()))
            results[f"{precision}{'_tied' if tied else ''}"] = equal and tied_ok and unique
    return results


original_init_weights = train.init_weights


def checked_init_weights(model, resolved, rss_before_model_mib):
    reports = original_init_weights(model, resolved, rss_before_model_mib)
    result = check_loaded(model, resolved)
    result["scratch"] = check_scratch(train.fill_ds_config(resolved))
    with open(f"{os.environ['ZERO3_CHECK_OUT']}.{dist.get_rank()}", "w") as f:
        json.dump(result, f)
    return reports


train.init_weights = checked_init_weights
train.main()
