"""Order guard: the first and last stage of every pipeline must load the same micro-batches.

The first stage reads the inputs and the last stage the labels, each from its own iterator; if they
ever disagree, the model silently trains on wrong labels. With tensor parallelism every rank of those
stages reads them, and its TP peers must agree too. Every reading rank fingerprints each micro-batch
it loads; after each of the first ``check_steps`` steps of a run (a resumed one too), all ranks exchange the
fingerprints and compare them per pipeline. A mismatch stops training on every rank, naming the step, the ranks and
both fingerprints.
"""

from __future__ import annotations

import hashlib

import torch.distributed as dist

from data.sampling import Batch


def has_peers(num_stages: int, tensor_parallel: int) -> bool:
    """Whether some ranks read the same micro-batches for the guard to compare: the first and last stage, a stage's
    tensor-parallel peers (one stage on one rank reads inputs and labels together)."""
    return num_stages > 1 or tensor_parallel > 1


# data.order_check_steps where no two ranks read the same micro-batches: harmless, one warning (training's
# inert_settings: keys, whether they act on a layout, why).
ORDER_CHECK_RULE = (
    ("data.order_check_steps",),
    lambda cfg, layout: has_peers(layout.stages, layout.tp),
    "the order check compares the batches of the first and last stages (and their tensor-parallel peers); with "
    "one stage and one rank per layer it has nothing to compare",
)


class OrderMismatchError(RuntimeError):
    """The first and last stage of a pipeline loaded different micro-batches."""


def fingerprint(batch: Batch) -> str:
    """Short hash of a micro-batch's token ids and labels (what both end stages load)."""
    (input_ids, position_ids), labels = batch
    h = hashlib.blake2b(digest_size=8)
    # preference pairs: the labels and the pair ids (the reference values are looked up by them)
    for t in (input_ids, position_ids, *(labels[:2] if isinstance(labels, tuple) else (labels,))):
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


class FingerprintingIterator:
    """Wraps a micro-batch iterator and records a fingerprint per batch while ``active``."""

    def __init__(self, iterator):
        self.iterator, self.active, self.pending = iterator, True, []

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        batch = next(self.iterator)
        if self.active:
            self.pending.append(fingerprint(batch))
        return batch

    @property
    def tokens_read(self) -> int:
        return self.iterator.tokens_read

    @property
    def tokens_by_source(self) -> dict[int, int]:
        return self.iterator.tokens_by_source

    def state_dict(self) -> dict:
        return self.iterator.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.iterator.load_state_dict(state)


class OrderGuard:
    """Compares the end stages' fingerprints after each of the first ``check_steps`` steps.

    ``iterator`` is this rank's FingerprintingIterator (None on middle stages). ``pipeline`` is this
    rank's data-parallel coordinate (which pipeline), ``stage`` its pipeline stage.
    """

    def __init__(
        self,
        iterator: FingerprintingIterator | None,
        check_steps: int,
        num_stages: int,
        pipeline: int,
        stage: int,
        tensor_parallel: int = 1,
    ):
        self.iterator, self.check_steps, self.num_stages = iterator, check_steps, num_stages
        self.pipeline, self.stage = pipeline, stage
        self.enabled = check_steps > 0 and has_peers(num_stages, tensor_parallel)
        self.compared = 0  # micro-batches compared so far, over all pipelines
        self.last_step = check_steps  # the last step compared (``resumed_after``)
        if iterator is not None:
            iterator.active = self.enabled

    def resumed_after(self, step: int) -> None:
        """A resumed run compares its own first ``check_steps`` steps: where its two ends restored their positions in
        the data separately, and where a mismatch would show."""
        self.last_step = step + self.check_steps

    def after_step(self, step: int) -> None:
        """Collective on all ranks (every rank calls it with the same step)."""
        if not self.enabled or step > self.last_step:
            return
        mine = (self.pipeline, self.stage, dist.get_rank(), list(self.iterator.pending) if self.iterator else [])
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if self.iterator is not None:
            self.iterator.pending.clear()
            self.iterator.active = step < self.last_step
        problems = []
        ends = (0, self.num_stages - 1)
        for pipeline in sorted({g[0] for g in gathered}):
            readers = [g for g in gathered if g[0] == pipeline and g[1] in ends]  # their tensor-parallel peers too
            first = readers[0]
            counted = next(g for g in readers[1:] if g[1] == self.num_stages - 1)  # micro-batches: first vs last
            for other in readers[1:]:
                where = "last stage" if other[1] == self.num_stages - 1 else "first stage"
                if other is counted:
                    self.compared += min(len(first[3]), len(other[3]))
                for i, (a, b) in enumerate(zip(first[3], other[3])):
                    if a != b:
                        problems.append(
                            f"step {step}, micro-batch {i}: first stage (rank {first[2]}) loaded {a}, "
                            f"{where} (rank {other[2]}) loaded {b}"
                        )
                        break
                if len(first[3]) != len(other[3]):
                    problems.append(
                        f"step {step}: first stage (rank {first[2]}) loaded {len(first[3])} micro-batches, "
                        f"{where} (rank {other[2]}) {len(other[3])}"
                    )
        if problems:
            raise OrderMismatchError("first and last stage disagree on the data order:\n  " + "\n  ".join(problems))
