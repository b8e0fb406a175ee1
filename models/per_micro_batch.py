"""What every decoder layer of a stage derives alike from a micro-batch's ``position_ids``, worked out once.

The positions travel between stages as they are and reach each layer of a stage as the same tensor (a view or a
detached copy of it in activation checkpointing's recomputation): the documents a layer's attention finds in them
(models/attention.py, a read on the host: on a GPU a sync) and the rotary embedding's cos/sin (kernels per layer,
and a copy each layer's attention saves for the backward) are the same in every layer, as transformers computes
them once per model forward.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch


class PerMicroBatch:
    """Values of the ``position_ids`` tensors seen last, by memory address: each entry keeps its tensor (and the
    ``owner`` its value was computed by) alive, so no other tensor can be given that memory while the entry exists: a
    tensor at the same address shares its storage (a view, a detached copy: activation checkpointing's
    recomputation), and an in-place write to it since shows in the version counter they share. DeepSpeed's pipeline
    clones what it receives from the previous stage and what it loads (a write into a reused receive buffer would
    not count a version). A stage has a few micro-batches in flight; ``kept`` bounds what is held."""

    def __init__(self, kept: int):
        self.kept = kept
        self._entries: OrderedDict = OrderedDict()

    def get(self, position_ids: torch.Tensor, extra: Hashable, compute: Callable[[], Any], owner: object = None):
        """The value of ``compute()`` for ``position_ids`` and ``extra`` (what else it depends on), computed on the
        first call; ``owner``: the object that computes it, compared by identity (layers built from one config
        share values)."""
        key = _key(position_ids, extra, owner)
        entry = self._entries.get(key) if key is not None else None
        if entry is not None and entry[1] == position_ids._version and entry[2] is owner:
            self._entries.move_to_end(key)
            return entry[3]
        value = compute()
        if key is not None and self.kept > 0:
            self._entries[key] = (position_ids, position_ids._version, owner, value)
            if len(self._entries) > self.kept:
                self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self._entries.clear()


def _key(position_ids: torch.Tensor, extra: Hashable, owner: object) -> tuple | None:
    if position_ids.device.type == "meta" or position_ids.numel() == 0:
        return None
    return (
        position_ids.device,
        position_ids.dtype,
        position_ids.data_ptr(),
        position_ids.shape,
        position_ids.stride(),
        id(owner),
        extra,
    )
