"""train.py, counting decoder-layer stage forward calls per rank (printed at exit as DECODER_FORWARDS).

With activation checkpointing every checkpointed layer runs forward twice per micro-batch (once
without saving activations, once again in the backward pass): the count shows it really happens.
"""

import atexit
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import models.llama_pipe as llama_pipe  # noqa: E402

calls = {"n": 0}


def counting(forward):
    def counting_forward(self, inputs):
        calls["n"] += 1
        return forward(self, inputs)

    return counting_forward


# Each family's class, not the DecoderLayerPipe base: transformers wraps every GradientCheckpointingLayer
# subclass's forward when the class is created, so the base's attribute is no longer what is called.
for cls in llama_pipe.DECODER_LAYER_CLASSES.values():
    cls.forward = counting(cls.forward)
atexit.register(lambda: print(f"DECODER_FORWARDS rank {os.environ.get('RANK')}: {calls['n']}", flush=True))

import train  # noqa: E402

train.main()
