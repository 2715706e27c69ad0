"""API calls the device runs as one fused kernel where torch runs them as composite ops: torch
takes `F.rms_norm` apart above the dispatcher (pow, mean, rsqrt, mul), so the simulated NPU
never sees one RMS norm kernel. While its fusion pass is on, the NPU run calls these ops
instead (simulate.SimulatedNPU.call): each is one kernel the dispatch mode sees, and computes
with the fused kernel's numerics (ops.fused_ops' RmsNorm); with the pass off the call runs
as torch takes it apart. The golden never calls them: it is the script as written.

Outside the simulated NPU the ops compute as torch's composite does (in float32, the result
in the input's dtype), so a call made without the mode (a fake tensor, a test) is torch's."""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor


def _dims(x: Tensor, normalized_shape) -> tuple:
    return tuple(range(x.dim() - len(normalized_shape), x.dim()))


def row_shape(x: Tensor, normalized_shape) -> tuple:
    """The shape of a norm's per-row statistics (mean, rstd): x's with the normalised
    dims kept as 1."""
    return tuple(x.shape[:x.dim() - len(normalized_shape)]) + (1,) * len(normalized_shape)


@torch.library.custom_op("precision_tool::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, normalized_shape: List[int], weight: Optional[Tensor],
              eps: float) -> Tuple[Tensor, Tensor]:
    """(y, rstd): rstd float32 and of x's rows' shape, as Ascend's RmsNorm gives it."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(_dims(x, normalized_shape), keepdim=True) + eps)
    y = xf * rstd
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype), rstd


@_rms_norm.register_fake
def _(x, normalized_shape, weight, eps):
    return torch.empty_like(x), x.new_empty(row_shape(x, normalized_shape),
                                            dtype=torch.float32)


@torch.library.custom_op("precision_tool::rms_norm_backward", mutates_args=())
def _rms_norm_backward(grad: Tensor, x: Tensor, normalized_shape: List[int], rstd: Tensor,
                       weight: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """(grad of x, grad of the weight: zeros of no shape without one), in float32 inside:
    with xhat = x rstd and g = grad w, dx = rstd (g - xhat mean(g xhat)), dw = sum(grad xhat)
    over the rows."""
    dims = _dims(x, normalized_shape)
    xhat = x.float() * rstd
    g = grad.float() * (weight.float() if weight is not None else 1.0)
    grad_x = rstd * (g - xhat * (g * xhat).mean(dims, keepdim=True))
    if weight is None:
        return grad_x.to(x.dtype), x.new_zeros(())
    rows = tuple(range(x.dim() - len(normalized_shape)))
    grad_w = (grad.float() * xhat).sum(rows) if rows else grad.float() * xhat
    return grad_x.to(x.dtype), grad_w.to(weight.dtype)


@_rms_norm_backward.register_fake
def _(grad, x, normalized_shape, rstd, weight):
    return torch.empty_like(x), torch.empty_like(weight) if weight is not None else \
        x.new_empty(())


def _setup(ctx, inputs, output):
    x, normalized_shape, weight, _ = inputs
    ctx.normalized_shape = normalized_shape
    ctx.save_for_backward(x, output[1], weight)


def _backward(ctx, grad_y, grad_rstd):
    x, rstd, weight = ctx.saved_tensors
    grad_x, grad_w = torch.ops.precision_tool.rms_norm_backward(
        grad_y, x, ctx.normalized_shape, rstd, weight)
    return grad_x, None, grad_w if weight is not None else None, None


_rms_norm.register_autograd(_backward, setup_context=_setup)


def rms_norm(input: Tensor, normalized_shape, weight: Optional[Tensor] = None,
             eps: Optional[float] = None) -> Tensor:
    """F.rms_norm's signature and result, as one kernel. eps None: the dtype's machine
    epsilon, as torch's."""
    shape = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
    if eps is None:
        eps = torch.finfo(input.dtype).eps
    if not shape or math.prod(shape) == 0 or list(input.shape[input.dim() - len(shape):]) != shape:
        # torch's own error for a shape that does not fit (and nothing to fuse when empty)
        return torch.nn.functional.rms_norm(input, normalized_shape, weight, eps)
    return torch.ops.precision_tool.rms_norm(input, shape, weight, float(eps))[0]


# the API calls (as the script calls them) -> (the fusion pass, the call as one kernel)
FUSED_CALLS = {torch.nn.functional.rms_norm: ("RmsNormFusionPass", rms_norm),
               torch.rms_norm: ("RmsNormFusionPass", rms_norm)}
