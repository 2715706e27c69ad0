"""Op types that exist only in compiled NPU graphs: the fused kernels of the fusion passes,
TransData, and the float-status and loss-scale ops.

A fused kernel computes every tensor of the pattern it replaces (its *roles*) and returns
the ones the node exposes (attrs.roles, the first being the pattern's result). Its numerics
are its own, stated beside each kernel: inner steps round to the compute dtype through
`ctx.round` (a no-op in an fp32 run), reductions accumulate in fp32.
"""
from __future__ import annotations

import math

import numpy as np

from .. import numerics
from ..graph import TensorSpec
from . import rules
from .math_ops import _bmm_infer, _bmm_kernel, _matmul_infer, _matmul_kernel
from .nn_ops import _conv_infer, _conv_kernel
from .registry import CUBE, get, register


def _roles_infer(role_specs):
    """infer from {role: spec function of the input specs}, for the roles the node exposes."""
    def infer(specs, attrs, where):
        unknown = [r for r in attrs["roles"] if r not in role_specs]
        if unknown:
            rules.fail(where, f"unknown roles {unknown}; known: {sorted(role_specs)}")
        return [role_specs[r](specs, attrs) for r in attrs["roles"]]
    return infer


def _pick(values: dict, attrs):
    return [values[r] for r in attrs["roles"]]


# -- LayerNormFusionPass ---------------------------------------------------------------------
def _layer_norm_kernel(i, a, c):
    """Variance as E[x^2] - E[x]^2 in the compute dtype (one pass over x, as the fused kernel
    reads it once): catastrophic cancellation when |mean| >> std, and x^2 overflows fp16 once
    |x| > 255.9."""
    x, gamma, beta = i
    r = c.round
    mean = r(x.mean(axis=-1, keepdims=True))
    mean_sq = r(r(x * x).mean(axis=-1, keepdims=True))
    variance = r(mean_sq - r(mean * mean))
    var_eps = r(variance + x.dtype.type(a["epsilon"]))
    with np.errstate(invalid="ignore", divide="ignore"):   # a negative variance gives nan
        inv = r((1.0 / np.sqrt(var_eps)).astype(x.dtype))
    centered = r(x - mean)
    normalized = r(centered * inv)
    scaled = r(normalized * gamma)
    values = {"mean": mean, "centered": centered, "variance": variance, "var_eps": var_eps,
              "inv": inv, "normalized": normalized, "scaled": scaled, "y": r(scaled + beta)}
    if "square" in a["roles"]:
        values["square"] = r(centered * centered)
    return _pick(values, a)


def _same(specs, attrs):
    return specs[0]


def _row(specs, attrs):
    return TensorSpec(specs[0].shape[:-1] + (1,), specs[0].dtype)


register("LayerNorm", kernel=_layer_norm_kernel, min_inputs=3,
         infer=_roles_infer({"y": _same, "mean": _row, "centered": _same, "square": _same,
                             "variance": _row, "var_eps": _row, "inv": _row,
                             "normalized": _same, "scaled": _same}),
         attrs={"epsilon": 1e-5, "roles": ["y"]},
         doc="fused LayerNorm over the last axis: (x, gamma, beta); LayerNormFusionPass")


# -- RmsNormFusionPass -----------------------------------------------------------------------
def _rms_norm_kernel(i, a, c):
    """The squares, their mean and the reciprocal root in float32, whatever the compute dtype
    (the fused kernel, Ascend's RmsNorm, reads x once, accumulates in fp32 and gives its rstd
    in fp32): no x^2 to overflow fp16 beyond |x| = 255.9 or to flush below 2.4e-4, as the
    unfused Square does in fp16; y rounded once, at the end."""
    wide = np.promote_types(np.asarray(i[0]).dtype, np.float32)     # float64 stays
    x, gamma = (np.asarray(v, wide) for v in i[:2])
    square = x * x
    mean_square = square.mean(axis=-1, keepdims=True, dtype=wide)
    var_eps = mean_square + wide.type(a["epsilon"])
    with np.errstate(divide="ignore"):
        inv = (1.0 / np.sqrt(var_eps)).astype(wide)
    normalized = x * inv
    values = {"y": normalized * gamma, "square": square, "mean_square": mean_square,
              "var_eps": var_eps, "inv": inv, "normalized": normalized}
    return _pick(values, a)


register("RmsNorm", kernel=_rms_norm_kernel, min_inputs=2,
         infer=_roles_infer({"y": _same, "square": _same, "mean_square": _row, "var_eps": _row,
                             "inv": _row, "normalized": _same}),
         attrs={"epsilon": 1e-6, "roles": ["y"]},
         doc="fused RMSNorm over the last axis: (x, gamma); RmsNormFusionPass")


# -- SoftmaxFusionPass -----------------------------------------------------------------------
def _softmax_v2_kernel(i, a, c):
    """In fp16/bf16 the fused kernel skips the max subtraction: exp(x) overflows fp16 once a
    logit exceeds ln 65504 = 11.09. In fp32 it subtracts the max as the unfused op does."""
    x = i[0]
    axis = a["axis"]
    z = x - x.max(axis=axis, keepdims=True) if c.low is None else x
    e = c.round(np.exp(z))
    with np.errstate(invalid="ignore", divide="ignore"):
        return [c.round(e / e.sum(axis=axis, keepdims=True))]


register("SoftmaxV2", kernel=_softmax_v2_kernel, min_inputs=1,
         infer=_roles_infer({"y": _same}), attrs={"axis": -1, "roles": ["y"]},
         doc="fused softmax; SoftmaxFusionPass")


# -- GeluFusionPass --------------------------------------------------------------------------
_GELU_C = math.sqrt(2.0 / math.pi)


def _fast_gelu_kernel(i, a, c):
    """The tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), computed in
    fp32 and rounded once: up to ~5e-4 from the exact erf GELU of the graph."""
    x = i[0]
    return [0.5 * x * (1.0 + np.tanh(x.dtype.type(_GELU_C) * (x + x.dtype.type(0.044715) * x * x * x)))]


register("FastGelu", kernel=_fast_gelu_kernel, min_inputs=1,
         infer=_roles_infer({"y": _same}), attrs={"roles": ["y"]},
         doc="GELU by the tanh approximation; GeluFusionPass")


# -- MatMulBiasAddFusionPass and BatchMatMulFusionPass ---------------------------------------
def _accumulator_op(type_, n_inputs, base_kernel, base_infer, epilogue, raw_role, attrs, doc):
    """A cube op whose epilogue (bias, scale) works on the fp32 accumulator before the one
    rounding of the output; the product before the epilogue is the `raw_role` output."""
    def kernel(i, a, c):
        acc = base_kernel(i[:2], a, c)
        values = {"y": epilogue(acc, i, a)}
        if raw_role in a["roles"]:
            values[raw_role] = c.round(acc)
        return _pick(values, a)

    def spec(specs, a):
        return base_infer(specs[:2], a, type_)[0]

    register(type_, kernel=kernel, min_inputs=n_inputs, unit=CUBE, infer=_roles_infer({"y": spec, raw_role: spec}),
             attrs={**attrs, "roles": ["y"]}, doc=doc)


_accumulator_op("MatMulV2", 3, _matmul_kernel, _matmul_infer,
                lambda acc, i, a: acc + i[2], "matmul",
                {"transpose_a": False, "transpose_b": False},
                "(a, b, bias): MatMul with the bias added in the fp32 accumulator, one rounding "
                "instead of two; MatMulBiasAddFusionPass")
_accumulator_op("BatchMatMulV2", 2, _bmm_kernel, _bmm_infer,
                lambda acc, i, a: acc * acc.dtype.type(a["alpha"]), "batch_matmul",
                {"adj_x": False, "adj_y": False, "alpha": 1.0},
                "(x, y): BatchMatMul followed by a scalar Mul, scaled in the fp32 accumulator "
                "before the one rounding; BatchMatMulFusionPass")


# -- ConvBatchNormFusionPass (inference) -----------------------------------------------------
def _conv_bn_kernel(i, a, c):
    """BatchNorm folded into the convolution: w' = w * scale / sqrt(var + eps) is rounded to
    the compute dtype (a folded weight can lose what the separate ops keep), and
    b' = offset - mean * scale / sqrt(var + eps) is added in the accumulator."""
    x, f, scale, offset, mean, var = i
    k = scale / np.sqrt(var + x.dtype.type(a["epsilon"]))
    folded = c.round(f * k.reshape(-1, 1, 1, 1))
    acc = _conv_kernel([x, folded], a, c)
    values = {"y": acc + (offset - mean * k).reshape(1, -1, 1, 1), "batch_mean": mean.copy(),
              "batch_variance": var.copy()}
    if "conv" in a["roles"]:
        values["conv"] = c.round(_conv_kernel([x, f], a, c))
    return _pick(values, a)


def _conv_bn_spec(specs, attrs):
    return _conv_infer(specs[:2], attrs, "Conv2DBatchNorm")[0]


def _channel(specs, attrs):
    return specs[4]


register("Conv2DBatchNorm", kernel=_conv_bn_kernel, min_inputs=6, unit=CUBE,
         infer=_roles_infer({"y": _conv_bn_spec, "conv": _conv_bn_spec,
                             "batch_mean": _channel, "batch_variance": _channel}),
         attrs={"strides": [1, 1], "pads": [0, 0, 0, 0], "data_format": "NCHW", "groups": 1,
                "epsilon": 1e-5, "roles": ["y"]}, five_hd=((0,), (0,)),
         doc="(x, filter, scale, offset, mean, variance): inference BatchNorm folded into "
             "Conv2D; ConvBatchNormFusionPass")


# -- UB fusion -------------------------------------------------------------------------------
def _fused_eltwise_kernel(i, a, c):
    """Runs its elementwise steps in fp32 in the unified buffer: intermediates are not rounded
    to the compute dtype between steps, only the exposed results are; an fp32 overflow of a
    step still shows in the status word (KernelContext.inner)."""
    env = {f"in:{k}": v for k, v in enumerate(i)}
    for k, step in enumerate(a["steps"]):
        op = get(step["type"])
        out = op.kernel([env[ref] for ref in step["inputs"]], step["attrs"], c)
        env[f"step:{k}"] = c.inner(out[0] if isinstance(out, list) else out)
    return [env[a["role_steps"][r]] for r in a["roles"]]


def _fused_eltwise_infer(specs, attrs, where):
    env = {f"in:{k}": s for k, s in enumerate(specs)}
    for k, step in enumerate(attrs["steps"]):
        op = get(step["type"])
        full = dict(op.attrs)
        full.update(step["attrs"])
        env[f"step:{k}"] = op.infer([env[ref] for ref in step["inputs"]], full, where)[0]
    return [env[attrs["role_steps"][r]] for r in attrs["roles"]]


register("FusedEltwise", kernel=_fused_eltwise_kernel, infer=_fused_eltwise_infer,
         min_inputs=1, max_inputs=-1, attrs={"steps": [], "role_steps": {}, "roles": ["y"]},
         doc="elementwise ops fused into one kernel; TbeEltwiseFusionPass and "
             "TbeMultiOutputFusionPass")


# -- TransData -------------------------------------------------------------------------------
def _trans_data_kernel(i, a, c):
    x = i[0]
    if a["dst_format"] == "NC1HWC0":
        return numerics.nchw_to_5hd(x)
    return numerics.five_hd_to_nchw(x, (x.shape[0],) + tuple(a["original_shape"][1:]))


def _trans_data_infer(specs, attrs, where):
    x = specs[0]
    if attrs["dst_format"] == "NC1HWC0":
        rules.require_rank(x, 4, where, "input (NCHW)")
        if None in x.shape[1:]:
            rules.fail(where, f"NC1HWC0 needs static C, H and W, got {x}")
        device = (x.shape[0],) + numerics.five_hd_shape((1,) + x.shape[1:])[1:]
        return [TensorSpec(device, x.dtype, "NC1HWC0", x.shape)]
    original = attrs["original_shape"]
    if original is None or len(original) != 4:
        rules.fail(where, "NC1HWC0 -> NCHW needs the original NCHW shape")
    return [TensorSpec((x.shape[0],) + tuple(original[1:]), x.dtype)]


register("TransData", kernel=_trans_data_kernel, infer=_trans_data_infer, min_inputs=1,
         attrs={"src_format": "ND", "dst_format": "NC1HWC0", "original_shape": None},
         doc="data format conversion NCHW <-> NC1HWC0 (C0 = 16, channels zero-padded)")


# -- float status and loss scaling -----------------------------------------------------------
def _get_status_kernel(i, a, c):
    """The OR of the status words of this step's kernels so far; an input holding inf or nan
    counts as an overflow too (that is all a CPU golden run can see)."""
    status = c.float_status
    if any(x.dtype.kind == "f" and not np.isfinite(x).all() for x in i):
        status |= numerics.STATUS_FLOAT_OVERFLOW
    return np.asarray(float(status), dtype=c.float_dtype)


def _clear_status_kernel(i, a, c):
    c.float_status = 0
    return np.asarray(0.0, dtype=c.float_dtype)


register("NPUGetFloatStatus", kernel=_get_status_kernel, min_inputs=0, max_inputs=-1,
         infer=lambda s, a, w: [TensorSpec((), "float32")],
         doc="(tensors to wait for) -> the step's float status word so far, as float32")
register("NPUClearFloatStatus", kernel=_clear_status_kernel, min_inputs=0, max_inputs=-1,
         infer=lambda s, a, w: [TensorSpec((), "float32")],
         doc="resets the step's float status (every step starts cleared)")


def _update_scale_infer(specs, attrs, where):
    if specs[4].dtype != "bool" or specs[4].shape != ():
        rules.fail(where, f"the finite flag must be a bool scalar, got {specs[4]}")
    return list(specs[:4])


def _update_scale_kernel(i, a, c):
    """(scale, good_steps, bad_steps, last_finite, finite): skip-and-shrink on overflow,
    grow after a clean window, as TF's ExponentialUpdateLossScaleManager."""
    scale, good, bad, _, finite = i[:5]
    t = scale.dtype.type
    scale, good, bad = float(scale), float(good), float(bad)
    if bool(finite):
        good, bad = good + 1, 0.0
        if a["dynamic"] and good >= a["incr_every_n_steps"]:
            grown = scale * a["incr_ratio"]
            scale = grown if math.isfinite(grown) and grown <= a["max_scale"] else scale
            good = 0.0
    else:
        good, bad = 0.0, bad + 1
        if a["dynamic"] and bad >= a["decr_every_n_nan_or_inf"]:
            scale = max(scale * a["decr_ratio"], a["min_scale"])
            bad = 0.0
    return [np.asarray(v, dtype=t) for v in (scale, good, bad, 1.0 if bool(finite) else 0.0)]


register("UpdateLossScale", kernel=_update_scale_kernel, infer=_update_scale_infer,
         updates=(0, 1, 2, 3), min_inputs=5, max_inputs=-1,
         attrs={"dynamic": True, "incr_every_n_steps": 2000, "decr_every_n_nan_or_inf": 1,
                "incr_ratio": 2.0, "decr_ratio": 0.5, "min_scale": 1.0, "max_scale": 2.0 ** 64},
         doc="(scale, good_steps, bad_steps, last_finite, finite, *after): the loss-scale "
             "manager's state update after a step; it runs after the `after` tensors (the "
             "unscaled gradients, which read the old scale)")
