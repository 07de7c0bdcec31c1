"""TrainerState: the one object every callback reads (and may change: ``should_stop``)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class TrainerState:
    """Where the run is. ``global_step`` counts optimizer steps; ``batch_idx`` is the batch within the epoch."""

    stage: str = "idle"  # "sanity", "train", "val", "test", "predict"
    epoch: int = 0
    global_step: int = 0
    batch_idx: int = 0  # index of the batch being (or last) trained in this epoch
    batches_done: int = 0  # batches of this epoch already trained (where a resume continues)
    epoch_done: bool = False  # every batch of this epoch is trained (set before on_train_epoch_end)
    should_stop: bool = False
    stop_reason: str = ""
    data_wait_s: float = 0.0  # seconds this fit's loop has waited for training batches (not in checkpoints)
    skipped_steps: int = 0  # steps skipped for a non-finite loss (nonfinite_loss="skip")
    metrics: dict[str, float] = field(default_factory=dict)  # latest logged value of every key

    def state_dict(self) -> dict[str, Any]:
        """Where the run is, for a checkpoint: every field but ``data_wait_s`` (a timing, not training state)."""
        # Numbers, strings and (metrics) a dict of floats: no deep copy (asdict) needed.
        return {f.name: dict(self.metrics) if f.name == "metrics" else getattr(self, f.name) for f in fields(self)
                if f.name != "data_wait_s"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            if hasattr(self, key):
                setattr(self, key, dict(value) if key == "metrics" else value)
