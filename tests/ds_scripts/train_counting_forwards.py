"""train.py, counting DecoderLayerPipe forward calls per rank (printed at exit as DECODER_FORWARDS).

With activation checkpointing every checkpointed layer runs forward twice per micro-batch (once
without saving activations, once again in the backward pass): the count shows it really happens.
"""

import atexit
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import models.llama_pipe as llama_pipe  # noqa: E402

calls = {"n": 0}
_forward = llama_pipe.DecoderLayerPipe.forward


def counting_forward(self, inputs):
    calls["n"] += 1
    return _forward(self, inputs)


llama_pipe.DecoderLayerPipe.forward = counting_forward
atexit.register(lambda: print(f"DECODER_FORWARDS rank {os.environ.get('RANK')}: {calls['n']}", flush=True))

import train  # noqa: E402

train.main()
