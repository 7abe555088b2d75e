"""One position of a verify pass's recurrent steps (verify.py chains, tree.py levels)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from baton.model.paged import StepContext


class Position(NamedTuple):
    ctx: StepContext
    """The slots of the requests still running at this position."""
    rows: torch.Tensor
    """Rows of the pass at this position (one per request still running)."""
    save_to: torch.Tensor | None
    """Scratch rows for the requests with a later position (their state is saved)."""
    save_slots: torch.Tensor | None
    copy_from: torch.Tensor | None = None
    """Tree levels: the parents' slots, copied into `ctx.slots` before the step."""
