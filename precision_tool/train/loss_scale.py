"""Loss scaling as graph ops, as the TF adapter and MindSpore build it.

`LossScaleOptimizer(optimizer, manager).minimize(loss)` scales the loss, differentiates,
reads the step's float status (NPUGetFloatStatus: the OR of the AI Core status words so far,
or any inf/nan in the gradients), unscales the gradients, applies the updates only when the
step was finite (the update ops' gate), and updates the manager's state (UpdateLossScale).
After each step `loss_scale` holds the current scale and `last_step_finite` 1 or 0.

Managers:
- FixedLossScaleManager(loss_scale): constant scale; an overflowing step is skipped.
- DynamicLossScaleManager(init_loss_scale=2**24, scale_factor=2, scale_window=2000):
  MindSpore's; halve on every overflow (not below 1), double after scale_window clean steps.
- ExponentialUpdateLossScaleManager(init_loss_scale, incr_every_n_steps,
  decr_every_n_nan_or_inf=2, incr_ratio=2, decr_ratio=0.8): the TF adapter's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import GraphError
from ..graph import Tensor, split_tensor_name
from ..ops.registry import updated_inputs
from .amp import LossScaler, all_finite
from .autodiff import gradients
from .optimizers import Optimizer, trainable_variables


@dataclass(frozen=True)
class FixedLossScaleManager:
    loss_scale: float = 1.0

    def update_attrs(self):
        return {"dynamic": False}

    @property
    def initial_scale(self):
        return self.loss_scale


@dataclass(frozen=True)
class ExponentialUpdateLossScaleManager:
    init_loss_scale: float = 2.0 ** 24
    incr_every_n_steps: int = 2000
    decr_every_n_nan_or_inf: int = 2
    incr_ratio: float = 2.0
    decr_ratio: float = 0.8
    min_scale: float = 1.0

    def __post_init__(self):
        if not (self.init_loss_scale >= 1 and self.incr_every_n_steps >= 1
                and self.decr_every_n_nan_or_inf >= 1 and self.incr_ratio > 1
                and 0 < self.decr_ratio < 1):
            raise GraphError(f"{type(self).__name__}: need init_loss_scale >= 1, step counts >= 1, "
                             f"incr_ratio > 1 and 0 < decr_ratio < 1; got {self}")

    def update_attrs(self):
        return {"dynamic": True, "incr_every_n_steps": int(self.incr_every_n_steps),
                "decr_every_n_nan_or_inf": int(self.decr_every_n_nan_or_inf),
                "incr_ratio": float(self.incr_ratio), "decr_ratio": float(self.decr_ratio),
                "min_scale": float(self.min_scale)}

    @property
    def initial_scale(self):
        return self.init_loss_scale


def DynamicLossScaleManager(init_loss_scale: float = 2.0 ** 24, scale_factor: float = 2.0,
                            scale_window: int = 2000) -> ExponentialUpdateLossScaleManager:
    """MindSpore's dynamic manager: halve on each overflow, grow after a clean window."""
    return ExponentialUpdateLossScaleManager(init_loss_scale, scale_window, 1, scale_factor,
                                             1.0 / scale_factor)


class LossScaleOptimizer:
    """Wraps an optimizer with loss scaling; see the module doc."""

    def __init__(self, optimizer: Optimizer, manager=None):
        self.optimizer = optimizer
        self.manager = manager if manager is not None else DynamicLossScaleManager()
        self.loss_scale: Tensor = None
        self.last_step_finite: Tensor = None
        self.is_finite: Tensor = None

    def minimize(self, loss: Tensor, var_list=None, name=None):
        variables = list(var_list) if var_list is not None else trainable_variables(loss.graph)
        scaler = LossScaler(self.manager.initial_scale, self.manager.update_attrs())
        grads = scaler.unscale(gradients(scaler.scale(loss), variables))
        finite = all_finite(grads, name="loss_scale")
        step = self.optimizer.apply_gradients(list(zip(grads, variables)), gate=finite,
                                              name=name, extra=[scaler.adjust(finite)])
        self.loss_scale, self.last_step_finite = scaler.loss_scale, scaler.last_step_finite
        self.is_finite = finite
        return step


def loss_scale_variable(graph) -> Optional[str]:
    """The variable holding the loss scale (the first input an UpdateLossScale overwrites),
    or None when the graph has no loss scaling."""
    for node in graph.nodes:
        if node.type == "UpdateLossScale" and 0 in updated_inputs(node.type):
            return split_tensor_name(node.inputs[0])[0]
    return None
