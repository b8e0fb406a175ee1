"""Optimizer state per parameter, whatever layout saved it: resume on another layout, and the portable form.

Every optimizer DeepSpeed runs here keeps, per parameter, an fp32 master (unless the weights are fp32
masters themselves), Adam's two moments and a step count. The layouts differ only in how they cut them
into files:

- ZeRO-1/2, and bf16 at ZeRO-0 (``[bf16_]zero_pp_rank_<d>_mp_rank_<s>_optim_states.pt``): per stage s
  and data-parallel rank d, one flat fp32 partition per AdamW group, with ``param_slice_mappings``
  (name -> start, numel) of the fragments it holds; a parameter is its fragments in rank order.
- ZeRO-3 (``zero_pp_rank_<d>_mp_rank_00_optim_states.pt``): every parameter cut in dp equal pieces (the
  last padded), rank d's flat groups its pieces in the order of ``param_shapes`` (model-states files),
  as DeepSpeed's ``zero_to_fp32`` reads them.
- ZeRO-0 in fp32 (``mp_rank_<s>_model_states.pt``, key ``optimizer``): torch AdamW's state by position in
  the groups train.py built; their names are in the trainer state (``optimizer_param_names``), and the
  layer files hold the masters.
- With tensor parallelism, the ZeRO and ZeRO-0 files above per model-parallel rank (stage x tp + TP rank),
  each holding its pieces of the split parameters: joined along the dimension each was cut
  (``tp_split_dims`` in the trainer state), and cut again for a split rank of the new layout.
- With expert parallelism, each expert slot's experts joined along the experts' dimension: at ZeRO-1 and bf16
  from DeepSpeed's MoE parameter groups (the slot's partitions over its expert-data-parallel ranks), in fp32 at
  ZeRO-0 from the engine file and the other slots' ``expert_moments_*`` files.
- The portable form (``convert2ckpt.py --reshard``): ``optimizer_XX.safetensors`` per layer file, the
  same keys as the layer file with ``.exp_avg``, ``.exp_avg_sq`` and, where kept, ``.fp32`` appended.

A parameter is named as layer files name weights, (spec file index, key in the file): the same in every
layout, so any saved layout loads into any other (``load_into_engine``). Files are memory-mapped and
read with ``weights_only=True`` (``models.files.pipeline_dir.load_deepspeed_file``): a resharded resume touches
only the fragments of this rank's parameters, and runs no pickle.

Written here rather than through DeepSpeed's universal checkpoint (``ds_to_universal``): that loads every
file with ``weights_only=False``, has no loader for fp32 at ZeRO-0, and writes a copy of every state
before any resume; this reads the saved files in place.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass

import torch
from safetensors import safe_open

from models.files.hf_convert import atomic_output, check_output, log
from models.files.peft_adapter import saved_base_record
from models.files.pipeline_dir import (
    SIDE_FILES,
    CheckpointError,
    first_line,
    full_numel,
    load_deepspeed_file,
    load_layer_file,
    read_tag,
    split_of,
    tp_piece,
)
from models.llama_pipe import layer_file_name, spec_layout
from parallel.expert_parallel import EXPERT_MOMENTS_FILE

ZERO_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
ENGINE_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
ZERO3_MODEL_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"
PORTABLE_FILE = re.compile(r"^optimizer_(\d+)\.safetensors$")
TRAINER_STATE = re.compile(r"^trainer_state_rank(\d+)\.json$")
MOMENTS = ("exp_avg", "exp_avg_sq")

Key = tuple[int, str]  # (spec file index, key in its layer file)


def portable_file_name(file_index: int) -> str:
    return f"optimizer_{file_index:02d}.safetensors"


def spec_key(name: str) -> Key:
    """A DeepSpeed parameter name -> (spec file index, key in its layer file): ``3.mlp.up_proj.weight``
    (pipeline), ``layers.3.mlp.up_proj.weight`` (the data-parallel engine's stack), and
    ``tied_modules.embed_tokens.weight`` (a tied embedding, stored in spec 0's file)."""
    parts = name.split(".")
    if parts[0] == "tied_modules":
        return 0, ".".join(parts[2:])
    if parts[0] == "layers":
        parts = parts[1:]
    return int(parts[0]), ".".join(parts[1:])


@dataclass(frozen=True)
class Fragment:
    """Elements [start, start + numel) of flat tensor ``group`` of one file hold this parameter's
    elements [offset, offset + numel)."""

    path: str
    group: int
    start: int
    numel: int
    offset: int


class SavedOptimizerState:
    """The optimizer state of every parameter in one checkpoint directory, by :func:`spec_key`.

    ``problems`` lists what is missing or unreadable (files of some rank, an unknown format); ``get``
    assembles one parameter's state from the fragments that hold it.
    """

    def __init__(self, tag_dir: str):
        self.tag_dir = tag_dir
        self.format = ""
        self.problems: list[str] = []
        self.step: float | None = None
        self._files: dict[str, dict] = {}
        self._fragments: dict[Key, list[Fragment]] = {}
        self._numel: dict[Key, int] = {}
        self._zero0: dict[Key, tuple[str, int]] = {}  # key -> (engine file, state index)
        self._portable: dict[Key, str] = {}
        # Tensor parallelism: each TP rank's files hold its piece of a split parameter, cut along this dim.
        self.tp, self.expert_parallel, self._split_dims = 1, 1, {}
        self._pieces: dict[Key, list] = {}  # key -> per TP rank: its fragments (ZeRO) or (file, index) (ZeRO-0)
        names = sorted(os.listdir(tag_dir)) if os.path.isdir(tag_dir) else []
        self._read_tensor_parallel(names)
        try:
            if any(PORTABLE_FILE.match(n) for n in names):
                self._scan_portable(names)
            elif any(ZERO_FILE.match(n) for n in names):
                self._scan_zero(names)
            elif any(ENGINE_FILE.match(n) for n in names):
                self._scan_zero0(names)
            else:
                self.problems.append(f"{tag_dir} holds no optimizer states (no DeepSpeed or portable files)")
        except CheckpointError as e:
            self.problems.append(str(e))
        except (RuntimeError, EOFError, KeyError, IndexError, ValueError) as e:  # damaged, or not DeepSpeed's
            self.problems.append(
                f"{tag_dir}: its optimizer states are unreadable ({type(e).__name__}: {first_line(e)})"
            )

    # -- reading the saved layouts -------------------------------------------------------------

    def _read_tensor_parallel(self, names: list[str]) -> None:
        for n in names:
            if TRAINER_STATE.match(n):
                with open(os.path.join(self.tag_dir, n)) as f:
                    state = json.load(f)
                self.tp = state.get("tensor_parallel", 1)
                self.expert_parallel = state.get("expert_parallel", 1)
                self._split_dims.update({spec_key(k): d for k, d in state.get("tp_split_dims", {}).items()})

    def _stage_and_tp_rank(self, mp_rank: int) -> tuple[int, int]:
        """DeepSpeed's model-parallel rank of a file: stage x tp + TP rank (the tensor axis varies fastest)."""
        return divmod(mp_rank, self.tp)

    def _load(self, path: str) -> dict:
        if path not in self._files:
            self._files[path] = load_deepspeed_file(path, map_location="cpu", mmap=True)
        return self._files[path]

    def _scan_zero(self, names: list[str]) -> None:
        files: dict[int, dict[int, str]] = {}  # model-parallel rank (stage x tp + TP rank) -> dp rank -> path
        for n in names:
            m = ZERO_FILE.match(n)
            if m:
                files.setdefault(int(m.group(3)), {})[int(m.group(2))] = os.path.join(self.tag_dir, n)
        first = self._load(next(iter(next(iter(files.values())).values())))["optimizer_state_dict"]
        if "fp32_flat_groups" in first:
            self.format = "ZeRO-3"
            return self._scan_zero3(files)
        self.format = "ZeRO-1/2" if "zero_stage" in first else "bf16 ZeRO-0"
        self.problems += [
            f"{self.tag_dir}: no optimizer states of stage {stage}"
            + (f", tensor-parallel rank {t}" if self.tp > 1 else "")
            + f" (of {(max(files) + 1) // self.tp}): the checkpoint is incomplete"
            for stage, t in map(self._stage_and_tp_rank, range(max(files) + 1))
            if stage * self.tp + t not in files
        ]
        owner: dict[Key, int] = {}  # a tied weight is on two stages: its first stage's copy is read
        slots = max(self.tp, self.expert_parallel)  # pieces per parameter: TP ranks, or expert slots
        for mp in sorted(files):
            ranks = files[mp]
            stage, t = self._stage_and_tp_rank(mp)
            dp = self._load(ranks[min(ranks)])["optimizer_state_dict"]["partition_count"][0]
            missing = [d for d in range(dp) if d not in ranks]
            if missing:
                self.problems += [
                    f"{self.tag_dir}: the optimizer states of data-parallel rank {d} of stage {stage}"
                    + (f", tensor-parallel rank {t}," if self.tp > 1 else "")
                    + " are missing "
                    f"(of {dp}): the checkpoint is incomplete"
                    for d in missing
                ]
                continue
            for d in range(dp):
                state = self._load(ranks[d])["optimizer_state_dict"]
                self._note_step(state["base_optimizer_state"]["state"])
                saved_groups = state["base_optimizer_state"].get("param_groups", [])
                for g, mapping in enumerate(state["param_slice_mappings"]):
                    # DeepSpeed's MoE group (expert parallelism): the experts of data-parallel rank d's expert slot
                    # d % ep, partitioned over that slot's ranks (parallel/expert_parallel.py lays the groups out)
                    experts = g < len(saved_groups) and saved_groups[g].get("moe", False)
                    piece = d % self.expert_parallel if experts else t
                    for name, address in mapping.items():
                        key = spec_key(name)
                        if owner.setdefault(key, stage) != stage or (t and key not in self._split_dims):
                            continue  # a tied copy; a replicated parameter's copy on another TP rank
                        fragments = self._pieces.setdefault(key, [[] for _ in range(slots)])[piece]
                        offset = sum(f.numel for f in fragments)
                        fragments.append(Fragment(ranks[d], g, address.start, address.numel, offset))
                        if experts:
                            self._split_dims[key] = 0
        self._numel = {k: sum(f.numel for fs in pieces for f in fs) for k, pieces in self._pieces.items()}

    def _scan_zero3(self, files: dict[int, dict[int, str]]) -> None:
        ranks = files[0]
        dp = self._load(ranks[min(ranks)])["optimizer_state_dict"]["partition_count"]
        dp = dp if isinstance(dp, int) else dp[0]
        missing = [d for d in range(dp) if d not in ranks]
        model_file = os.path.join(self.tag_dir, ZERO3_MODEL_FILE)
        if missing or not os.path.isfile(model_file):
            self.problems += [
                f"{self.tag_dir}: the ZeRO-3 optimizer states of rank {d} are missing (of {dp}): the checkpoint is "
                "incomplete"
                for d in missing
            ]
            if not os.path.isfile(model_file):
                self.problems.append(f"{model_file} is missing: the checkpoint is incomplete")
            return
        # Sub-groups (DeepSpeed's sub_group_size) split the flat groups at parameter boundaries: walk
        # every parameter of every group over the sub-groups laid end to end.
        sizes = [t.numel() for t in self._load(ranks[0])["optimizer_state_dict"]["fp32_flat_groups"]]
        bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        position = 0
        for shapes in self._load(model_file)["param_shapes"]:
            for name, shape in shapes.items():
                numel = math.prod(shape)
                piece = math.ceil(numel / dp)
                group = next(i for i in range(len(sizes)) if bounds[i] <= position < bounds[i + 1])
                start = position - bounds[group]
                key = spec_key(name)
                self._fragments[key] = [
                    Fragment(ranks[d], group, start, min(piece, numel - d * piece), d * piece)
                    for d in range(dp)
                    if d * piece < numel
                ]
                self._numel[key] = numel
                position += piece
        if position != bounds[-1]:
            self.problems.append(
                f"{self.tag_dir}: the ZeRO-3 partitions hold {bounds[-1]} elements per rank, the parameters "
                f"{position}: a layout this reader does not know"
            )
        for d in range(dp):
            self._note_step(self._load(ranks[d])["optimizer_state_dict"]["optimizer_state_dict"]["state"])

    def _scan_zero0(self, names: list[str]) -> None:
        self.format = "fp32 ZeRO-0"
        stages: dict[tuple[int, int], list[list[str]]] = {}  # (stage, TP rank) -> its optimizer's parameter names
        for n in names:
            m = TRAINER_STATE.match(n)
            if m:
                with open(os.path.join(self.tag_dir, n)) as f:
                    state = json.load(f)
                if "optimizer_param_names" not in state:
                    self.problems.append(
                        f"{self.tag_dir} was saved by a version that did not record its optimizer's parameter "
                        "names: it resumes on its own layout only"
                    )
                    return
                stages.setdefault((state["stage"], int(m.group(1)) % self.tp), state["optimizer_param_names"])
        for (stage, t), groups in sorted(stages.items()):
            path = os.path.join(self.tag_dir, f"mp_rank_{stage * self.tp + t:02d}_model_states.pt")
            if not os.path.isfile(path):
                self.problems.append(f"{path} is missing: the checkpoint is incomplete")
                continue
            optimizer = self._load(path).get("optimizer")
            if not optimizer or "state" not in optimizer:
                self.problems.append(f"{path} holds no optimizer state")
                continue
            self._note_step(optimizer["state"])
            experts = self._expert_pieces(stage, names)  # optimizer position -> the other expert ranks' pieces
            for index, name in enumerate(n for group in groups for n in group):
                key = spec_key(name)
                if (t and key not in self._split_dims) or key in self._zero0 and self._zero0[key][t]:
                    continue  # a replicated parameter's copy on another TP rank; a tied copy
                self._zero0.setdefault(key, [None] * self.tp)[t] = (path, index)
                self._numel[key] = self._numel.get(key, 0) + optimizer["state"][index]["exp_avg"].numel()
                for piece in experts.get(index, []):  # rank 0's experts above, then every other rank's
                    self._zero0[key].append(piece)
                    self._numel[key] += self._load(piece[0])["optimizer"]["state"][index]["exp_avg"].numel()
                    self._split_dims[key] = 0

    def _expert_pieces(self, stage: int, names: list[str]) -> dict[int, list[tuple[str, int]]]:
        """With expert parallelism (parallel/expert_parallel.py): the expert ranks 1.. of ``stage`` saved their
        experts' moments in files of their own; {optimizer position: [(file, position), ...] in rank order}."""
        files = {}
        for n in names:
            m = EXPERT_MOMENTS_FILE.match(n)
            if m and int(m.group(1)) == stage:
                files[int(m.group(2))] = os.path.join(self.tag_dir, n)
        expected = list(range(1, self.expert_parallel))
        if sorted(files) != expected:
            self.problems.append(
                f"{self.tag_dir}: the expert moments of stage {stage}'s expert-parallel ranks {expected} are expected, "
                f"{sorted(files)} found: the checkpoint is incomplete"
            )
            return {}
        pieces: dict[int, list[tuple[str, int]]] = {}
        for rank in expected:
            for index in self._load(files[rank])["optimizer"]["state"]:
                pieces.setdefault(index, []).append((files[rank], index))
        return pieces

    def _scan_portable(self, names: list[str]) -> None:
        self.format = "portable"
        for n in names:
            m = PORTABLE_FILE.match(n)
            if not m:
                continue
            path = os.path.join(self.tag_dir, n)
            with safe_open(path, "pt") as f:
                self.step = float(f.metadata()["step"])
                for k in f.keys():
                    if k.endswith(".exp_avg"):
                        key = (int(m.group(1)), k[: -len(".exp_avg")])
                        self._portable[key] = path
                        self._numel[key] = math.prod(f.get_slice(k).get_shape())

    def missing_layer_files(self, config) -> list[str]:
        """The layer files of ``config``'s specs that are not in the checkpoint."""
        paths = sorted({os.path.join(self.tag_dir, layer_file_name(i.file_index)) for i in spec_layout(config)})
        return [f"{p} is missing: the checkpoint is incomplete" for p in paths if not os.path.isfile(p)]

    def _note_step(self, states: dict) -> None:
        for state in states.values():
            step = float(state["step"])
            if self.step is not None and step != self.step:
                self.problems.append(f"{self.tag_dir}: optimizer states at steps {self.step} and {step}")
            self.step = step

    def release(self) -> None:
        """Unmap every file read so far: the pages of the fragments already copied leave this process's
        memory (reloading a file later reads its small pickle again, not its tensors)."""
        self._files.clear()

    # -- one parameter ---------------------------------------------------------------------------

    def keys(self) -> list[Key]:
        return sorted(self._numel)

    def numel(self, key: Key) -> int | None:
        return self._numel.get(key)

    def get(self, key: Key) -> dict[str, torch.Tensor]:
        """{"exp_avg", "exp_avg_sq", and "fp32" where a master is kept}: flat fp32 tensors of one parameter."""
        if key in self._portable:
            with safe_open(self._portable[key], "pt") as f:
                suffixes = [s for s in ("fp32", *MOMENTS) if f"{key[1]}.{s}" in f.keys()]
                return {s: f.get_tensor(f"{key[1]}.{s}").flatten() for s in suffixes}
        if key in self._zero0:
            # The weights are the masters: the layer file's (fp32, as this layout trains), whole.
            weight = load_layer_file(os.path.join(self.tag_dir, layer_file_name(key[0])))[key[1]]
            pieces = []
            for path, index in filter(None, self._zero0[key]):
                state = self._load(path)["optimizer"]["state"][index]
                pieces.append({s: state[s].flatten().float() for s in MOMENTS})
            return {"fp32": weight.flatten().float(), **self._joined(key, pieces)}
        if key in self._pieces:
            return self._joined(key, [self._assemble(fs) for fs in self._pieces[key] if fs])
        return self._assemble(self._fragments[key])

    def _assemble(self, fragments: list[Fragment]) -> dict[str, torch.Tensor]:
        """One parameter's (or TP piece's) flat states from the fragments that hold it."""
        out = {s: torch.empty(sum(f.numel for f in fragments), dtype=torch.float32) for s in ("fp32", *MOMENTS)}
        for f in fragments:
            flat = self._flat(f.path, f.group)
            for s, t in flat.items():
                out[s][f.offset : f.offset + f.numel].copy_(t[f.start : f.start + f.numel])
        return out

    def _joined(self, key: Key, pieces: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """A split parameter's TP pieces joined along its dim (the layer file gives the whole shape)."""
        if len(pieces) == 1:
            return pieces[0]
        whole = list(load_layer_file(os.path.join(self.tag_dir, layer_file_name(key[0])))[key[1]].shape)
        dim = self._split_dims[key]
        shape = [n // len(pieces) if i == dim else n for i, n in enumerate(whole)]
        return {s: torch.cat([p[s].view(shape) for p in pieces], dim).flatten() for s in pieces[0]}

    def _flat(self, path: str, group: int) -> dict[str, torch.Tensor]:
        state = self._load(path)["optimizer_state_dict"]
        if "fp32_flat_groups" in state:  # ZeRO-3
            moments = state["optimizer_state_dict"]["state"][group]
            return {"fp32": state["fp32_flat_groups"][group], **{s: moments[s] for s in MOMENTS}}
        moments = state["base_optimizer_state"]["state"][group]
        return {"fp32": state["single_partition_of_fp32_groups"][group], **{s: moments[s] for s in MOMENTS}}


# -- the running engine ------------------------------------------------------------------------------


def trainable_parameters(module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every trainable parameter, a tied one once."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def load_problems(saved: SavedOptimizerState, module) -> list[str]:
    """Parameters of this rank the checkpoint holds no state for, or of another size."""
    problems = []
    for name, p in trainable_parameters(module):
        key = spec_key(name)
        whole = full_numel(p) * (split_of(p)[2] if split_of(p) else 1)  # a TP piece or an expert slice: the whole's
        if saved.numel(key) is None:
            problems.append(f"{saved.tag_dir} holds no optimizer state for {name} (layer file {key[0]}, {key[1]})")
        elif saved.numel(key) != whole:
            problems.append(
                f"{saved.tag_dir}: the optimizer state of {name} has {saved.numel(key)} elements, the model {whole}"
            )
    return problems


def this_piece(p: torch.nn.Parameter, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A whole parameter's flat states cut to the piece a tensor-parallel rank holds (``p.tp_split``), or an
    expert-parallel rank's experts (``p.ep_split``)."""
    if split_of(p) is None:
        return values
    dim, _, world = split_of(p)
    whole = [n * world if i == dim else n for i, n in enumerate(p.shape)]
    return {s: tp_piece(v.view(whole), p).contiguous().flatten() for s, v in values.items()}


@torch.no_grad()
def load_into_engine(engine, saved: SavedOptimizerState) -> None:
    """Set every trainable parameter's fp32 master (where the optimizer keeps one) and Adam moments from
    ``saved``, and the step count of every optimizer state. Local: no collective (each rank sets the
    fragments it holds). The weights themselves come from the layer files, loaded before."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.utils.tensor_fragment import safe_set_full_fp32_param, safe_set_full_optimizer_state

    optimizer, base = engine.optimizer, engine.basic_optimizer
    step = saved.step or 0.0

    def new_state(flat: torch.Tensor) -> dict:
        # DeepSpeed's Adams count steps in a Python int, as they make it themselves; torch's in a tensor
        count = (
            int(step) if isinstance(base, (DeepSpeedCPUAdam, FusedAdam)) else torch.tensor(step, dtype=torch.float32)
        )
        return {"step": count, **{s: torch.zeros_like(flat) for s in MOMENTS}}

    if isinstance(optimizer, (DeepSpeedZeroOptimizer, BF16_Optimizer)):
        flats = (
            optimizer.single_partition_of_fp32_groups
            if isinstance(optimizer, DeepSpeedZeroOptimizer)
            else optimizer.fp32_groups_flat_partition
        )
        for flat in flats:  # Adam creates its states at the first step: made here, then linked to the fragments
            optimizer.optimizer.state[flat] = new_state(flat)
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()
    elif isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        for flat in optimizer.fp32_partitioned_groups_flat:
            state = optimizer.optimizer.state.setdefault(flat, {})
            state.update({k: v for k, v in new_state(flat).items() if k == "step" or k not in state})
    last_file = None
    for name, p in trainable_parameters(engine.module):
        if spec_key(name)[0] != last_file:  # one layer file's parameters mapped at a time
            saved.release()
            last_file = spec_key(name)[0]
        values = this_piece(p, saved.get(spec_key(name)))
        if hasattr(p, "ds_id"):  # ZeRO-3: this rank's piece of each, padding left as it is
            rank = optimizer._get_param_partition_rank(p)
            for s, value in values.items():
                part, _ = optimizer._get_fp32_opt_state_partition(p, False, None if s == "fp32" else s)
                piece = value[rank * part.numel() : (rank + 1) * part.numel()]
                part[: piece.numel()].copy_(piece)
                if s == "fp32":  # the weights' own piece, as the master rounds to them
                    p.ds_tensor.data[: piece.numel()].copy_(piece)
            continue
        if "fp32" in values:  # the weights as the master rounds to them (a layer file of a bf16 run is bf16)
            p.data.copy_(values["fp32"].view(p.shape))
        if hasattr(p, "_hp_mapping"):
            if "fp32" in values:
                safe_set_full_fp32_param(p, values["fp32"].view(p.shape))
            for s in MOMENTS:
                safe_set_full_optimizer_state(p, values[s].view(p.shape), s)
        else:  # torch AdamW on the weights themselves (ZeRO-0, fp32)
            base.state[p] = {**new_state(p.data), **{s: values[s].view(p.shape).clone() for s in MOMENTS}}


# -- the portable form -------------------------------------------------------------------------------


def write_portable(saved: SavedOptimizerState, out_dir: str, log=print) -> int:
    """One ``optimizer_XX.safetensors`` per layer file into ``out_dir``, one layer file's parameters in
    memory at a time; returns the bytes written."""
    from safetensors.torch import save_file

    by_file: dict[int, list[str]] = {}
    for file_index, name in saved.keys():
        by_file.setdefault(file_index, []).append(name)
    total, start = 0, time.time()
    for n, (file_index, names) in enumerate(sorted(by_file.items()), 1):
        tensors = {f"{name}.{s}": t.contiguous() for name in names for s, t in saved.get((file_index, name)).items()}
        save_file(
            tensors,
            os.path.join(out_dir, portable_file_name(file_index)),
            metadata={"step": repr(saved.step or 0.0), "source": saved.format},
        )
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        log(
            f"{n}/{len(by_file)} {portable_file_name(file_index)} ({len(names)} parameters, {time.time() - start:.1f}s)"
        )
        del tensors
        saved.release()
    return total


def reshard(input_dir: str, output: str, tag: str | None = None, overwrite: bool = False) -> None:
    """``convert2ckpt.py --reshard``: a checkpoint saved on any layout -> a run directory whose ``latest``
    tag holds the layer files and the portable optimizer states: resumable on any layout (as output_dir,
    resume=auto), readable without DeepSpeed. Written to a temporary directory, renamed when complete."""
    check_output(input_dir, output, overwrite)
    tag = read_tag(input_dir, tag)
    tag_dir = os.path.join(input_dir, tag)
    saved = SavedOptimizerState(tag_dir)
    trainer_state = os.path.join(tag_dir, "trainer_state_rank00000.json")
    problems = list(saved.problems)
    if not os.path.isfile(trainer_state):
        problems.append(f"{trainer_state} is missing: not a checkpoint saved by train.py")
    if problems:
        raise CheckpointError(f"cannot reshard {tag_dir}:\n  " + "\n  ".join(problems))
    start = time.time()
    with atomic_output(input_dir, output, overwrite, "reshard") as tmp:
        out_tag = os.path.join(tmp, tag)
        os.makedirs(out_tag)
        for name in sorted(os.listdir(tag_dir)):
            if name.startswith("layer_") or name == "train_config.yaml":
                shutil.copy2(os.path.join(tag_dir, name), os.path.join(out_tag, name))
        with open(trainer_state) as f:
            state = json.load(f)
        state.update(portable=True, source_format=saved.format)
        if state.get("peft_base"):  # a LoRA run: the base's hashes of every stage, as its ranks recorded them
            state["peft_base"] = saved_base_record(tag_dir)
        with open(os.path.join(out_tag, "trainer_state_rank00000.json"), "w") as f:
            json.dump(state, f)
        nbytes = write_portable(saved, out_tag, log=lambda m: log(f"[reshard] {m}"))
        for name in ("config.json", "train_config.yaml", "metrics.jsonl", *SIDE_FILES):
            if os.path.isfile(os.path.join(input_dir, name)):
                shutil.copy2(os.path.join(input_dir, name), os.path.join(tmp, name))
        with open(os.path.join(tmp, "latest"), "w") as f:
            f.write(tag)
    log(
        f"[reshard] wrote {output}: {tag} from {saved.format} states, {len(saved.keys())} parameters, "
        f"{nbytes / 2**20:.1f} MiB of optimizer state in {time.time() - start:.1f}s"
    )
