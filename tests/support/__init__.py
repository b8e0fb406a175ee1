"""What the tests share besides fixtures (those are tests/conftest.py's): ``ranks`` starts DeepSpeed ranks and
``scripts`` the entry points, ``models`` writes tiny Hugging Face directories, ``runs`` holds the shared training
run's arguments and reads a run's metrics, ``parity`` the parity runs' settings and single-process references."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
