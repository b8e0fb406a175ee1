"""train.py with the last pipeline stage reading its data in another order (seed + 1).

Launched like train.py (`deepspeed --num_gpus 4 tests/ds_scripts/train_skewed_order.py key=value ...`):
the order guard must stop it. Nothing but the last stage's seed differs from a normal run.
"""

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import train  # noqa: E402  (strips the launcher's --local_rank argument)
import training.data_setup as data_setup  # noqa: E402

_open = data_setup._open_rank_data


def skewed(cfg, coord, *args, **kwargs):
    if coord.pipe == cfg.num_stages - 1:
        cfg = dataclasses.replace(cfg, seed=cfg.seed + 1)
    return _open(cfg, coord, *args, **kwargs)


data_setup._open_rank_data = skewed
train.main()
