"""``Rate``: a measured rate (units/s), an exponentially weighted mean with an initial guess: the
slot table's restore rate (``ocache/slots.py`` ``RestoreRate``) and the tiers' own rates
(``ocache/tiers/``) are made of it."""

from __future__ import annotations


class Rate:
    """An exponentially weighted mean of a rate (units/s) with an initial guess."""

    def __init__(self, guess: float, alpha: float = 0.3) -> None:
        self.value = guess
        self.n = 0
        self.alpha = alpha

    def add(self, units: float, seconds: float) -> None:
        if units <= 0 or seconds <= 0:
            return
        r = units / seconds
        self.value = r if self.n == 0 else (1 - self.alpha) * self.value + self.alpha * r
        self.n += 1
