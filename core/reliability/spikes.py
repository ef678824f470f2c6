"""Loss spikes: a step whose loss is far above the recent accepted ones is skipped, not trained on."""

from __future__ import annotations

import math
from collections import deque
from typing import Any


class SpikeDetector:
    """z = (loss - mean) / std over the last `window` accepted losses; a spike when z > zscore.

    Active once `min_history` losses are in (default half the window). The std has a floor of
    1e-3 x |mean|, so a flat run of identical losses does not make every wiggle a spike. Only
    accepted losses enter the window, so a spike does not raise the bar for the next one."""

    def __init__(self, zscore: float = 6.0, window: int = 100, min_history: int | None = None):
        if zscore <= 0 or window < 2:
            raise ValueError(f"zscore must be > 0 and window >= 2, got {zscore}, {window}")
        self.threshold = zscore
        self.min_history = min_history or max(2, window // 2)
        self.losses: deque[float] = deque(maxlen=window)

    def zscore(self, loss: float) -> float | None:
        if len(self.losses) < self.min_history or not math.isfinite(loss):
            return None
        n = len(self.losses)
        mean = sum(self.losses) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in self.losses) / n)
        return (loss - mean) / max(std, 1e-3 * abs(mean), 1e-12)

    def is_spike(self, loss: float) -> float | None:
        """The z-score when `loss` is a spike, else None."""
        z = self.zscore(loss)
        return z if z is not None and z > self.threshold else None

    def accept(self, loss: float) -> None:
        if math.isfinite(loss):
            self.losses.append(float(loss))

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses.clear()
        self.losses.extend(float(x) for x in state["losses"])
