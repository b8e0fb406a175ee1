"""The deepseek_v3 family beyond Hugging Face's modules: the expert balancing ``DeepseekV3ForCausalLM`` leaves to the
trainer (DeepSeek-V3 report, 2.1.2), the config values its router cannot route with, and the release's
multi-token-prediction layers, which the conversion leaves out (:func:`mtp_keys`).

Auxiliary-loss-free balancing: each MoE layer's router picks its top-k experts by ``sigmoid scores +
e_score_correction_bias`` (a buffer: no gradient, no optimizer), and after each step the bias of every expert moves
by ``speed`` towards balance, ``bias_e += speed * sign(mean load - load_e)``: an overloaded expert is picked less
next step, an underloaded one more. :func:`update_bias_` is that rule on one layer's loads; :class:`ExpertLoads`
counts the loads of a step from the routers' choices. ``speed`` 0 (the default) leaves the bias as it is, so
training computes what Hugging Face's model computes. The report's speed: 0.001 for most of pre-training.

The complementary sequence-wise balance loss (:func:`sequence_balance_loss`, the report's alpha 0.0001):
``alpha * sum_e f_e P_e`` per sequence and MoE layer. Training adds it with ``moe.sequence_balance_coef`` > 0 (the
alpha; 0, the default, adds nothing, as ``DeepseekV3ForCausalLM`` adds nothing): each sequence is a packed row's
DOCUMENT, not the row (the report's sequences are its training samples; a row packs several, each balanced on its own),
each layer's loss the mean over the micro-batch's documents (as DeepSeek-V2's released ``seq_aux`` code takes the mean
over its rows), summed over the MoE layers. The per-expert terms travel on the router loss's wire to the last stage
(:class:`SequenceBalanceStats`, models/router_loss.py), which adds alpha x their sum (:class:`SequenceBalanceLoss`).

training/moe_balance.py wires the rule into training (``moe.bias_update_speed``): each step's loads summed over the
ranks holding the layer before the update, so that every replica keeps the same bias. It also holds both knobs' rules.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from models.attention import document_starts
from models.router_loss import RouterLoss, RouterStats

DEFAULT_BIAS_SPEED = 0.0  # off: the bias stays as loaded, as in Hugging Face's model
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


@torch.no_grad()
def update_bias_(bias: torch.Tensor, loads: torch.Tensor, speed: float = DEFAULT_BIAS_SPEED) -> torch.Tensor:
    """One layer's ``e_score_correction_bias`` [E] moved in place by ``speed`` towards balance from that layer's
    ``loads`` [E] (tokens routed to each expert in the step): ``+speed`` under the mean load, ``-speed`` over it,
    unchanged at it. Returns ``bias``."""
    if speed < 0:
        raise ValueError(f"the bias update speed {speed} must be >= 0 (0: off)")
    if speed:
        loads = loads.to(device=bias.device, dtype=torch.float64)
        bias.add_((loads.mean() - loads).sign().to(bias.dtype), alpha=speed)
    return bias


def routers(module: nn.Module) -> dict[str, DeepseekV3TopkRouter]:
    """The DeepSeek-V3 routers inside ``module`` by their names (``mlp.gate``, or ``model.layers.3.mlp.gate``)."""
    return {name: m for name, m in module.named_modules() if isinstance(m, DeepseekV3TopkRouter)}


class ExpertLoads:
    """The tokens each router of ``module`` sent to each expert since the last :meth:`take`, counted by forward hooks
    on the routers (their third output, the top-k expert ids [T,k]): training forwards only, each once. Eval,
    generation and the recording passes run in eval mode; activation checkpointing's recomputation runs inside the
    backward (an autograd graph task), where the first forward ran outside one."""

    def __init__(self, module: nn.Module):
        self.routers = routers(module)
        self.loads = {name: torch.zeros(r.num_experts, dtype=torch.int64) for name, r in self.routers.items()}
        self.handles = [r.register_forward_hook(self._counter(name)) for name, r in self.routers.items()]

    def _counter(self, name: str):
        def count(module, args, output) -> None:
            if not module.training or torch._C._current_graph_task_id() != -1:  # not training, or a recomputation
                return
            ids = output[2].detach().reshape(-1)  # [T*k] expert ids
            # on the router's device until take(): no host sync in each layer's forward
            self.loads[name] = self.loads[name].to(ids.device) + torch.bincount(ids, minlength=module.num_experts)

        return count

    def take(self) -> dict[str, torch.Tensor]:
        """The loads [E] int64 per router name since the last call, and the counts restarted."""
        out = {name: t.cpu() for name, t in self.loads.items()}
        self.loads = {name: torch.zeros_like(t) for name, t in out.items()}
        return out

    def update_biases_(self, speed: float = DEFAULT_BIAS_SPEED) -> dict[str, torch.Tensor]:
        """The step's end: every router's bias moved by :func:`update_bias_` from its loads; returns the loads."""
        loads = self.take()
        for name, router in self.routers.items():
            update_bias_(router.e_score_correction_bias, loads[name], speed)
        return loads

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def sequence_balance_loss(scores: torch.Tensor, top_k_index: torch.Tensor, alpha: float) -> torch.Tensor:
    """The sequence-wise balance loss of one sequence of T tokens in one MoE layer: ``alpha * sum_e f_e P_e`` with
    ``f_e = E / (k T) * (tokens choosing e)`` and ``P_e`` the mean over the tokens of the scores normalised to sum 1
    per token. ``scores``: the router's sigmoid scores [T,E] (without the bias); ``top_k_index``: its choices [T,k]."""
    tokens, num_experts = scores.shape
    k = top_k_index.shape[-1]
    chosen = torch.zeros_like(scores).scatter_(1, top_k_index, 1.0)  # [T,E]
    f = chosen.sum(0) * num_experts / (k * tokens)  # [E]
    p = (scores / scores.sum(-1, keepdim=True)).mean(0)  # [E]
    return alpha * (f * p).sum()


def document_index(position_ids: torch.Tensor) -> torch.Tensor:
    """[B,S] int64 -> [B*S] int64: each token's document, numbered 0, 1, ... over the rows in order (a row's first
    token starts one; padding, whose positions count on, belongs to its row's last document)."""
    return document_starts(position_ids).reshape(-1).cumsum(0) - 1


def document_balance_terms(scores: torch.Tensor, top_k_index: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """Per expert [E], ``f_e P_e`` of each document averaged over the documents: their sum is one MoE layer's
    sequence-wise balance loss without alpha, a document per sequence (:func:`sequence_balance_loss` of each,
    averaged). ``scores`` [T,E]: sigmoid scores without the bias; ``top_k_index`` [T,k]: the choices (bias included);
    ``documents`` [T]: :func:`document_index`'s. On the device, no host sync: per-document sums over T slots (a bound
    on the documents), the empty ones zero."""
    tokens, experts = scores.shape
    k = top_k_index.shape[-1]
    chosen = torch.zeros_like(scores).scatter_(1, top_k_index, 1.0)  # [T,E]
    normalised = scores / scores.sum(-1, keepdim=True)  # s' [T,E]
    length = scores.new_zeros(tokens).index_add_(0, documents, scores.new_ones(tokens))  # tokens per document [T]
    per_token = length.clamp(min=1).unsqueeze(1)  # [T,1]
    f = scores.new_zeros(tokens, experts).index_add_(0, documents, chosen) * (experts / k) / per_token  # [T,E]
    p = scores.new_zeros(tokens, experts).index_add_(0, documents, normalised) / per_token  # [T,E]
    return (f * p).sum(0) / (length > 0).sum()


class SequenceBalanceStats(RouterStats):
    """The router loss's wire (models/router_loss.py) carrying the sequence-wise balance loss: ``probs`` [E] the
    layers' :func:`document_balance_terms` summed (their total is the loss, summed over the layers), ``tokens`` and
    ``rows`` as :class:`RouterStats`'s (the metrics' expert load)."""

    def add_documents(
        self, router_logits: torch.Tensor, top_k_index: torch.Tensor, position_ids: torch.Tensor
    ) -> SequenceBalanceStats:
        """These sums with one MoE layer's added: its router's logits [B*S,E] and choices [B*S,k], the micro-batch's
        ``position_ids`` [B,S] (the documents)."""
        scores = router_logits.float().sigmoid()
        terms = document_balance_terms(scores, top_k_index, document_index(position_ids))
        counts = torch.bincount(top_k_index.reshape(-1), minlength=scores.shape[1]).float()
        return SequenceBalanceStats(self.tokens + counts, self.probs + terms, self.rows + scores.shape[0])


class SequenceBalanceLoss(RouterLoss):
    """What the last stage's loss adds with ``moe.sequence_balance_coef`` (``coef``, the report's alpha): coef x the
    sum of every MoE layer's per-document balance loss, per micro-batch; logged as ``sequence_balance_loss``."""

    metric = "sequence_balance_loss"
    stats = SequenceBalanceStats

    @staticmethod
    def loss_of(stats: RouterStats) -> torch.Tensor:
        return stats.probs.sum()


def deepseek_v3_problems(config, where: str, fix) -> list[str]:
    """What of a deepseek_v3 config its router or attention cannot compute, one line each (``fix(key, wanted)``: the
    advice, models/config_rules.py's). ``DeepseekV3Config`` checks none of it; the model fails inside its forward, or
    routes to experts of groups it masked out."""
    problems = []
    experts, groups, kept = config.n_routed_experts, config.n_group, config.topk_group
    k, layers, dense = config.num_experts_per_tok, config.num_hidden_layers, config.first_k_dense_replace

    def need(key: str, ok: bool, wanted: str, why: str) -> None:
        if not ok:
            problems.append(f"{where}: {key} {getattr(config, key)!r} {why}: {fix(key, wanted)}")

    need("n_group", groups >= 1 and experts % groups == 0, f"to a divisor of {experts}", "does not divide the experts")
    if groups >= 1 and experts % groups == 0:
        small = "leaves groups of fewer than 2 experts (each group is scored by its 2 best)"
        need("n_group", experts // groups >= 2, f"to at most {experts // 2}", small)
        need("topk_group", 1 <= kept <= groups, f"in [1, {groups}] (n_group {groups})", "keeps no group or too many")
        room = kept * experts // groups
        misfit = f"does not fit the {room} experts of the topk_group {kept} groups a token may use"
        need("num_experts_per_tok", 1 <= k <= room, f"in [1, {room}]", misfit)
    need("first_k_dense_replace", 0 <= dense <= layers, f"in [0, {layers}]", "is not a number of the first layers")
    factor = config.routed_scaling_factor
    need("routed_scaling_factor", factor > 0, "> 0 (2.5 in DeepSeek-V3)", "scales the experts' output to nothing")
    need(
        "num_key_value_heads",
        config.num_key_value_heads == config.num_attention_heads,
        f"to num_attention_heads {config.num_attention_heads}",
        "is not the number of heads multi-head latent attention expands its latent to",
    )
    return problems


def mtp_keys(config, keys: Iterable[str]) -> list[str]:
    """The tensors of a deepseek_v3 release's multi-token-prediction layers (``model.layers.<L>.`` and on, L =
    num_hidden_layers: DeepSeek-V3's 14 B parameters beside the 671 B), which ``DeepseekV3ForCausalLM`` does not load
    either and the conversion leaves out; [] for another family."""
    if getattr(config, "model_type", None) != "deepseek_v3":
        return []
    return [k for k in keys if (m := _LAYER_KEY.match(k)) and int(m.group(1)) >= config.num_hidden_layers]
