"""torch.amp.GradScaler's decisions, seen while the debugger runs: the loss before it was
scaled (scale()), and per update the scale the step used, the next one and whether the
gradients were finite (update()): the step history's loss scale columns, as a graph run's
loss-scale manager fills them. The class's two methods are wrapped while the debugger is
started and restored when it stops (a script's own scaler is never replaced or changed)."""
from __future__ import annotations

from typing import Callable, Optional

import torch


def _found_inf(scaler) -> Optional[bool]:
    """Whether the step's unscale found inf/nan (None where this torch keeps it elsewhere)."""
    states = getattr(scaler, "_per_optimizer_states", None)
    try:
        return any(float(v) != 0 for state in states.values()
                   for v in state.get("found_inf_per_device", {}).values())
    except (AttributeError, TypeError):
        return None


def _set_scale(scaler, value: float, device) -> None:
    """The scaler's scale set to `value` (its private tensor, made first where the scaler
    has not scaled yet), outside the debugger's function mode: no call of the step."""
    with torch.no_grad(), torch._C.DisableTorchFunction():
        if getattr(scaler, "_scale", None) is None:
            scaler._lazy_init_scale_growth_tracker(device)
        scaler._scale.fill_(value)


class ScalerWatch:
    """Wraps GradScaler.scale and .update: on_scale(loss tensor) before a scalar loss is
    scaled, on_update(scale used, next scale, finite) after each update. overflowed (the
    simulated NPU's): whether the step's status word is set; the scaler's unscale then
    finds an overflow whatever the gradients hold, as torch_npu's reads the device's flag
    (in saturation mode an overflow leaves no inf in them to find): raise_flag(found_inf)
    sets it."""

    def __init__(self, on_scale: Callable, on_update: Callable,
                 overflowed: Optional[Callable[[], bool]] = None,
                 raise_flag: Optional[Callable] = None):
        # a scale to set before the next scale() (a step started from the NPU's state)
        self.scale_to: Optional[float] = None
        cls = self.cls = torch.amp.GradScaler
        self.scale0, self.update0 = cls.scale, cls.update
        scale0, update0 = self.scale0, self.update0
        self.unscale0 = getattr(cls, "_unscale_grads_", None)
        unscale0 = self.unscale0

        def unscale_grads(scaler, *args, **kwargs):
            found = unscale0(scaler, *args, **kwargs)
            if overflowed() and isinstance(found, dict):
                for flag in found.values():
                    raise_flag(flag)
            return found
        if overflowed is not None and unscale0 is not None:
            cls._unscale_grads_ = unscale_grads

        def scale(scaler, outputs):
            if scaler.is_enabled() and isinstance(outputs, torch.Tensor) and \
                    outputs.numel() == 1:
                if self.scale_to is not None:
                    _set_scale(scaler, self.scale_to, outputs.device)
                    self.scale_to = None
                on_scale(outputs)
            return scale0(scaler, outputs)

        def update(scaler, new_scale=None):
            if not scaler.is_enabled():
                return update0(scaler, new_scale)
            before, found = float(scaler.get_scale()), _found_inf(scaler)
            update0(scaler, new_scale)
            after = float(scaler.get_scale())
            on_update(before, after, (after >= before) if found is None else not found)
        cls.scale, cls.update = scale, update

    def remove(self) -> None:
        self.cls.scale, self.cls.update = self.scale0, self.update0
        if self.unscale0 is not None:
            self.cls._unscale_grads_ = self.unscale0
