"""``train.py`` whose every gradient is multiplied by 2 before clipping and the optimizer step.

The classic data-parallel bug (gradients summed over ranks instead of averaged, or a tensor-
parallel gradient counted twice) in its simplest form. Losses barely move (AdamW normalises the
update, clipping rescales it), so only a check of the gradients themselves can catch it:
``tests/loop/test_grad_record.py`` runs this under torchrun in place of ``train.py``.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from graph_trainer import trainer  # noqa: E402

FACTOR = 2.0
_build = trainer.Trainer.__init__


def _build_with_doubled_grads(self, *args, **kwargs):
    _build(self, *args, **kwargs)
    gradients = self.gradients

    def doubled(microbatches):
        loss, grads = gradients(microbatches)
        return loss, [g * FACTOR for g in grads]

    self.gradients = doubled


trainer.Trainer.__init__ = _build_with_doubled_grads

if __name__ == "__main__":
    import train

    sys.exit(train.main())
