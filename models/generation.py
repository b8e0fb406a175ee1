"""Generation stage by stage over the pipeline's own modules, each stage keeping the KV cache of its decoder layers.

A stage is a contiguous slice of the spec list (models/llama_pipe.py's ``build_specs``): maybe the embedding, some
decoder layers, maybe the final norm and the LM head. :class:`StageGenerator` runs one stage's share of a prefill and
of each one-token decode step, calling the Hugging Face decoder layers as ``<Family>Model.forward`` does for
generation: the stage's own ``DynamicCache`` (built from the config, so a sliding or chunked layer keeps only its
window), one mask per attention type from transformers' mask functions sized against the stage's first layer of that
type, rotary embeddings from ``position_ids``. No stage holds another's weights or cache.

:func:`generate` chains the stages in one process and picks the tokens as Hugging Face's ``generate`` does for a
decoder-only model: left padding with a 2D attention mask (dropped when no row is padded), positions counted from the
mask, greedy argmax or sampling after transformers' own temperature, top-k and top-p processors in its order, finished
rows fed the padding token until every row is done. The rows may run in ``micro_batches`` chunks (row slices of the
padded batch, each with its own KV cache on each stage), step by step in chunk order; a chunk whose rows have all
finished is left out. Sampling makes ``torch.multinomial``'s draw for the whole batch: one ``exponential_`` fill
[B,V] from the generator per step (drawn at the step's first chunk), each row's token the argmax of its
probabilities over its noise; that is how ``multinomial`` draws one sample, so the tokens are ``generate``'s and do
not depend on the chunking. A multi-rank version replaces this driver only. Per decode step, what crosses:

    stage k -> stage k+1   hidden [B,1,H] (the prefill: [B,S,H], S the padded prompt length; after the final norm,
                           whichever stage holds it: [B,1,H], only the last position)
    last -> first stage    next tokens [B] int64 (and whether every row has finished)
    every stage            attention_mask [B,S+t] (None without padding) and position_ids [B,1] int64, which each
                           rank can derive from the prompt lengths and the step count alone

A stage split by tensor parallelism (parallel/tensor_parallel.py; :class:`StageGenerator` given its group) runs
its pieces as training does: every rank of the group takes the same inputs, the split layers all-reduce inside their
forward, each rank caches its own KV heads (kv_heads / tp), the embedding sums the ranks' vocabulary slices, and the
head's slices of the logits are gathered over the group in vocab order, so every rank has the whole [B,V].
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from models.attention import DOCUMENT_ATTENTION
from models.families import attention_type, family_of
from models.files.pipeline_dir import split_of
from models.llama_pipe import (
    MASK_FUNCTIONS,
    DecoderLayerPipe,
    EmbeddingPipe,
    LMHeadPipe,
    NormPipe,
    tied_lm_head_chunked_forward,
    tied_lm_head_forward,
)
from models.loss import soft_capped

_TIED_HEADS = (tied_lm_head_forward, tied_lm_head_chunked_forward)
_ORDER = {"embed": 0, "decoder": 1, "norm": 2, "head": 3}


def spec_kind(func: nn.Module | partial) -> str | None:
    """``embed``, ``decoder``, ``norm`` or ``head`` for a built spec (a tied head is a partial over the embedding),
    None for anything else."""
    if isinstance(func, partial) and func.func in _TIED_HEADS and isinstance(func.args[0], EmbeddingPipe):
        return "head"
    for kind, cls in (("embed", EmbeddingPipe), ("decoder", DecoderLayerPipe), ("norm", NormPipe)):
        if isinstance(func, cls):
            return kind
    return "head" if isinstance(func, LMHeadPipe) else None


class StageGenerator:
    """One stage's share of generation: its modules (a contiguous slice of the spec list) and the KV cache of its
    decoder layers only (:meth:`reset` starts a new one).

    :meth:`step` takes token ids [B,T] int64 on the stage with the embedding, else the previous stage's hidden
    states, with the 2D ``attention_mask`` [B,past+T] (None: no padding) and ``position_ids`` [B,T]; T is the padded
    prompt length in the prefill, 1 in a decode step. It returns hidden [B,T,H], or from the final norm on only the
    last position: hidden [B,1,H], or the next-token logits [B,V] fp32 on the stage with the LM head. The modules run
    in the mode they are in (as Hugging Face's ``generate`` leaves the model's); the caller picks eval or train.
    """

    def __init__(self, modules: Sequence[nn.Module | partial], tp_group=None):
        problems = stage_problems(modules, tensor_parallel=tp_group is not None)
        if problems:
            raise ValueError("\n".join(problems))
        kinds = [spec_kind(m) for m in modules]
        self.embedding = modules[0] if kinds[0] == "embed" else None
        self.layers = [m for m, k in zip(modules, kinds) if k == "decoder"]
        self.norm = next((m for m, k in zip(modules, kinds) if k == "norm"), None)
        self.head = next((m for m, k in zip(modules, kinds) if k == "head"), None)
        self.tp_group = tp_group  # the stage's tensor-parallel group (None: whole modules)
        self.config = self.layers[0].self_attn.config if self.layers else None
        # The mask of each attention type is sized against the stage's first layer of that type, as the model's
        # forward sizes it against the model's first (every layer of a type has seen the same tokens).
        self.mask_layers: dict[str, int] = {}
        for layer in self.layers:
            self.mask_layers.setdefault(
                attention_type(self.config, layer.self_attn.layer_idx), layer.self_attn.layer_idx
            )
        self.caches: list[DynamicCache | None] = []
        self.cache: DynamicCache | None = None
        self.reset()

    @property
    def device(self) -> torch.device:
        """Where this stage's weights are (and its inputs go)."""
        first = next((m for m in (self.embedding, *self.layers, self.norm) if m is not None), None)
        return next(first.parameters()).device if first is not None else _head_weight(self.head).device

    def reset(self, chunks: int = 1) -> None:
        """Forget the cached keys and values: one new cache per chunk of rows, the first selected, the next step of
        each a prefill. A cache has an entry per decoder layer of the model (transformers indexes it by layer), those
        of other stages empty: no memory."""
        self.caches = [DynamicCache(config=self.config) if self.layers else None for _ in range(chunks)]
        self.cache = self.caches[0]

    def select(self, chunk: int) -> None:
        """The next :meth:`step` runs chunk ``chunk``'s rows, against its cache."""
        self.cache = self.caches[chunk]

    def step(
        self, inputs: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor
    ) -> torch.Tensor:
        hidden = self._embed(inputs) if self.embedding is not None else inputs  # [B,T,H]
        if self.layers:
            with _dense_attention(self.config):
                hidden = self._layers(hidden, attention_mask, position_ids)
        if self.norm is not None or self.head is not None:
            hidden = hidden[:, -1:]  # [B,1,H]: only the last position's logits are needed
        if self.norm is not None:
            hidden = super(NormPipe, self.norm).forward(hidden)  # the family's RMSNorm
        if self.head is None:
            return hidden
        logits = F.linear(hidden[:, -1], _head_weight(self.head)).float()  # [B,V] fp32, as generate casts them
        logits = soft_capped(logits, _head_softcap(self.head))  # Gemma's cap; elementwise, so per vocabulary slice
        return self._whole_vocabulary(logits)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[B,T,H] of the token ids; split by vocabulary, each rank looks up the ids of its slice (the others
        zero) and the group sums them, as parallel/tensor_parallel.py's VocabEmbedding does in training."""
        weight = self.embedding.weight
        if self.tp_group is None:
            return self.embedding.scale(nn.Embedding.forward(self.embedding, ids))  # Gemma's scaled
        start = weight.tp_split[1] * weight.shape[0]
        outside = (ids < start) | (ids >= start + weight.shape[0])  # [B,T] bool
        hidden = F.embedding((ids - start).masked_fill(outside, 0), weight).masked_fill(outside[..., None], 0.0)
        dist.all_reduce(hidden, group=self.tp_group)
        return self.embedding.scale(hidden)

    def _whole_vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        """[B,V]: a head split by vocabulary gives each rank its slice [B,V/tp], gathered over the group in vocab
        order (slice r on rank r), so that every rank picks the same tokens from the whole logits."""
        if self.tp_group is None:
            return logits
        slices = [torch.empty_like(logits) for _ in range(dist.get_world_size(self.tp_group))]
        dist.all_gather(slices, logits.contiguous(), group=self.tp_group)
        return torch.cat(slices, dim=-1)

    def _layers(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor):
        masks = {  # built before any layer adds this step's keys, as the model's forward builds them
            kind: MASK_FUNCTIONS[kind](
                config=self.config,
                inputs_embeds=hidden,
                attention_mask=attention_mask,
                past_key_values=self.cache,
                position_ids=position_ids,
                layer_idx=layer_idx,
            )
            for kind, layer_idx in self.mask_layers.items()
        }
        cos_sin = {}  # the same for every layer, as the model's (Gemma's: per attention type)
        for layer in self.layers:
            if layer.rotary_args not in cos_sin:
                cos_sin[layer.rotary_args] = layer.rotary_emb(hidden, position_ids, *layer.rotary_args)
            hidden = super(DecoderLayerPipe, layer).forward(  # the family's Hugging Face decoder layer
                hidden,
                attention_mask=masks[attention_type(self.config, layer.self_attn.layer_idx)],
                position_ids=position_ids,
                past_key_values=self.cache,
                use_cache=True,
                position_embeddings=cos_sin[layer.rotary_args],
            )
            layer._router_output = None  # the router loss's hook keeps it: nothing to train on here
        return hidden


def stage_problems(modules: Sequence[nn.Module | partial], tensor_parallel: bool = False) -> list[str]:
    """Why ``modules`` are not one stage's contiguous slice of the spec list, one line each (empty: they are).
    ``tensor_parallel``: pieces of parallel/tensor_parallel.py's split (``tp_split``, the vocabulary-parallel
    embedding's hooks) are fine, which :class:`StageGenerator` given the group runs as training does."""
    if not modules:
        return ["a generation stage needs at least one module of the spec list"]
    kinds = [spec_kind(m) for m in modules]
    problems = [
        f"stage module {i} ({type(m).__name__}) is not a spec of models/llama_pipe.py's build_specs "
        "(embedding, decoder layer, norm, LM head)"
        for i, (m, k) in enumerate(zip(modules, kinds))
        if k is None
    ]
    known = [(i, k) for i, k in enumerate(kinds) if k is not None]
    for (_, a), (j, b) in zip(known, known[1:]):
        if _ORDER[b] < _ORDER[a] or (b == a and a != "decoder"):
            problems.append(f"stage module {j} ({b}) follows a {a}: the modules are not in the spec list's order")
    for i, (m, k) in enumerate(zip(modules, kinds)):
        module = m.args[0] if isinstance(m, partial) else m
        pieces = any(_foreign_piece(p, tensor_parallel) for p in module.parameters())
        hooks = [h for h in module._forward_pre_hooks.values() if not (tensor_parallel and _vocab_split_hook(h))]
        if k is not None and (hooks or pieces):
            problems.append(
                f"stage module {i} ({type(module).__name__}) is split by tensor, expert or sequence parallelism or "
                "ZeRO-3: generation runs whole modules only"
            )
    layers = [m.self_attn.layer_idx for m, k in zip(modules, kinds) if k == "decoder"]
    if layers and layers != list(range(layers[0], layers[0] + len(layers))):
        problems.append(f"the decoder layers {layers} are not consecutive")
    return problems


def _foreign_piece(p: torch.Tensor, tensor_parallel: bool) -> bool:
    """A parameter this rank holds a piece of that generation cannot run (``tensor_parallel``: a tensor-parallel
    piece can): an expert-parallel or tensor-parallel split, a ZeRO-3 partition."""
    if tensor_parallel and hasattr(p, "tp_split"):
        return False
    return split_of(p) is not None or hasattr(p, "ds_id")


def _vocab_split_hook(hook) -> bool:
    """The vocabulary-parallel embedding's pre-hook (parallel/tensor_parallel.py's VocabEmbedding; told by name, as
    models/ does not import parallel/): :class:`StageGenerator` looks up the ids of the slice itself."""
    return getattr(hook, "__qualname__", "").startswith("VocabEmbedding.split.")


def _head_softcap(head: nn.Module | partial) -> float | None:
    """The cap on the LM head's logits (Gemma's final_logit_softcapping; None: none): its own, or the tied
    embedding's."""
    return getattr(head.args[0] if isinstance(head, partial) else head, "logit_softcap", None)


def _head_weight(head: nn.Module | partial) -> torch.Tensor:
    """The LM head's [V,H] weight: its own, or the embedding's when tied (built chunked or not)."""
    return head.args[0].weight if isinstance(head, partial) else head.weight


@contextmanager
def _dense_attention(config):
    """The stage's layers attend with transformers' ``sdpa`` (the family's ``dense_attention``) and its masks for the
    step, if they were built with the per-document attention, which takes no mask, while a KV cache with left padding
    needs one; their config is shared, so it is put back after."""
    before = config._attn_implementation
    if before == DOCUMENT_ATTENTION:  # the family's dense attention where sdpa drops a part (gpt-oss: eager, sinks)
        config._attn_implementation = family_of(config).dense_attention
    try:
        yield
    finally:
        config._attn_implementation = before


@dataclass(frozen=True)
class Completion:
    """One row's generated ids (its EOS included if produced, nothing after it) and whether max_new_tokens cut it."""

    ids: list[int]
    truncated: bool


def sampling_processors(temperature: float, top_k: int, top_p: float) -> LogitsProcessorList:
    """transformers' own logits processors of sampling, in the order ``generate`` applies them (temperature, top-k,
    top-p), each only where ``generate`` adds it."""
    processors = LogitsProcessorList()
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k != 0:
        processors.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return processors


def generation_problems(
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    micro_batches: int = 1,
) -> list[str]:
    """Every argument :func:`generate` cannot take, one line each with the value to change."""
    problems = []
    if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
        problems.append("generate: every prompt needs at least one token (an empty prompt or no prompts given)")
    if max_new_tokens < 1:
        problems.append(f"generate: max_new_tokens is {max_new_tokens}; set it to 1 or more")
    if not temperature > 0:
        problems.append(f"generate: temperature is {temperature}; set it above 0 (or do_sample=False for greedy)")
    if not 0 < top_p <= 1:
        problems.append(f"generate: top_p is {top_p}; set it in (0, 1] (1: off)")
    if top_k < 0:
        problems.append(f"generate: top_k is {top_k}; set it to 0 (off) or more")
    if micro_batches < 1:
        problems.append(f"generate: micro_batches is {micro_batches}; set it to 1 or more")
    return problems


def chain_problems(units: list[StageGenerator]) -> list[str]:
    """Why the stages do not make the whole spec list in order (embedding first, every decoder layer once, the
    head last), one line each."""
    problems = []
    if units[0].embedding is None:
        problems.append("generate: the first stage must start with the embedding (spec 0)")
    if units[-1].head is None:
        problems.append("generate: the last stage must end with the LM head (the last spec)")
    for i, unit in enumerate(units):
        if i > 0 and unit.embedding is not None:
            problems.append(f"generate: stage {i} holds the embedding, which only the first stage may")
        if i < len(units) - 1 and unit.head is not None:
            problems.append(f"generate: stage {i} holds the LM head, which only the last stage may")
    layers = [layer.self_attn.layer_idx for unit in units for layer in unit.layers]
    config = next((unit.config for unit in units if unit.config is not None), None)
    expected = list(range(config.num_hidden_layers)) if config is not None else []
    if layers != expected:
        problems.append(f"generate: the stages hold the decoder layers {layers}, not each of {expected} once in order")
    return problems


def left_padded(prompt_ids: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B,S], attention_mask [B,S]) int64, the prompts right-aligned as a decoder-only model's batch."""
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for row, prompt in enumerate(prompt_ids):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B,S] positions counting each row's real tokens from 0, padding at 0: ``generate``'s rule."""
    return (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)


def next_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """[B,1]: each row's position after the last of ``position_ids`` [B,T], as ``generate`` advances them."""
    return position_ids[:, -1:] + 1


def run_stages(
    units: list[StageGenerator], inputs: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor
) -> torch.Tensor:
    """One prefill or decode step through every stage in turn: token ids in, next-token logits [B,V] fp32 out (what
    a multi-rank version sends and receives instead)."""
    x = inputs
    for unit in units:
        device = unit.device
        mask = attention_mask.to(device) if attention_mask is not None else None
        x = unit.step(x.to(device), mask, position_ids.to(device))
    return x


@torch.no_grad()
def generate(
    stages: list[Sequence[nn.Module | partial]],
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    eos_token_id: int | list[int],
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    pad_token_id: int | None = None,
    micro_batches: int = 1,
) -> list[Completion]:
    """Completions of ``prompt_ids`` through ``stages`` (each a list of one stage's modules, together the whole spec
    list in order), as ``<Family>ForCausalLM.generate`` makes them with the same arguments (module docstring).

    ``do_sample``: draw from the probabilities after ``temperature``, ``top_k`` (0: off) and ``top_p`` (1: off) with
    ``generator`` (None: torch's global generator, as ``generate`` draws), else greedy. ``eos_token_id``: one id or
    several; ``pad_token_id``: what left-pads the prompts and feeds finished rows (None: the first EOS id, as
    ``generate`` falls back to). ``micro_batches``: how many chunks the rows run in (capped at the batch size); the
    completions are the same for any.
    """
    problems = generation_problems(prompt_ids, max_new_tokens, temperature, top_p, top_k, micro_batches)
    stage_lines = [
        f"generate: stage {i}: {line}" for i, modules in enumerate(stages) for line in stage_problems(modules)
    ]
    units = [StageGenerator(modules) for modules in stages] if stages and not stage_lines else []
    problems += stage_lines or (chain_problems(units) if units else ["generate: no stages given"])
    if problems:
        raise ValueError("\n".join(problems))
    batch = Batch(prompt_ids, eos_token_id, pad_token_id, micro_batches)
    picker = TokenPicker(sampling_processors(temperature, top_k, top_p) if do_sample else None, generator, batch)
    for unit in units:
        unit.reset(len(batch.chunks))
    for _ in range(max_new_tokens):
        live = [j for j, chunk in enumerate(batch.chunks) if not chunk.done(max_new_tokens)]
        if not live:
            break
        for j in live:
            chunk = batch.chunks[j]
            for unit in units:
                unit.select(j)
            logits = run_stages(units, chunk.inputs, chunk.mask, chunk.positions)  # [b,V] fp32, the last device's
            chunk.take(picker(logits, chunk).cpu())
    for unit in units:
        unit.reset()  # the caches are freed with the generation
    return batch.completions()


class Chunk:
    """One micro-batch: the rows ``rows`` of the left-padded batch, the inputs, mask (None: no padding anywhere in the
    batch) and positions of its next step, the tokens picked so far [b] each and which rows have finished."""

    def __init__(self, rows: range, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor, batch):
        self.rows, self.batch = rows, batch
        self.prompt = ids[rows.start : rows.stop]  # [b,S]
        self.inputs = self.prompt
        self.mask = mask[rows.start : rows.stop] if mask is not None else None
        self.positions = positions[rows.start : rows.stop]
        self.tokens: list[torch.Tensor] = []
        self.finished = torch.zeros(len(rows), dtype=torch.bool)

    @property
    def step(self) -> int:
        """How many tokens each row has: the step that runs next."""
        return len(self.tokens)

    def done(self, max_new_tokens: int) -> bool:
        return self.step == max_new_tokens or bool(self.finished.all())

    def take(self, chosen: torch.Tensor) -> None:
        """Keep the step's tokens [b] (a finished row's become the padding token) and make the next step's inputs."""
        chosen = torch.where(self.finished, torch.tensor(self.batch.pad), chosen)
        self.tokens.append(chosen)
        self.finished |= torch.isin(chosen, self.batch.eos)
        self.inputs = chosen[:, None]  # [b,1]: one token per row, the cache holds the rest
        self.positions = next_positions(self.positions)  # [b,1]
        if self.mask is not None:
            self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)


class Batch:
    """The prompts left-padded as ``generate`` pads them (positions from the mask, the mask dropped without padding),
    cut into ``micro_batches`` chunks of consecutive rows (capped at the batch size, sizes differing by one at
    most)."""

    def __init__(self, prompt_ids: list[list[int]], eos_token_id, pad_token_id: int | None, micro_batches: int):
        self.eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
        self.pad = int(self.eos[0]) if pad_token_id is None else pad_token_id
        ids, mask = left_padded(prompt_ids, self.pad)
        positions = positions_from_mask(mask)
        mask = None if bool(mask.all()) else mask  # generate drops a mask without padding
        self.size, self.width = ids.shape
        count = min(micro_batches, self.size)
        bounds = [self.size * i // count for i in range(count + 1)]
        self.chunks = [Chunk(range(a, b), ids, mask, positions, self) for a, b in zip(bounds, bounds[1:])]

    def completions(self) -> list[Completion]:
        return [c for chunk in self.chunks for c in completions(torch.stack(chunk.tokens, dim=1), self.eos)]


class TokenPicker:
    """Each chunk's next tokens [b] from its logits [b,V]: the argmax (``processors`` None), else the draw of
    ``torch.multinomial(probs, 1, generator)`` over the whole batch, made per chunk: one ``exponential_`` fill
    [B,V] per step (at the step's first chunk: the chunks must come step by step), each row the argmax of its
    probabilities over its noise, as ``multinomial`` draws one sample."""

    def __init__(self, processors: LogitsProcessorList | None, generator: torch.Generator | None, batch: Batch):
        self.processors, self.generator, self.batch = processors, generator, batch
        self.noise: torch.Tensor | None = None
        self.noise_step = -1

    def __call__(self, logits: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        if self.processors is None:
            return logits.argmax(dim=-1)
        if chunk.step != self.noise_step:
            self.noise = step_noise((self.batch.size, logits.shape[-1]), logits.device, self.generator)
            self.noise_step = chunk.step
        so_far = torch.cat([chunk.prompt, *(t[:, None] for t in chunk.tokens)], dim=1).to(logits.device)  # [b,S+t]
        probs = torch.softmax(self.processors(so_far, logits), dim=-1)
        return (probs / self.noise[chunk.rows.start : chunk.rows.stop]).argmax(dim=-1)


def step_noise(shape: tuple[int, int], device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """The Exp(1) noise [B,V] fp32 that ``torch.multinomial`` draws for one sample per row of [B,V] probabilities."""
    if generator is not None and generator.device != device:
        raise ValueError(
            f"generate: the generator is on {generator.device}, the logits on {device}: "
            "make the generator on the last stage's device"
        )
    return torch.empty(shape, dtype=torch.float32, device=device).exponential_(1, generator=generator)


def completions(tokens: torch.Tensor, eos: torch.Tensor) -> list[Completion]:
    """Each row of ``tokens`` [B,N] cut after its first EOS; truncated where it has none."""
    out = []
    for row in tokens.tolist():
        ends = [i for i, t in enumerate(row) if t in eos.tolist()]
        out.append(Completion(row[: ends[0] + 1], False) if ends else Completion(row, True))
    return out
