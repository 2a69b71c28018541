"""What keeps a long run going through bad data: loss spikes and skipped data intervals.

    LossSpikeGuard   a step whose agreed loss is above loss_spike_factor x the mean of the last
                     loss_spike_window finite, non-spike losses is a spike; loss_spike_action says
                     what happens (warn, skip, rollback, stop). The loss compared is the step's
                     largest over the ranks, read from the step's one flag reduction
                     (trainer.agree_on_step), so every rank decides the same.
    DataSkips        the global steps (1-based, inclusive, PaddleNLP's skip_data_intervals) whose
                     batches are not trained on: their samples are consumed and the step counts,
                     as paddlenlp/trainer/trainer.py should_skip_data. A rollback adds the interval
                     from the checkpoint it reloads to the spike (plus loss_spike_skip_steps).

Both live in the checkpoint's trainer_state, so a resumed run decides exactly as the
uninterrupted one.
"""

from __future__ import annotations

import math
from collections import deque


class LossSpikeGuard:
    def __init__(self, factor: float, window: int, action: str, history=()):
        self.factor, self.action = factor, action
        self.losses = deque(history, maxlen=window or None)
        self.window = window

    @classmethod
    def from_args(cls, args, trainer_state: dict | None = None) -> "LossSpikeGuard":
        return cls(args.loss_spike_factor, args.loss_spike_window, args.loss_spike_action,
                   (trainer_state or {}).get("loss_spike_window_losses", ()))

    def threshold(self) -> float | None:
        """The loss above which this step is a spike; None while the check is off or the window fills."""
        if not self.factor or len(self.losses) < self.window:
            return None
        return self.factor * sum(self.losses) / len(self.losses)

    @property
    def drops_update(self) -> bool:
        """skip and rollback: a spike step's update is not applied (where the update comes after the check)."""
        return self.action in ("skip", "rollback")

    def observe(self, loss: float) -> None:
        """A finite, non-spike step's agreed loss joins the window."""
        if self.window and math.isfinite(loss):
            self.losses.append(loss)

    def state(self) -> dict:
        return {"loss_spike_window_losses": list(self.losses)}


class DataSkips:
    def __init__(self, intervals=None, trainer_state: dict | None = None):
        self.given = [tuple(pair) for pair in intervals or []]
        self.rollbacks = [tuple(pair) for pair in (trainer_state or {}).get("rollback_skipped_steps", [])]

    def covers(self, step: int) -> bool:
        """Whether global step `step` (1-based) is skipped."""
        return any(first <= step <= last for first, last in self.given + self.rollbacks)

    def add_rollback(self, first: int, last: int) -> None:
        self.rollbacks.append((first, last))

    def state(self) -> dict:
        return {"rollback_skipped_steps": [list(pair) for pair in self.rollbacks]}


def sample_range(first_step: int, last_step: int, global_batch_size: int) -> list[int]:
    """[first sample, end sample) the global steps first_step..last_step (1-based) read."""
    return [(first_step - 1) * global_batch_size, last_step * global_batch_size]
