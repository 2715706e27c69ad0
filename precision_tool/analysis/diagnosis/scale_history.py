"""The loss-scale history of a run: how many observed steps overflowed and how the scale
moved (from the run's step_history.csv, which the dump hooks write for every step they
observe, dumped or not)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from ... import numerics
from ...dump import Workspace
from ...dump.workspace import Run


@dataclass
class LossScaleHistory:
    steps: int                                  # steps observed
    overflow_steps: List[int]                   # status word not zero
    skipped_steps: List[int]                    # loss-scaled steps whose update was skipped
    moves: List[Tuple[int, float, float]] = field(default_factory=list)   # (step, from, to)
    first_scale: float = float("nan")
    last_scale: float = float("nan")            # the scale after the last observed step
    status_bits: List[str] = field(default_factory=list)   # every bit seen, decoded
    scaled_steps: List[int] = field(default_factory=list)  # observed with a loss scale

    @property
    def scaled(self) -> bool:
        return self.first_scale == self.first_scale

    def scale_at(self, step: int) -> Optional[float]:
        """The loss scale a step ran with (the first scale and the moves before it)."""
        if not self.scaled:
            return None
        scale = self.first_scale
        for at, _, to in self.moves:
            if at < step:
                scale = to
        return scale

    def settling_from(self, step: int) -> Optional[tuple]:
        """Skips from the first observed step on, up to a step without overflow: (the skipped
        steps from `step` on, that step, its scale), a scale the run proved; None where
        `step` is not among such skips or none came after them."""
        skipped = set(self.skipped_steps)
        if step not in skipped or any(s not in skipped for s in self.scaled_steps if s < step):
            return None
        clean = next((s for s in sorted(self.scaled_steps) if s > step and s not in skipped),
                     None)
        if clean is None:
            return None
        return sorted(s for s in skipped if step <= s < clean), clean, self.scale_at(clean)

    def held_after(self, clean: int) -> Tuple[List[int], float, bool]:
        """After a calibration settled at step `clean`: (the steps skipped after it, the
        scale from the last of them on, whether an observed step ran at that scale): the
        scale the run proved is where it held last, not where it first held."""
        again = [s for s in self.skipped_steps if s > clean]
        if not again:
            return [], self.scale_at(clean), True
        return again, self.scale_at(again[-1] + 1), any(s > again[-1] for s in self.scaled_steps)


def calibration(history: LossScaleHistory, step: int, overflowed) -> Optional[tuple]:
    """settling_from(step) where the step's overflows (op names) are all in the backward: a
    loss scale that starts too high and comes down to one that holds; None otherwise."""
    if not overflowed or not all(is_backward(name) for name in overflowed):
        return None
    return history.settling_from(step)


def loss_scale_history(ws: Workspace, run: Run) -> LossScaleHistory:
    table = ws.step_history(run)
    overflow = table[table.status != 0]
    seen = 0
    for s in overflow.status:
        seen |= int(s)
    result = LossScaleHistory(len(table), overflow.step.tolist(), [],
                              status_bits=numerics.decode_status(seen) if seen else [])
    scaled = table.dropna(subset=["loss_scale", "next_loss_scale"])
    if not scaled.empty:
        result.first_scale = float(scaled.loss_scale.iloc[0])
        result.last_scale = float(scaled.next_loss_scale.iloc[-1])
        result.skipped_steps = scaled.step[scaled.finite == 0].tolist()
        result.scaled_steps = scaled.step.tolist()
        moved = scaled[scaled.loss_scale != scaled.next_loss_scale]
        result.moves = [(int(r.step), float(r.loss_scale), float(r.next_loss_scale))
                        for r in moved.itertuples()]
    return result


def is_backward(op_name: str) -> bool:
    """An op of the backward pass: a graph's under gradients/, a script's call's .backward."""
    return op_name.startswith("gradients/") or op_name.endswith(".backward")


def backoff(history: LossScaleHistory, step: int) -> Optional[dict]:
    """`step` as a dynamic loss scale doing its job: the step skipped and its scale lowered,
    with few skips in the run (the only one, or at most a quarter of the observed steps).
    kind "back-off": the observed step before it ran without overflow (the scale had held)
    and the one after it too, or it is the last; kind "calibration": the skips run from
    the first observed step on (a scale that started high and came down) and a later step
    ran without overflow (it settled: `after`, at `settled`). None otherwise: a scale that
    never settles, one that overflows step after step mid-run, or one that grows too fast
    (skipping every other step)."""
    if not history.scaled or step not in history.skipped_steps:
        return None
    move = next((m for m in history.moves if m[0] == step and m[2] < m[1]), None)
    skipped = set(history.skipped_steps)
    if move is None or len(skipped) > 1 and 4 * len(skipped) > len(history.scaled_steps):
        return None
    before = [s for s in history.scaled_steps if s < step]
    after = [s for s in history.scaled_steps if s > step]
    found = {"step": step, "scale": move[1], "next_scale": move[2], "skipped": len(skipped),
             "observed": len(history.scaled_steps)}
    if before and before[-1] not in skipped:
        if after and after[0] in skipped:
            return None
        return dict(found, kind="back-off", before=before[-1],
                    after=after[0] if after else None)
    settling = history.settling_from(step)
    if settling is None:
        return None
    return dict(found, kind="calibration", before=None, after=settling[1], settled=settling[2])
