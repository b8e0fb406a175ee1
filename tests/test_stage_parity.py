"""Stage modules chained in one process compute what LlamaForCausalLM computes (fp32); the other
families run the same checks in tests/test_families.py.

No engine: the specs are built and chained like PipelineModule.forward, with the weights copied
through the same prefix mapping the converter uses.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaForCausalLM

from models.attention import DOCUMENT_ATTENTION
from models.families import family_of
from models.llama_pipe import build_sequential, model_parameters, spec_layout, spec_parameter_counts
from models.loss import IGNORE_INDEX, causal_lm_loss
from models.tiny import tiny_config
from parallel.partition import DEFAULT_PARTITION_METHOD, stage_boundaries

TOL = 1e-5  # max abs difference allowed on logits, loss and every gradient

CONFIGS = {
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1),
    "tied": dict(tie_word_embeddings=True),
    "rope_llama3": dict(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    ),
    "rope_linear": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "rope_dynamic": dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=32),
    "odd_layers": dict(num_hidden_layers=5),
}


def module_of(func):
    """The nn.Module behind a built spec (a tied head is a partial over the embedding)."""
    return func if isinstance(func, torch.nn.Module) else func.args[0]


def assert_layer_grads_equal(funcs, hf, tol: float = TOL) -> list[tuple[str, float]]:
    """Every decoder layer's gradients of the chained ``funcs`` equal ``hf``'s (``model.layers.<i>.<key>``) within
    ``tol``; returns each (key, largest absolute difference)."""
    seen = []
    for i, f in enumerate(funcs[1:-2]):
        for key, p in module_of(f).named_parameters():
            ref_grad = hf.get_parameter(f"model.layers.{i}.{key}").grad
            torch.testing.assert_close(p.grad, ref_grad, rtol=0, atol=tol, msg=f"layer {i} {key}")
            seen.append((key, (p.grad - ref_grad).abs().max().item()))
    return seen


def copy_hf_weights(funcs, config, hf_state):
    for info in spec_layout(config):
        if info.owns_file:
            module = module_of(funcs[info.index])
            module.load_state_dict({k: hf_state[info.hf_prefix + k] for k in module.state_dict()}, strict=True)


def run_chain(funcs, input_ids, position_ids):
    x = (input_ids, position_ids)
    for f in funcs:
        x = f(x)
    return x


def assert_matches_hf(
    config, input_ids, position_ids, labels, attention: str = DOCUMENT_ATTENTION, hf=None, learns: tuple = ()
) -> float:
    """Stages chained in one process (``attention``: the attention function's registered name) vs the family's own
    ``<Family>ForCausalLM`` (``hf``, else a random one) with the same weights: logits, loss and every gradient within
    TOL; the parameters whose names hold one of ``learns`` get a gradient. Returns the largest difference seen."""
    hf = hf or family_of(config).causal_lm._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    funcs = build_sequential(config, attention=attention)
    copy_hf_weights(funcs, config, hf.state_dict())
    # use_cache=False: with a KV cache, the model ignores packed position_ids and attends across documents.
    ref = hf(input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False)
    logits = run_chain(funcs, input_ids, position_ids)
    loss = causal_lm_loss(logits, labels)
    assert logits.shape == ref.logits.shape
    torch.testing.assert_close(logits, ref.logits, rtol=0, atol=TOL)
    assert abs(loss.item() - ref.loss.item()) < TOL
    worst = max((logits - ref.logits).abs().max().item(), abs(loss.item() - ref.loss.item()))

    ref.loss.backward()
    loss.backward()
    checked = 0
    for info in spec_layout(config):
        if not info.owns_file:
            continue
        for key, param in module_of(funcs[info.index]).named_parameters():
            ref_grad = hf.get_parameter(info.hf_prefix + key).grad
            torch.testing.assert_close(param.grad, ref_grad, rtol=0, atol=TOL, msg=info.hf_prefix + key)
            worst = max(worst, (param.grad - ref_grad).abs().max().item())
            checked += 1
            if any(part in key for part in learns):
                assert param.grad.abs().max() > 0, info.hf_prefix + key
    assert checked == len(list(hf.parameters()))  # every HF parameter has a stage twin (tied counted once)
    return worst


@torch.no_grad()
def assert_packed_equals_alone(funcs, vocab_size: int, lengths=(13, 20, 7)) -> None:
    """Per-token logits of one packed row of documents of ``lengths`` equal those of each document run alone."""
    docs = [torch.randint(3, vocab_size, (n,)) for n in lengths]
    packed = run_chain(funcs, torch.cat(docs)[None], torch.cat([torch.arange(len(d)) for d in docs])[None])[0]
    offset = 0
    for d in docs:
        alone = run_chain(funcs, d[None], torch.arange(len(d))[None])[0]  # [len, V]
        torch.testing.assert_close(packed[offset : offset + len(d)], alone, rtol=0, atol=TOL)
        offset += len(d)


def parity_batch(vocab_size: int, batch: int = 3, seq: int = 40, packed: bool = True):
    """(input_ids, position_ids, labels) [B,S] each: padding and a masked prompt in the labels, and with
    ``packed`` a second document starting mid-row 1."""
    input_ids = torch.randint(0, vocab_size, (batch, seq))
    labels = input_ids.clone()
    labels[0, 30:] = IGNORE_INDEX  # padding: ignored by both losses
    labels[2, :5] = IGNORE_INDEX  # a masked prompt
    position_ids = torch.arange(seq).repeat(batch, 1)  # [B,S]
    if packed:
        position_ids[1, 25:] = torch.arange(seq - 25)  # restart mid-row (a packed second document)
    return input_ids, position_ids, labels


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_chained_stages_match_hf(name):
    torch.manual_seed(0)
    config = tiny_config(vocab_size=300, hidden_size=64, intermediate_size=96, **CONFIGS[name])
    assert_matches_hf(config, *parity_batch(config.vocab_size))  # seq 40 > 32: the dynamic rope really rescales


def test_loss_ignores_masked_labels_and_averages_the_rest():
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[1, 2, 3, IGNORE_INDEX, IGNORE_INDEX], [4, 5, 6, 0, 1]])
    manual = torch.nn.functional.cross_entropy(
        torch.cat([logits[0, :2], logits[1, :4]]), torch.tensor([2, 3, 5, 6, 0, 1]), reduction="mean"
    )
    torch.testing.assert_close(causal_lm_loss(logits, labels), manual, rtol=1e-5, atol=1e-8)


def test_spec_layout_prefixes_and_files():
    untied = spec_layout(tiny_config(num_hidden_layers=3))
    assert [i.kind for i in untied] == ["embed", "decoder", "decoder", "decoder", "norm", "head"]
    assert [i.hf_prefix for i in untied] == [
        "model.embed_tokens.",
        "model.layers.0.",
        "model.layers.1.",
        "model.layers.2.",
        "model.norm.",
        "lm_head.",
    ]
    assert all(i.owns_file for i in untied)
    tied = spec_layout(tiny_config(num_hidden_layers=3, tie_word_embeddings=True))
    assert tied[-1].file_index == 0 and not tied[-1].owns_file  # the head reads the embedding's file


def test_stage_boundaries_by_compute_and_by_parameters():
    # The benchmark's shape (benchmarks/bench_train.py): 8 layers, vocabulary 8192, hidden 512. By
    # parameters the 4.2 M-parameter embedding counts as much as a layer's matmuls; by compute it
    # weighs nothing, so the first stage takes one more layer.
    config = tiny_config(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
    )
    assert stage_boundaries(config, 2, "parameters") == [0, 5, 11]  # embed + 4 layers | 4 layers + norm + head
    assert stage_boundaries(config, 2, "compute") == [0, 6, 11]  # embed + 5 layers | 3 layers + norm + head
    assert stage_boundaries(config, 2) == stage_boundaries(config, 2, DEFAULT_PARTITION_METHOD)
    assert stage_boundaries(config, 1) == [0, 11]
    assert stage_boundaries(config, 2, "uniform") == [0, 6, 11]
    assert stage_boundaries(config, 4, "type:DecoderLayerPipe") == [0, 3, 5, 7, 11]  # 2 decoder layers each
    with pytest.raises(ValueError, match="not 'profile'"):
        stage_boundaries(config, 2, "profile")


def test_parameter_counts_tied_head_counted_once_in_the_model():
    tied = tiny_config(num_hidden_layers=2, tie_word_embeddings=True)
    counts = spec_parameter_counts(tied)
    assert counts[0] == counts[-1] == tied.vocab_size * tied.hidden_size  # the partitioner sees the copy
    assert model_parameters(tied) == sum(counts) - counts[-1]
    assert model_parameters(tied) == LlamaForCausalLM(tied).num_parameters()


def test_train_config_default_partition_is_the_planners():
    from training.configuration.schema import TrainConfig

    assert TrainConfig().partition_method == DEFAULT_PARTITION_METHOD


def packed_positions(starts: list[int], seq: int) -> torch.Tensor:
    """[1,S] int64 position ids of documents starting at ``starts`` (the first at 0)."""
    return torch.cat([torch.arange(end - start) for start, end in zip(starts, starts[1:] + [seq])])[None]


def through_checkpointed_layers(funcs, input_ids: torch.Tensor, position_ids: torch.Tensor) -> tuple:
    """The embedding, then every decoder layer under DeepSpeed's activation checkpointing, as PipelineModule runs them
    with activation_checkpoint_interval=1: what the final norm takes."""
    from deepspeed.runtime.activation_checkpointing import checkpointing

    x = funcs[0]((input_ids, position_ids))
    for layer in funcs[1:-2]:
        x = checkpointing.checkpoint(lambda *t, f=layer: f(t), *x)
    return x


def test_a_stage_reads_each_micro_batch_documents_once(monkeypatch):
    """The documents of packed rows are read on the host (a GPU sync) once per micro-batch and stage: every layer,
    and activation checkpointing's recomputation in backward, reuse them. A new packing, an in-place change of the
    positions and freed memory given to new positions are each read again."""
    from models import attention

    reads, read = [], attention.document_starts
    monkeypatch.setattr(attention, "document_starts", lambda pos: reads.append(pos.shape) or read(pos))
    torch.manual_seed(0)
    config = tiny_config(num_hidden_layers=4)
    funcs = build_sequential(config)  # embedding, 4 layers, norm, head
    ids = torch.randint(3, config.vocab_size, (2, 24))
    packings = ([0, 7], [0, 5, 16], [0], [0, 11])

    def positions(starts):
        return packed_positions(starts, 24).expand(2, 24).clone()  # [2,24] int64

    def micro_batch(pos):
        loss = funcs[-1](funcs[-2](through_checkpointed_layers(funcs, ids, pos))).mean()
        loss.backward()
        return loss.item()

    attention._FOUND.clear()
    losses = [micro_batch(positions(p)) for p in packings]
    assert len(reads) == len(packings), len(reads)  # 4 layers, forward and recomputation: 8 reads each without
    pos = positions([0, 7])
    before = attention.find_documents(pos).spans
    pos[:, 12:] = torch.arange(12)  # a third document from token 12: the version counter moves
    assert attention.find_documents(pos).spans == [[(0, 7), (7, 12), (12, 24)]] * 2 != before
    expected = [[list(zip(p, p[1:] + [24]))] * 2 for p in packings]
    for _ in range(3):  # the memory of freed positions handed to the next: never taken for them
        assert [attention.find_documents(positions(p)).spans for p in packings] == expected
    monkeypatch.setattr(attention._FOUND, "kept", 0)  # nothing kept: every layer and pass reads them again
    attention._FOUND.clear()
    reads.clear()
    assert [micro_batch(positions(p)) for p in packings] == losses
    assert len(reads) == 8 * (len(packings) + 3)  # each layer asks whether the rows are whole, a packed row's attention
    # for the documents (3 packed micro-batches)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_a_stage_computes_each_micro_batch_rotary_embedding_once(monkeypatch, model_type):
    """Eager, the rotary cos/sin of a micro-batch are computed once for a stage's layers (and recomputation), per layer
    type (Gemma 3's local and global bases): the same losses and gradients to the bit as each layer computing its
    own, whose attention would also save its own copy for the backward."""
    from models import llama_pipe

    torch.manual_seed(0)
    config = tiny_config(model_type, num_hidden_layers=4)
    funcs = build_sequential(config)  # embedding, 4 layers, norm, head
    ids = torch.randint(3, config.vocab_size, (2, 24))
    types = {layer.rotary_args for layer in funcs[1:-2]}
    calls = []
    for layer in funcs[1:-2]:
        layer.rotary_emb.register_forward_hook(lambda module, args, out: calls.append(args[-1:]))

    def run() -> tuple[list[float], list[torch.Tensor]]:
        losses = []
        for starts in ([0, 7], [0]):
            pos = packed_positions(starts, 24).expand(2, 24).clone()
            loss = funcs[-1](funcs[-2](through_checkpointed_layers(funcs, ids, pos))).mean()
            loss.backward()
            losses.append(loss.item())
        grads = [p.grad.clone() for f in funcs for p in f.parameters()]
        for f in funcs:
            f.zero_grad()
        return losses, grads

    llama_pipe._ROTARY.clear()
    losses, grads = run()
    assert len(calls) == 2 * len(types), calls  # 2 micro-batches; 4 layers forward and recomputed: 16 without
    monkeypatch.setattr(llama_pipe._ROTARY, "kept", 0)  # nothing kept: every layer and pass computes its own
    calls.clear()
    own_losses, own_grads = run()
    assert len(calls) == 2 * 8
    assert own_losses == losses and all(torch.equal(a, b) for a, b in zip(own_grads, grads))


class HostReads(TorchDispatchMode):
    """Counts the reads of a tensor's values on the host, each a GPU sync where the tensor is on the device (the queue
    of kernels drains and the GPU idles until the host launches the next): the ops whose result depends on the values
    (``item``, ``bool``, ``nonzero``, a boolean mask's indexing, ...) and the Python copies to the host (``.cpu()``,
    ``.tolist()``, ``.numpy()``). On the CPU ``.cpu()`` returns the tensor itself; here it returns a copy marked as on
    the host, and what is computed from host tensors alone is on the host too: reading those is no sync."""

    VALUE_OPS = {
        torch.ops.aten._local_scalar_dense.default,
        torch.ops.aten.nonzero.default,
        torch.ops.aten.masked_select.default,
        torch.ops.aten.equal.default,
        torch.ops.aten.is_nonzero.default,
        torch.ops.aten._unique2.default,
        torch.ops.aten.unique_consecutive.default,
        torch.ops.aten.repeat_interleave.Tensor,
        torch.ops.aten.bincount.default,
    }

    def __init__(self, monkeypatch):
        super().__init__()
        self.reads, self._host, self._kept = [], set(), []  # kept: no freed host storage is reused by a device tensor
        for name in ("cpu", "tolist", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, self._copying(getattr(torch.Tensor, name), name))

    def _on_host(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self._host

    def _mark_host(self, t: torch.Tensor) -> torch.Tensor:
        self._host.add(t.untyped_storage().data_ptr())
        self._kept.append(t)
        return t

    def _copying(self, method, name):
        def copy_to_host(t, *args, **kwargs):
            if not self._on_host(t):
                self.reads.append(f"Tensor.{name}")
            if name == "cpu":
                return t if self._on_host(t) else self._mark_host(t.clone())
            return method(t, *args, **kwargs)

        return copy_to_host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        out = func(*args, **kwargs)
        if tensors and all(self._on_host(t) for t in tensors):
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._mark_host(t)
            return out
        boolean_index = func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
        )
        if func in self.VALUE_OPS or boolean_index:
            self.reads.append(str(func))
        return out


@pytest.mark.parametrize(
    "model_type, packing, documents",
    [
        ("llama", [0], 1),
        ("llama", [0, 9, 20], 1),
        ("qwen3_moe", [0, 9], 1),  # the experts' grouped matmul reads nothing
        ("mixtral", [0, 9], 1),
        ("llama4_text", [0, 9], 2),  # cut at chunk boundaries (chunked layers) and not (the others): two answers
    ],
    ids=["whole-rows", "packed", "qwen3_moe", "mixtral", "llama4"],
)
def test_a_micro_batch_reads_the_device_once_in_the_layers_and_once_in_the_loss(
    monkeypatch, model_type, packing, documents
):
    """Through a stage of 4 decoder layers with activation checkpointing, the chunked loss and the backward, a
    micro-batch's values reach the host twice (on a GPU, two syncs): its documents, once for all layers and passes, and
    the label tokens the chunked loss keeps. ``LlamaForCausalLM`` on the same micro-batch reads once (transformers'
    check for packed rows); a read in every layer would be 8 more per micro-batch here, 56 on a 28-layer stage."""
    from models import attention
    from models.loss import CausalLMLoss

    torch.manual_seed(0)
    config = tiny_config(model_type, num_hidden_layers=4)
    funcs = build_sequential(config, loss_chunk_tokens=16)  # embedding, 4 layers, norm, head (hidden, weight)
    loss_fn = CausalLMLoss(chunk_tokens=16)
    ids = torch.randint(3, config.vocab_size, (2, 24))
    labels = ids.clone()
    labels[0, :5] = IGNORE_INDEX  # a masked prompt
    pos = packed_positions(packing, 24).expand(2, 24)

    attention._FOUND.clear()
    reads = ["Tensor.cpu"] * documents + ["aten.nonzero.default"]  # the label tokens' rows
    with HostReads(monkeypatch) as counter:
        for micro_batch in range(2):
            x = through_checkpointed_layers(funcs, ids, pos.clone())
            loss_fn(funcs[-1](funcs[-2](x)), labels).backward()
            assert counter.reads == reads * (micro_batch + 1), counter.reads
    if model_type != "llama":
        return
    hf = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    with HostReads(monkeypatch) as counter:
        hf(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss.backward()
    assert counter.reads == ["aten._local_scalar_dense.default"]  # find_packed_sequence_indices's .all()
