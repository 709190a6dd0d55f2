"""Callbacks used by CLI tests in subprocesses (importable as tests.helpers.cli)."""

import os
import signal

import lightning as L


class KillAtStep(L.Callback):
    """SIGKILL the process once the given optimiser step has finished: an unclean death,
    no checkpoint-on-exception, no teardown, like a pre-empted job."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)
