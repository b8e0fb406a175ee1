"""How the model is laid out over ranks: the parallel sizes and batch arithmetic (``layout``), the split
into pipeline stages (``partition``) and the memory it takes per GPU (``memory_plan``). Above ``models/``
(the stage modules), below ``data/`` and ``training/``."""
