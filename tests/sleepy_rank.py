"""train.py with one rank asleep inside a step (tests/test_hang.py): rank SLEEPY_RANK sleeps in its pipeline
forward passes from step SLEEPY_STEP on, SLEEPY_SECONDS each (default an hour: a rank stuck in a kernel or a
dead filesystem read; a fraction of a second: a straggler)."""

import os
import runpy
import sys
import time

from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

if int(os.environ["RANK"]) == int(os.environ["SLEEPY_RANK"]):
    forward = PipelineEngine._exec_forward_pass

    def asleep_in_forward(self, buffer_id):
        if self.global_steps + 1 >= int(os.environ["SLEEPY_STEP"]):
            time.sleep(float(os.environ.get("SLEEPY_SECONDS", "3600")))
        return forward(self, buffer_id)

    asleep_in_forward.__name__ = forward.__name__  # still the forward pass to the straggler clock
    PipelineEngine._INSTRUCTION_MAP[schedule.ForwardPass] = asleep_in_forward

sys.argv[0] = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train.py")
runpy.run_path(sys.argv[0], run_name="__main__")
