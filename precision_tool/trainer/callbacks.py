"""Callbacks for Model.train, as MindSpore users write them.

A callback overrides any of begin, epoch_begin, step_begin, step_end, epoch_end, end; each
receives a RunContext whose original_args() holds the CallbackParams below. In data sink
mode the step callbacks fire once per sink (sink_size device steps, or the whole epoch),
after the device has run them: `step_records` then holds every step of the sink.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional

from .. import numerics
from ..dump import hooks


@dataclass(frozen=True)
class StepRecord:
    """What the device reports of one training step."""
    step: int                     # 1-based, counted over the whole training
    loss: float
    status: int                   # OR of the step's AI Core status words (0 on the CPU)
    loss_scale: Optional[float]   # after the step's update; None without loss scaling
    finite: Optional[bool]        # the step's gradients were finite (loss scaling only)

    @property
    def overflow(self) -> bool:
        return self.finite is False or (self.finite is None and self.status != 0)


@dataclass
class CallbackParams:
    model: Any
    session: Any                  # the training Session (target, config, observers)
    epoch_num: int                # epochs of this train() call
    batch_num: int                # steps per epoch (sink_size in sink mode with sink_size > 0)
    dataset_sink_mode: bool
    cur_epoch_num: int = 0        # 1-based
    cur_step_num: int = 0         # steps done so far, over every epoch
    net_outputs: Optional[float] = None       # the loss of the last step
    loss_scale: Optional[float] = None        # the current scale; None without loss scaling
    step_records: List[StepRecord] = field(default_factory=list)   # since the last step_end


class RunContext:
    def __init__(self, params: CallbackParams):
        self._params = params
        self._stop = False

    def original_args(self) -> CallbackParams:
        return self._params

    def request_stop(self) -> None:
        """End training after the current step (in sink mode: after the current sink)."""
        self._stop = True

    def get_stop_requested(self) -> bool:
        return self._stop


class Callback:
    def begin(self, run_context): pass

    def epoch_begin(self, run_context): pass

    def step_begin(self, run_context): pass

    def step_end(self, run_context): pass

    def epoch_end(self, run_context): pass

    def end(self, run_context): pass


EVENTS = ("begin", "epoch_begin", "step_begin", "step_end", "epoch_end", "end")


class CallbackList:
    """Calls each event on every callback, in the order given."""

    def __init__(self, callbacks):
        if callbacks is None:
            callbacks = []
        elif isinstance(callbacks, Callback):
            callbacks = [callbacks]
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(f"callbacks must be Callback instances, got {type(cb).__name__}")

    def __getattr__(self, event):
        if event not in EVENTS:
            raise AttributeError(event)

        def fire(run_context):
            for cb in self.callbacks:
                getattr(cb, event)(run_context)
        return fire


def _step_in_epoch(p: CallbackParams) -> int:
    return (p.cur_step_num - 1) % p.batch_num + 1 if p.batch_num else p.cur_step_num


class LossMonitor(Callback):
    """Prints `epoch: E step: S, loss is L` every per_print_times step callbacks (S counts
    within the epoch)."""

    def __init__(self, per_print_times: int = 1, file=None):
        if per_print_times < 1:
            raise ValueError(f"per_print_times must be >= 1, got {per_print_times}")
        self.per_print_times = per_print_times
        self.file = file
        self._calls = 0

    def step_end(self, run_context):
        p = run_context.original_args()
        self._calls += 1
        if self._calls % self.per_print_times == 0:
            note = "" if math.isfinite(p.net_outputs) else "  (not finite)"
            print(f"epoch: {p.cur_epoch_num} step: {_step_in_epoch(p)}, loss is "
                  f"{p.net_outputs!r}{note}", file=self.file or sys.stdout)


class TimeMonitor(Callback):
    """Prints the epoch's wall time and the time per step at each epoch end."""

    def __init__(self, file=None):
        self.file = file
        self._start = 0.0
        self._first_step = 0

    def epoch_begin(self, run_context):
        self._start = time.perf_counter()
        self._first_step = run_context.original_args().cur_step_num

    def epoch_end(self, run_context):
        p = run_context.original_args()
        elapsed = (time.perf_counter() - self._start) * 1e3
        steps = max(p.cur_step_num - self._first_step, 1)
        print(f"epoch time: {elapsed:.3f} ms, per step time: {elapsed / steps:.3f} ms",
              file=self.file or sys.stdout)


class EarlyStop(Callback):
    """Stops training when the loss falls below `loss_below`, or when it has not improved by
    more than min_delta for `patience` step callbacks (in sink mode: sinks). After training,
    stopped_step is the cur_step_num it stopped at (None if it ran to the end) and reason
    says why."""

    def __init__(self, loss_below: Optional[float] = None, patience: Optional[int] = None,
                 min_delta: float = 0.0):
        if loss_below is None and patience is None:
            raise ValueError("EarlyStop needs loss_below, patience, or both")
        if patience is not None and patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.loss_below, self.patience, self.min_delta = loss_below, patience, float(min_delta)
        self.best = math.inf
        self.wait = 0
        self.stopped_step: Optional[int] = None
        self.reason = ""

    def begin(self, run_context):
        self.best, self.wait, self.stopped_step, self.reason = math.inf, 0, None, ""

    def step_end(self, run_context):
        p = run_context.original_args()
        loss = p.net_outputs
        if self.loss_below is not None and loss < self.loss_below:
            self.reason = f"loss {loss!r} < {self.loss_below!r}"
        elif self.patience is not None:
            if loss < self.best - self.min_delta:
                self.best, self.wait = loss, 0
            else:
                self.wait += 1
                if self.wait >= self.patience:
                    self.reason = (f"no improvement over {self.best!r} (min_delta "
                                   f"{self.min_delta!r}) for {self.patience} steps")
        if self.reason:
            self.stopped_step = p.cur_step_num
            run_context.request_stop()


class DumpCallback(Callback):
    """Turns the dump hook actions on for the training run: `dump` and/or `overflow` on the
    NPU, `dump` on the golden (cpu), for the 0-based training steps in dump_step ("0|5|10",
    "0|3-5|10"; as the hooks take them). With no action, the action comes from the
    environment, so the same script dumps under `precision-tool npu-dump|npu-overflow|cpu-dump`
    and writes nothing when run plainly. The steps are on disk when train() returns."""

    def __init__(self, action: Optional[str] = None, dump_step: Optional[str] = None,
                 dump_mode: Optional[str] = None, dump_data: Optional[str] = None,
                 data_dir: Optional[str] = None, debug_dir: Optional[str] = None,
                 on_write_error: Optional[str] = None):
        self.options = dict(action=action, dump_step=dump_step, dump_mode=dump_mode,
                            dump_data=dump_data, data_dir=data_dir, debug_dir=debug_dir,
                            on_write_error=on_write_error)
        self.observer = None
        self.run_dir: Optional[str] = None

    def begin(self, run_context):
        self.observer = hooks.attach_dump(run_context.original_args().session, **self.options)
        self.run_dir = self.observer.run_dir if self.observer is not None else None

    def end(self, run_context):
        if self.observer is not None:
            self.observer.close()


class WatchpointCallback(Callback):
    """Training watchpoints (dump.watch) on the training session: every step tested against
    the conditions (all, or those named) with the thresholds given (WatchConfig's fields),
    hits in <workspace>/watch/hits.csv, the first of each condition on stderr. `hits` lists
    them."""

    def __init__(self, data_dir: Optional[str] = None, conditions=None, **thresholds):
        from ..dump.hooks import _watch_config
        _watch_config(conditions, thresholds)          # refuse a wrong name now, not at begin
        self.options = dict(data_dir=data_dir, conditions=conditions, **thresholds)
        self.observer = None

    @property
    def hits(self) -> list:
        return self.observer.hits if self.observer is not None else []

    def begin(self, run_context):
        self.observer = hooks.attach_watch(run_context.original_args().session, **self.options)


class OverflowMonitor(Callback):
    """Reports every overflowed step (also inside a sink) with its status word and the loss
    scale's move. `overflowed_steps` lists them; `trajectory` is [(step, scale)], starting
    with (0, the initial scale), with an entry at every change."""

    def __init__(self, file=None, quiet: bool = False):
        self.file, self.quiet = file, quiet
        self.overflowed_steps: List[int] = []
        self.trajectory: List[tuple] = []

    def begin(self, run_context):
        p = run_context.original_args()
        self.overflowed_steps = []
        self.trajectory = [(p.cur_step_num, p.loss_scale)] if p.loss_scale is not None else []

    def step_end(self, run_context):
        p = run_context.original_args()
        for rec in p.step_records:
            before = self.trajectory[-1][1] if self.trajectory else None
            if rec.loss_scale is not None and rec.loss_scale != before:
                self.trajectory.append((rec.step, rec.loss_scale))
            if not rec.overflow:
                continue
            self.overflowed_steps.append(rec.step)
            if not self.quiet:
                bits = ", ".join(numerics.decode_status(rec.status)) or "inf/nan in the gradients"
                scale = ("" if rec.loss_scale is None else
                         f"; loss scale {before!r} -> {rec.loss_scale!r}")
                skipped = "; update skipped" if rec.finite is False else ""
                print(f"overflow at step {rec.step} (epoch {p.cur_epoch_num}): status "
                      f"0x{rec.status:x} ({bits}){scale}{skipped}", file=self.file or sys.stdout)
