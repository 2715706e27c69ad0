"""A change to a run's configuration that a replay of a step can try (a fusion pass off, an op
type in fp32, a loss scale, a precision mode), and what a replay said of one: the vocabulary
that `fix` searches in and that `ac`'s advice is checked in. Plain data: no runtime here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

VERIFIED = "verified"                # a replay of the step with it matches the golden
NO_HELP = "does not help"            # a replay with it still fails
NOT_VERIFIED = "not verified"        # not replayed (no bundle, not a configuration change)


@dataclass(frozen=True)
class Change:
    """One candidate: kind "fusion" (name: a pass, switched off), "loss_scale" (value: the
    scale), "fp32" (name: an op type kept in fp32) or "mode" (name: a precision mode)."""
    kind: str
    name: str
    value: Optional[float] = None

    def describe(self) -> str:
        if self.kind == "fusion":
            return f"fusion pass {self.name} off"
        if self.kind == "loss_scale":
            return f"loss scale {self.value:g}"
        if self.kind == "fp32":
            return f"{self.name} in fp32"
        return f"precision mode {self.name}"


def describe_all(changes: Sequence[Change]) -> str:
    return "; ".join(c.describe() for c in changes)
