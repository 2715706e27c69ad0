"""Loss scaling written by hand, as MindSpore's `mindspore.amp` functional form has it:

    scaler = pt.amp.DynamicLossScaler(scale_value=2**16, scale_factor=2, scale_window=1000)
    grads = pt.train.gradients(scaler.scale(loss), params)   # differentiate the scaled loss
    grads = scaler.unscale(grads)
    finite = pt.amp.all_finite(grads)                         # the step's float status is 0
    step = optimizer.apply_gradients(zip(grads, params), gate=finite,   # update only if finite
                                     extra=[scaler.adjust(finite)])     # shrink or grow

Everything is graph ops: the scale is a variable (`<name>/loss_scale`) updated by the
UpdateLossScale op, so it is dumped, replayed and compared like any other state.
`LossScaleOptimizer` is this recipe wrapped around an optimizer.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from ..errors import GraphError
from ..graph import Tensor
from ..ops import cast, div, equal, mul, variable
from ..ops.registry import KEEP_DTYPE, make


def all_finite(tensors: Sequence[Optional[Tensor]], name: str = "all_finite") -> Tensor:
    """A bool scalar: true when the step's float status is clear and no tensor holds inf or
    nan (NPUGetFloatStatus over them, as MindSpore's all_finite reads it on Ascend)."""
    present = [t for t in tensors if t is not None]
    if not present:
        raise GraphError("all_finite needs at least one tensor")
    graph = present[0].graph
    with graph.as_default(), graph.name_scope(f"{name}/"):
        status = make("NPUGetFloatStatus", present, name="NPUGetFloatStatus").output(0)
        return equal(status, 0.0, name="is_finite")


def _keep_dtype(t: Tensor) -> Tensor:
    """Mark the op to compute in its declared dtype on the NPU in every precision mode (casts
    always do): the scaling itself must not overflow; the backward it feeds may."""
    t.node.attrs[KEEP_DTYPE] = True
    return t


class LossScaler:
    """The scale as a variable and the three steps around the gradients. `update_attrs` are
    the UpdateLossScale op's rule (fixed, or grow/shrink)."""

    def __init__(self, scale_value: float, update_attrs: dict, name: str = "loss_scale"):
        if not scale_value >= 1:
            raise GraphError(f"{type(self).__name__}: the loss scale must be >= 1, got {scale_value}")
        self.scale_value = float(scale_value)
        self.update_attrs = dict(update_attrs)
        self.name = name
        self.loss_scale: Optional[Tensor] = None          # the variables, once built
        self.last_step_finite: Optional[Tensor] = None
        self._state: List[Tensor] = []
        self._unscaled: List[Tensor] = []

    def _variables(self, graph):
        if self.loss_scale is None:
            with graph.as_default(), graph.name_scope(f"{self.name}/"):
                self.loss_scale = variable("loss_scale", [], init=self.scale_value, trainable=False)
                good = variable("good_steps", [], init="zeros", trainable=False)
                bad = variable("bad_steps", [], init="zeros", trainable=False)
                self.last_step_finite = variable("last_step_finite", [], init="ones",
                                                 trainable=False)
                self._state = [self.loss_scale, good, bad, self.last_step_finite]
        elif self.loss_scale.graph is not graph:
            raise GraphError(f"{type(self).__name__} {self.name!r} belongs to graph "
                             f"{self.loss_scale.graph.name!r}, not {graph.name!r}")
        return self.loss_scale

    def scale(self, loss: Tensor) -> Tensor:
        """loss × scale."""
        graph = loss.graph
        scale = self._variables(graph)
        with graph.as_default(), graph.name_scope(f"{self.name}/"):
            return _keep_dtype(mul(loss, cast(scale, loss.dtype), name="scaled_loss"))

    def unscale(self, grads: Sequence[Optional[Tensor]]) -> List[Optional[Tensor]]:
        """Each gradient ÷ scale (None stays None)."""
        present = [g for g in grads if g is not None]
        if not present:
            raise GraphError("unscale needs at least one gradient")
        graph = present[0].graph
        scale = self._variables(graph)
        with graph.as_default(), graph.name_scope(f"{self.name}/"):
            out = [None if g is None else _keep_dtype(div(g, cast(scale, g.dtype), name="unscale"))
                   for g in grads]
        self._unscaled = [g for g in out if g is not None]
        return out

    def adjust(self, finite: Tensor):
        """The scale's update after the step: shrink on overflow, grow after a clean window
        (dynamic), or only count (static). It runs after the unscaled gradients, which read
        the old scale."""
        graph = finite.graph
        self._variables(graph)
        with graph.as_default(), graph.name_scope(f"{self.name}/"):
            return make("UpdateLossScale", self._state + [finite] + self._unscaled,
                        self.update_attrs, name="UpdateLossScale")


class StaticLossScaler(LossScaler):
    """A constant scale; an overflowing step is still skipped by the gate."""

    def __init__(self, scale_value: float, name: str = "loss_scale"):
        super().__init__(scale_value, {"dynamic": False}, name)


class DynamicLossScaler(LossScaler):
    """MindSpore's: divide by scale_factor on each overflow (not below 1), multiply after
    scale_window finite steps in a row."""

    def __init__(self, scale_value: float = 2.0 ** 16, scale_factor: float = 2.0,
                 scale_window: int = 2000, name: str = "loss_scale"):
        if not (scale_factor > 1 and scale_window >= 1):
            raise GraphError(f"DynamicLossScaler: need scale_factor > 1 and scale_window >= 1, "
                             f"got {scale_factor}, {scale_window}")
        super().__init__(scale_value, {"dynamic": True, "incr_every_n_steps": int(scale_window),
                                       "decr_every_n_nan_or_inf": 1,
                                       "incr_ratio": float(scale_factor),
                                       "decr_ratio": 1.0 / float(scale_factor),
                                       "min_scale": 1.0}, name)


__all__ = ["all_finite", "LossScaler", "StaticLossScaler", "DynamicLossScaler"]
