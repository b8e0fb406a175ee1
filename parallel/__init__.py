"""How the model is laid out over ranks: the parallel sizes and batch arithmetic (``layout``), the split
into pipeline stages (``partition``), the memory it takes per GPU (``memory_plan``), and one plan per parallel
axis (``axis``: what a plan is; ``tensor_parallel``, ``sequence_parallel``, ``dualpipev``) applied to a rank's
stage by ``stage``. Above ``models/`` (the stage modules), below ``data/`` and ``training/``."""
