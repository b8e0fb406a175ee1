"""The next-token loss of the last stage, and how it is normalised over an optimizer step.

Hugging Face Trainer (``num_items_in_batch`` with ``average_tokens_across_devices``) divides the summed
token losses of one optimizer step by the number of label tokens in the whole global batch: every
micro-batch of the step on every data-parallel rank. DeepSpeed instead divides each micro-batch's loss
by ``gradient_accumulation_steps`` and averages gradients (and the reported loss) over the
data-parallel group. :class:`CausalLMLoss` bridges the two: once the step's global label count N is
known, each micro-batch returns ``sum of its token losses x (grad_acc x dp) / N``, and DeepSpeed's own
divisions turn the step into ``sum over the global batch / N``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Label value that the loss ignores (prompt tokens, padding); the same value Hugging Face uses.
IGNORE_INDEX = -100


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross entropy over the labels that are not ``IGNORE_INDEX`` (mean or sum).

    Same definition as Hugging Face's ``ForCausalLMLoss``: position t predicts label t+1; computed in
    fp32 whatever the training precision.
    """
    shift_logits = logits[:, :-1, :].float()  # [B,S-1,V]
    shift_labels = labels[:, 1:]  # [B,S-1]
    return F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction=reduction,
    )


def label_tokens(labels: torch.Tensor) -> int:
    """Tokens the loss is taken over: labels after the shift that are not ``IGNORE_INDEX`` (Trainer's count)."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


class CausalLMLoss:
    """The pipeline's ``loss_fn`` (and the data-parallel engine's loss), normalised per optimizer step.

    ``scale`` None: the mean over this micro-batch's label tokens (``loss_normalization=micro_batch``,
    DeepSpeed's convention). Otherwise the micro-batch's summed token losses times ``scale``, which
    the trainer sets before each step (or eval pass) to ``micro-batches x dp / global label tokens``.
    """

    def __init__(self) -> None:
        self.scale: float | None = None

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return causal_lm_loss(logits, labels)
        return causal_lm_loss(logits, labels, reduction="sum") * self.scale
