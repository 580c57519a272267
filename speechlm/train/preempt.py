"""SIGTERM: one owner, a flag, and one agreement per optimizer step.

The handler only sets a flag (`SIGTERM_FLAG`). Nothing acts on it where it is set: every rank adds
the flag to the all-reduce the training step already does at its start (`SpeechLLMModule._agree_step`,
`Collectives.agree` over every rank of the world: set when any rank's is), so a signal that reaches the ranks at different moments is acted
on by all of them at the same step. When the ranks agree, the step is not trained: every rank saves
the checkpoint of the last trained step (`CheckpointCallback`), training stops, and the process exits
with `EXIT_SIGTERM` (143), the code a scheduler reads as "preempted, resume me".

Lightning installs its own SIGTERM handler when `fit` starts (it sets `trainer.received_sigterm`, and
in 2.6 even issues a broadcast from inside the handler, on whichever rank got the signal). Our
callback re-installs this handler in `on_train_start`, so Lightning's never runs during training and
`trainer.received_sigterm` stays False; after `fit` Lightning restores the handler that was there
before, which is ours again (`install()` runs before `fit`), so a SIGTERM during the final evaluation
is seen too: the evaluation agrees on it per batch and stops
(`speechlm.use.evaluator.EvaluationInterrupted`).
"""

from __future__ import annotations

import signal
from types import FrameType


class StopFlag:
    """Set by the SIGTERM handler; read (never reset) by the per-step agreement."""

    def __init__(self) -> None:
        self.requested = False
        self.count = 0

    def handler(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        self.count += 1

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self.handler)

    def reset(self) -> None:
        self.requested = False
        self.count = 0


SIGTERM_FLAG = StopFlag()
