"""What a run shows: the start-up lines (``announce``), log filtering (``logs``), one line and one metrics.jsonl record
per step (``metrics``), Weights & Biases (``tracking``), profiles and their timelines (``profiling``, ``timeline``),
measured memory (``memory_census``) and the slowest rank (``straggler``)."""
