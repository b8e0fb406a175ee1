"""Write docs/configuration.md from training/configuration/schema.py and conf/ (the reference is generated, never
edited).

    python tools/gen_config_docs.py            # rewrite docs/configuration.md
    python tools/gen_config_docs.py --check    # exit 1 if it is stale

tests/test_docs.py fails while docs/configuration.md differs from what this writes.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.config_docs import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
