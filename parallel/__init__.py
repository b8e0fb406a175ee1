"""How the model is laid out over ranks: the parallel sizes and batch arithmetic (``layout``), the two DeepSpeed
engines a layout runs on (``engines``), the split into pipeline stages (``partition``), the memory it takes per GPU
(``memory_plan``), and one plan per parallel axis (``axis``: what a plan is), applied to a rank's stage by ``stage``.
Above ``models/`` (the stage modules), below ``data/`` and ``training/``; docs/architecture.md maps every module."""
