"""Elementwise arithmetic, comparisons, reductions, matrix products and their gradient ops."""
from __future__ import annotations

import math

import numpy as np

from ..graph import TensorSpec, Tensor
from . import rules
from .registry import CUBE, make, register
from .special import erf


def _t(node):
    return node.output(0)


# -- helpers shared by gradient rules --------------------------------------------------------
def unbroadcast(g: Tensor, x: Tensor, other: Tensor = None) -> Tensor:
    """Sum a broadcast gradient back to the shape of `x`: a no-op unless x was broadcast. An
    unknown dimension of x counts as not broadcast where `other` (the other operand) has no
    dimension or size 1 there."""
    if len(g.shape) == len(x.shape):
        lead = len(g.shape) - len(other.shape) if other is not None else None
        ok = True
        for i, (gd, xd) in enumerate(zip(g.shape, x.shape)):
            if xd is None:
                od = None if lead is None or i < lead else other.shape[i - lead]
                ok = ok and gd is None and lead is not None and (i < lead or od == 1)
            else:
                ok = ok and gd == xd
        if ok:
            return g
    return _t(make("SumToLike", [g, x], name="SumToLike"))


def scalar_like(value, like: Tensor, name="Const") -> Tensor:
    from .array_ops import constant
    return constant(np.asarray(value, dtype=np.float64), dtype=like.dtype, name=name)


def lift(x, like: Tensor) -> Tensor:
    """Python numbers and numpy arrays become Const tensors of `like`'s dtype."""
    if isinstance(x, Tensor):
        return x
    if hasattr(x, "outputs"):
        return x.output(0)
    from .array_ops import constant
    return constant(x, dtype=like.dtype)


def _binary_builder(type_):
    def build(x, y, name=None):
        if not isinstance(x, Tensor) and isinstance(y, Tensor):
            x = lift(x, y)
        y = lift(y, x)
        return _t(make(type_, [x, y], name=name))
    build.__name__ = type_.lower()
    build.__doc__ = f"{type_} with numpy broadcasting."
    return build


def _unary_builder(type_):
    def build(x, name=None):
        return _t(make(type_, [x], name=name))
    build.__name__ = type_.lower()
    build.__doc__ = f"Elementwise {type_}."
    return build


# -- binary arithmetic -----------------------------------------------------------------------
def _grad_add(c):
    x, y = c.x
    return [unbroadcast(c.dy, x, y), unbroadcast(c.dy, y, x)]


def _grad_sub(c):
    x, y = c.x
    return [unbroadcast(c.dy, x, y), unbroadcast(neg(c.dy), y, x)]


def _grad_mul(c):
    x, y = c.x
    return [unbroadcast(mul(c.dy, y), x, y), unbroadcast(mul(c.dy, x), y, x)]


def _grad_div(c):
    x, y = c.x
    out = c.y[0]
    gx = div(c.dy, y)
    gy = neg(mul(gx, out))          # d(x/y)/dy = -(x/y)/y
    return [unbroadcast(gx, x, y), unbroadcast(gy, y, x)]


def _grad_pow(c):
    x, p = c.x
    out = c.y[0]
    # d/dx = p * x^(p-1); d/dp = x^p * log x, defined as 0 where x <= 0 (as TF does)
    gx = mul(c.dy, mul(p, pow_(x, sub(p, scalar_like(1.0, p)))))
    zero = zeros_like(x)
    safe_log = select(greater(x, zero), log(select(greater(x, zero), x, ones_like(x))), zero)
    gp = mul(c.dy, mul(out, safe_log))
    return [unbroadcast(gx, x, p), unbroadcast(gp, p, x)]


def _grad_minmax(pick_x_when):
    def grad(c):
        x, y = c.x
        mask = make(pick_x_when, [x, y]).output(0)
        zero = zeros_like(c.dy)
        return [unbroadcast(select(mask, c.dy, zero), x, y),
                unbroadcast(select(mask, zero, c.dy), y, x)]
    return grad


def _pow_kernel(inputs, attrs, ctx):
    x, p = inputs
    with np.errstate(all="ignore"):
        return np.power(x, p)


def _div_kernel(inputs, attrs, ctx):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.divide(inputs[0], inputs[1])


register("Add", infer=rules.binary, kernel=lambda i, a, c: np.add(i[0], i[1]), grad=_grad_add,
         min_inputs=2, doc="x + y")
register("Sub", infer=rules.binary, kernel=lambda i, a, c: np.subtract(i[0], i[1]),
         grad=_grad_sub, min_inputs=2, doc="x - y")
register("Mul", infer=rules.binary, kernel=lambda i, a, c: np.multiply(i[0], i[1]),
         grad=_grad_mul, min_inputs=2, doc="x * y")
for _div in ("Div", "RealDiv"):
    register(_div, infer=rules.binary_float, kernel=_div_kernel, grad=_grad_div, min_inputs=2,
             doc="x / y on float tensors (IEEE: x/0 is +-inf, 0/0 is nan)")
register("Pow", infer=rules.binary_float, kernel=_pow_kernel, grad=_grad_pow, min_inputs=2,
         doc="x ** y")
register("Maximum", infer=rules.binary, kernel=lambda i, a, c: np.maximum(i[0], i[1]),
         grad=_grad_minmax("GreaterEqual"), min_inputs=2,
         doc="max(x, y); on ties the gradient goes to x")
register("Minimum", infer=rules.binary, kernel=lambda i, a, c: np.minimum(i[0], i[1]),
         grad=_grad_minmax("LessEqual"), min_inputs=2,
         doc="min(x, y); on ties the gradient goes to x")


def _addn_infer(specs, attrs, where):
    dtype = rules.same_dtype(specs, where)
    shape = specs[0].shape
    for s in specs[1:]:
        shape = rules.broadcast_shapes(shape, s.shape, where)
        if len(s.shape) != len(specs[0].shape):
            rules.fail(where, "all inputs must have one shape")
    return [TensorSpec(shape, dtype)]


def _addn_kernel(inputs, attrs, ctx):
    out = inputs[0].copy()
    for x in inputs[1:]:
        out += x
    return out


register("AddN", infer=_addn_infer, kernel=_addn_kernel,
         grad=lambda c: [c.dy] * len(c.x), min_inputs=1, max_inputs=-1,
         doc="sum of N tensors of one shape (sums gradients from several consumers)")

# -- comparisons and select ------------------------------------------------------------------
_COMPARE = {"Equal": np.equal, "NotEqual": np.not_equal, "Greater": np.greater,
            "GreaterEqual": np.greater_equal, "Less": np.less, "LessEqual": np.less_equal}
for _name, _fn in _COMPARE.items():
    register(_name, infer=rules.comparison, kernel=(lambda f: lambda i, a, c: f(i[0], i[1]))(_fn),
             min_inputs=2, doc=f"elementwise {_fn.__name__}, bool result; not differentiable")

_LOGICAL = {"LogicalAnd": (np.logical_and, 2), "LogicalOr": (np.logical_or, 2),
            "LogicalNot": (np.logical_not, 1)}
for _name, (_fn, _n) in _LOGICAL.items():
    register(_name, infer=rules.logical, kernel=(lambda f: lambda i, a, c: f(*i))(_fn),
             min_inputs=_n, doc=f"elementwise {_fn.__name__} of bool tensors; not differentiable")
register("IsNan", infer=rules.float_test, kernel=lambda i, a, c: np.isnan(i[0]), min_inputs=1,
         doc="elementwise isnan, bool result; not differentiable")
register("IsInf", infer=rules.float_test, kernel=lambda i, a, c: _is_inf(i[0], a), min_inputs=1,
         attrs={"detect_positive": True, "detect_negative": True},
         doc="elementwise isinf, bool result, for the signs asked; not differentiable")


def _is_inf(x, attrs):
    return ((x == np.inf) & attrs["detect_positive"]) | ((x == -np.inf) & attrs["detect_negative"])


def _select_infer(specs, attrs, where):
    cond, x, y = specs
    if cond.dtype != "bool":
        rules.fail(where, f"condition must be bool, got {cond}")
    dtype = rules.same_dtype([x, y], where, ("x", "y"))
    shape = rules.broadcast_shapes(x.shape, y.shape, where)
    return [TensorSpec(rules.broadcast_shapes(cond.shape, shape, where, ("condition", "x/y")),
                       dtype)]


def _grad_select(c):
    cond, x, y = c.x
    zero = zeros_like(c.dy)
    return [None, unbroadcast(select(cond, c.dy, zero), x), unbroadcast(select(cond, zero, c.dy), y)]


register("Select", infer=_select_infer, kernel=lambda i, a, c: np.where(i[0], i[1], i[2]),
         grad=_grad_select, min_inputs=3, doc="where(condition, x, y)")

# -- unary -----------------------------------------------------------------------------------
_SQRT_2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _sigmoid(x):
    # exp of a negative argument only, so neither branch overflows
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(x.dtype)


def _gelu(x):
    return (0.5 * x * (1.0 + erf(x / x.dtype.type(_SQRT_2)))).astype(x.dtype)


def _gelu_grad(dy, x):
    cdf = 0.5 * (1.0 + erf(x / x.dtype.type(_SQRT_2)))
    pdf = np.exp(-0.5 * x * x) * x.dtype.type(_INV_SQRT_2PI)
    return (dy * (cdf + x * pdf)).astype(x.dtype)


def _quiet(f):
    with np.errstate(all="ignore"):
        return f()


def _errs(f):
    def kernel(i, a, c):
        with np.errstate(all="ignore"):
            return f(i[0])
    return kernel


register("Neg", infer=rules.unary_numeric, kernel=lambda i, a, c: np.negative(i[0]),
         grad=lambda c: [neg(c.dy)], min_inputs=1, doc="-x")
register("Square", infer=rules.unary_numeric, kernel=lambda i, a, c: np.square(i[0]),
         grad=lambda c: [mul(c.dy, mul(c.x[0], scalar_like(2.0, c.x[0])))], min_inputs=1,
         doc="x * x")
register("Sqrt", infer=rules.unary_float, kernel=_errs(np.sqrt),
         grad=lambda c: [_t(make("SqrtGrad", [c.y[0], c.dy]))], min_inputs=1, doc="sqrt(x)")
register("Rsqrt", infer=rules.unary_float, kernel=_errs(lambda x: 1.0 / np.sqrt(x)),
         grad=lambda c: [_t(make("RsqrtGrad", [c.y[0], c.dy]))], min_inputs=1, doc="1/sqrt(x)")
register("Exp", infer=rules.unary_float, kernel=_errs(np.exp),
         grad=lambda c: [mul(c.dy, c.y[0])], min_inputs=1, doc="e^x")
register("Log", infer=rules.unary_float, kernel=_errs(np.log),
         grad=lambda c: [div(c.dy, c.x[0])], min_inputs=1, doc="natural log")
register("Relu", infer=rules.unary_numeric, kernel=lambda i, a, c: np.maximum(i[0], 0).astype(i[0].dtype),
         grad=lambda c: [_t(make("ReluGrad", [c.dy, c.y[0]]))], min_inputs=1, doc="max(x, 0)")
register("Gelu", infer=rules.unary_float, kernel=lambda i, a, c: _gelu(i[0]),
         grad=lambda c: [_t(make("GeluGrad", [c.dy, c.x[0]]))], min_inputs=1,
         doc="exact GELU: x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2))")
register("Tanh", infer=rules.unary_float, kernel=lambda i, a, c: np.tanh(i[0]),
         grad=lambda c: [_t(make("TanhGrad", [c.y[0], c.dy]))], min_inputs=1, doc="tanh(x)")
register("Sigmoid", infer=rules.unary_float, kernel=lambda i, a, c: _sigmoid(i[0]),
         grad=lambda c: [_t(make("SigmoidGrad", [c.y[0], c.dy]))], min_inputs=1,
         doc="1 / (1 + e^-x), evaluated without overflow")

# Activations that ONNX models carry as one op (TF spells them as several).
register("Erf", infer=rules.unary_float, kernel=lambda i, a, c: erf(i[0]).astype(i[0].dtype),
         grad=lambda c: [mul(c.dy, mul(exp(neg(square(c.x[0]))),
                                      scalar_like(2.0 / math.sqrt(math.pi), c.x[0])))],
         min_inputs=1, doc="the error function")


def _hard_sigmoid_kernel(i, a, c):
    x = i[0]
    y = x * x.dtype.type(a["alpha"]) + x.dtype.type(a["beta"])
    return np.clip(y, 0, 1).astype(x.dtype)


def _grad_hard_sigmoid(c):
    y = c.y[0]
    zero = zeros_like(c.dy)
    inside = select(less(y, scalar_like(1.0, y)), mul(c.dy, scalar_like(c.attrs["alpha"], y)), zero)
    return [select(greater(y, scalar_like(0.0, y)), inside, zero)]


def _grad_clip(c):
    x = c.x[0]
    zero = zeros_like(c.dy)
    g = c.dy
    if c.attrs["clip_min"] is not None:
        g = select(greater_equal(x, scalar_like(c.attrs["clip_min"], x)), g, zero)
    if c.attrs["clip_max"] is not None:
        g = select(less_equal(x, scalar_like(c.attrs["clip_max"], x)), g, zero)
    return [g]


register("HardSigmoid", infer=rules.unary_float, kernel=_hard_sigmoid_kernel, min_inputs=1,
         grad=_grad_hard_sigmoid,
         attrs={"alpha": 0.2, "beta": 0.5}, doc="max(0, min(1, alpha x + beta))")


def _clip_kernel(i, a, c):
    x = i[0]
    lo, hi = a["clip_min"], a["clip_max"]
    out = x
    if lo is not None:
        out = np.maximum(out, np.asarray(lo).astype(x.dtype))
    if hi is not None:
        out = np.minimum(out, np.asarray(hi).astype(x.dtype))
    return np.asarray(out, dtype=x.dtype)    # np.maximum keeps nan, as ONNX's Clip does


register("ClipByValue", infer=rules.unary_numeric, kernel=_clip_kernel, min_inputs=1,
         grad=_grad_clip,
         attrs={"clip_min": None, "clip_max": None},
         doc="min(max(x, clip_min), clip_max); a bound of None is no bound; nan stays nan")

# The TF gradient kernels of the activations: (y, dy) or (dy, x) as TF orders them.
register("ReluGrad", infer=rules.elementwise_grad,
         kernel=lambda i, a, c: np.where(i[1] > 0, i[0], 0).astype(i[0].dtype), min_inputs=2,
         doc="(dy, y) -> dy where y > 0")
register("TanhGrad", infer=rules.elementwise_grad,
         kernel=lambda i, a, c: (i[1] * (1 - i[0] * i[0])).astype(i[0].dtype), min_inputs=2,
         doc="(y, dy) -> dy (1 - y^2)")
register("SigmoidGrad", infer=rules.elementwise_grad,
         kernel=lambda i, a, c: (i[1] * i[0] * (1 - i[0])).astype(i[0].dtype), min_inputs=2,
         doc="(y, dy) -> dy y (1 - y)")
register("SqrtGrad", infer=rules.elementwise_grad,
         kernel=lambda i, a, c: _quiet(lambda: (i[1] * 0.5 / i[0]).astype(i[0].dtype)),
         min_inputs=2, doc="(y, dy) -> dy / (2 y)")
register("RsqrtGrad", infer=rules.elementwise_grad,
         kernel=lambda i, a, c: (i[1] * -0.5 * i[0] * i[0] * i[0]).astype(i[0].dtype), min_inputs=2,
         doc="(y, dy) -> -dy y^3 / 2")
register("GeluGrad", infer=rules.elementwise_grad, kernel=lambda i, a, c: _gelu_grad(i[0], i[1]),
         min_inputs=2, doc="(dy, x) -> dy (Phi(x) + x phi(x))")


# -- reductions ------------------------------------------------------------------------------
def _reduce_infer(specs, attrs, where):
    x = specs[0]
    if x.dtype == "bool":
        rules.fail(where, "cannot reduce a bool tensor")
    axes = rules.normalize_axes(attrs.get("axes"), len(x.shape), where)
    return [TensorSpec(rules.reduced_shape(x.shape, axes, attrs["keep_dims"]), x.dtype)]


def _axes(attrs, x):
    axes = attrs.get("axes")
    return None if axes is None else tuple(a % x.ndim for a in axes) if x.ndim else ()


def _reduce_kernel(fn):
    def kernel(i, a, c):
        x = i[0]
        out = fn(x, axis=_axes(a, x), keepdims=a["keep_dims"])
        return np.asarray(out, dtype=x.dtype)
    return kernel


def _reduce_max_kernel(i, a, c):
    x = i[0]
    if x.size == 0:   # max of nothing is -inf (the identity of max), as ONNX defines it
        axes = _axes(a, x)
        shape = [1 if (axes is None or k in axes) else d for k, d in enumerate(x.shape)]
        out = np.full(shape, -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min, x.dtype)
        return out if a["keep_dims"] else out.reshape(
            [d for k, d in enumerate(x.shape) if not (axes is None or k in axes)])
    return _reduce_kernel(np.max)(i, a, c)


def _broadcast_back(c, mean: bool, value=None):
    """A reduction's result (default: its gradient) broadcast back to the input's shape."""
    return _t(make("BroadcastLike", [c.dy if value is None else value, c.x[0]],
                   {"axes": c.attrs.get("axes"), "keep_dims": c.attrs["keep_dims"], "mean": mean}))


def _grad_reduce_max(c):
    x = c.x[0]
    hits = cast(equal(x, _broadcast_back(c, False, c.y[0])), x.dtype)
    ties = _broadcast_back(c, False, reduce_sum(hits, c.attrs.get("axes"),
                                                keep_dims=c.attrs["keep_dims"]))
    return [div(mul(hits, _broadcast_back(c, mean=False)), ties)]   # ties share the gradient


_REDUCE_ATTRS = {"axes": None, "keep_dims": False}
register("ReduceSum", infer=_reduce_infer, kernel=_reduce_kernel(np.sum),
         grad=lambda c: [_broadcast_back(c, mean=False)], min_inputs=1, attrs=_REDUCE_ATTRS,
         doc="sum over axes (all when axes is None)")
register("ReduceMean", infer=_reduce_infer, kernel=_reduce_kernel(np.mean),
         grad=lambda c: [_broadcast_back(c, mean=True)], min_inputs=1, attrs=_REDUCE_ATTRS,
         doc="mean over axes (all when axes is None); nan for an empty reduction")
register("ReduceMax", infer=_reduce_infer, kernel=_reduce_max_kernel, grad=_grad_reduce_max,
         min_inputs=1, attrs=_REDUCE_ATTRS,
         doc="max over axes; -inf for an empty reduction; tied maxima share the gradient")


def _sum_to_like_kernel(i, a, c):
    g, like = i
    target = like.shape
    lead = g.ndim - len(target)
    axes = tuple(range(lead)) + tuple(lead + k for k, d in enumerate(target)
                                      if d == 1 and g.shape[lead + k] != 1)
    out = g.sum(axis=axes, keepdims=True) if axes else g
    return out.reshape(target).astype(g.dtype)


def _broadcast_like_kernel(i, a, c):
    g, like = i
    axes = _axes(a, like)
    axes = tuple(range(like.ndim)) if axes is None else axes
    if not a["keep_dims"]:
        g = g.reshape([1 if k in axes else d for k, d in enumerate(like.shape)])
    out = np.broadcast_to(g, like.shape)
    if a["mean"]:
        count = int(np.prod([like.shape[k] for k in axes])) if axes else 1
        out = out / g.dtype.type(count) if count else out
    return np.array(out, dtype=g.dtype)   # a copy; ascontiguousarray would make 0-d 1-d


register("SumToLike", infer=rules.like_second, kernel=_sum_to_like_kernel, min_inputs=2,
         shape_inputs=(1,),
         doc="(g, x): sum a broadcast gradient g down to x's shape (TF's Sum+Reshape pair)")
register("BroadcastLike", infer=rules.like_second, kernel=_broadcast_like_kernel, min_inputs=2,
         shape_inputs=(1,),
         attrs={"axes": None, "keep_dims": False, "mean": False},
         doc="(g, x): broadcast a reduction's gradient back to x's shape, divided by the "
             "reduced count when mean is set")

# -- matrix products -------------------------------------------------------------------------
def _matmul_infer(specs, attrs, where):
    a, b = specs
    rules.same_dtype(specs, where, ("a", "b"))
    rules.require_float(a, where, "a")
    rules.require_rank(a, 2, where, "a")
    rules.require_rank(b, 2, where, "b")
    m, k = a.shape[::-1] if attrs["transpose_a"] else a.shape
    k2, n = b.shape[::-1] if attrs["transpose_b"] else b.shape
    if not rules.dims_equal(k, k2):
        rules.fail(where, f"inner dimensions differ: a is {a} (transpose_a={attrs['transpose_a']}), "
                          f"b is {b} (transpose_b={attrs['transpose_b']})")
    return [TensorSpec((m, n), a.dtype)]


def _matmul_kernel(i, a, c):
    x, y = i
    return np.matmul(x.T if a["transpose_a"] else x, y.T if a["transpose_b"] else y)


def _grad_matmul(c):
    a, b = c.x
    ta, tb = c.attrs["transpose_a"], c.attrs["transpose_b"]
    g = c.dy
    if not ta and not tb:
        return [matmul(g, b, transpose_b=True), matmul(a, g, transpose_a=True)]
    if not ta and tb:
        return [matmul(g, b), matmul(g, a, transpose_a=True)]
    if ta and not tb:
        return [matmul(b, g, transpose_b=True), matmul(a, g)]
    return [matmul(b, g, transpose_a=True, transpose_b=True),
            matmul(g, a, transpose_a=True, transpose_b=True)]


register("MatMul", infer=_matmul_infer, kernel=_matmul_kernel, grad=_grad_matmul, unit=CUBE,
         min_inputs=2, attrs={"transpose_a": False, "transpose_b": False},
         doc="2-D matrix product, optionally transposing either side")


def _bmm_infer(specs, attrs, where):
    x, y = specs
    rules.same_dtype(specs, where, ("x", "y"))
    rules.require_float(x, where, "x")
    if len(x.shape) < 3 or len(y.shape) < 3:
        rules.fail(where, f"inputs must have rank >= 3, got {x} and {y}")
    m, k = x.shape[-1:-3:-1] if attrs["adj_x"] else x.shape[-2:]
    k2, n = y.shape[-1:-3:-1] if attrs["adj_y"] else y.shape[-2:]
    if not rules.dims_equal(k, k2):
        rules.fail(where, f"inner dimensions differ: x is {x} (adj_x={attrs['adj_x']}), "
                          f"y is {y} (adj_y={attrs['adj_y']})")
    batch = rules.broadcast_shapes(x.shape[:-2], y.shape[:-2], where, ("x batch", "y batch"))
    return [TensorSpec(batch + (m, n), x.dtype)]


def _bmm_kernel(i, a, c):
    x, y = i
    return np.matmul(np.swapaxes(x, -1, -2) if a["adj_x"] else x,
                     np.swapaxes(y, -1, -2) if a["adj_y"] else y)


def _grad_bmm(c):
    x, y = c.x
    ax, ay = c.attrs["adj_x"], c.attrs["adj_y"]
    g = c.dy
    if not ax and not ay:
        gx, gy = batch_matmul(g, y, adj_y=True), batch_matmul(x, g, adj_x=True)
    elif not ax and ay:
        gx, gy = batch_matmul(g, y), batch_matmul(g, x, adj_x=True)
    elif ax and not ay:
        gx, gy = batch_matmul(y, g, adj_y=True), batch_matmul(x, g)
    else:
        gx, gy = (batch_matmul(y, g, adj_x=True, adj_y=True),
                  batch_matmul(g, x, adj_x=True, adj_y=True))
    return [unbroadcast(gx, x), unbroadcast(gy, y)]


register("BatchMatMul", infer=_bmm_infer, kernel=_bmm_kernel, grad=_grad_bmm, unit=CUBE,
         min_inputs=2, attrs={"adj_x": False, "adj_y": False},
         doc="batched matrix product over the last two axes, batch axes broadcast")


# -- bias ------------------------------------------------------------------------------------
def _bias_axis(attrs, rank):
    return 1 if attrs["data_format"] == "NCHW" and rank > 1 else rank - 1


def _bias_add_infer(specs, attrs, where):
    x, b = specs
    rules.same_dtype(specs, where, ("value", "bias"))
    rules.require_rank(b, 1, where, "bias")
    if attrs["data_format"] not in ("NHWC", "NCHW"):
        rules.fail(where, f"data_format must be NHWC or NCHW, got {attrs['data_format']!r}")
    if not x.shape:
        rules.fail(where, "value must have rank >= 1")
    axis = _bias_axis(attrs, len(x.shape))
    if not rules.dims_equal(x.shape[axis], b.shape[0]):
        rules.fail(where, f"bias of {b} does not match channel axis {axis} of value {x}")
    return [x]


def _bias_add_kernel(i, a, c):
    x, b = i
    axis = _bias_axis(a, x.ndim)
    return x + b.reshape([-1 if k == axis else 1 for k in range(x.ndim)])


def _bias_grad_infer(specs, attrs, where):
    g = specs[0]
    return [TensorSpec((g.shape[_bias_axis(attrs, len(g.shape))],), g.dtype)]


def _bias_grad_kernel(i, a, c):
    g = i[0]
    axis = _bias_axis(a, g.ndim)
    return g.sum(axis=tuple(k for k in range(g.ndim) if k != axis)).astype(g.dtype)


register("BiasAdd", infer=_bias_add_infer, kernel=_bias_add_kernel, min_inputs=2,
         grad=lambda c: [c.dy, _t(make("BiasAddGrad", [c.dy], {"data_format": c.attrs["data_format"]}))],
         attrs={"data_format": "NHWC"}, doc="value + bias along the channel axis (last, or 1 in NCHW)")
register("BiasAddGrad", infer=_bias_grad_infer, kernel=_bias_grad_kernel, min_inputs=1,
         attrs={"data_format": "NHWC"}, doc="sum of dy over all but the channel axis")


# -- builders --------------------------------------------------------------------------------
add = _binary_builder("Add")
sub = subtract = _binary_builder("Sub")
mul = multiply = _binary_builder("Mul")
div = divide = _binary_builder("RealDiv")
pow_ = _binary_builder("Pow")
maximum = _binary_builder("Maximum")
minimum = _binary_builder("Minimum")
equal = _binary_builder("Equal")
not_equal = _binary_builder("NotEqual")
greater = _binary_builder("Greater")
greater_equal = _binary_builder("GreaterEqual")
less = _binary_builder("Less")
less_equal = _binary_builder("LessEqual")
logical_and = _binary_builder("LogicalAnd")
logical_or = _binary_builder("LogicalOr")
logical_not = _unary_builder("LogicalNot")
is_nan = _unary_builder("IsNan")
neg = negative = _unary_builder("Neg")
square = _unary_builder("Square")
sqrt = _unary_builder("Sqrt")
rsqrt = _unary_builder("Rsqrt")
exp = _unary_builder("Exp")
log = _unary_builder("Log")
relu = _unary_builder("Relu")
gelu = _unary_builder("Gelu")
tanh = _unary_builder("Tanh")
sigmoid = _unary_builder("Sigmoid")
erf_ = _unary_builder("Erf")


def hard_sigmoid(x, alpha=0.2, beta=0.5, name=None):
    return _t(make("HardSigmoid", [x], {"alpha": float(alpha), "beta": float(beta)}, name=name))


def clip_by_value(x, clip_min=None, clip_max=None, name=None):
    return _t(make("ClipByValue", [x], {"clip_min": None if clip_min is None else float(clip_min),
                                        "clip_max": None if clip_max is None else float(clip_max)},
                   name=name))


def add_n(tensors, name=None):
    return _t(make("AddN", list(tensors), name=name))


def select(condition, x, y, name=None):
    """where(condition, x, y); numbers are lifted to x's (or y's) dtype."""
    if not isinstance(x, Tensor):
        x = lift(x, y)
    y = lift(y, x)
    return _t(make("Select", [condition, x, y], name=name))


where = select


def _reduce_builder(type_):
    def build(x, axis=None, keep_dims=False, name=None):
        axes = None if axis is None else ([axis] if isinstance(axis, int) else list(axis))
        return _t(make(type_, [x], {"axes": axes, "keep_dims": bool(keep_dims)}, name=name))
    build.__name__ = type_
    build.__doc__ = f"{type_} over `axis` (int, list, or None for all axes)."
    return build


reduce_sum = _reduce_builder("ReduceSum")
reduce_mean = _reduce_builder("ReduceMean")
reduce_max = _reduce_builder("ReduceMax")


def matmul(a, b, transpose_a=False, transpose_b=False, name=None):
    return _t(make("MatMul", [a, b], {"transpose_a": transpose_a, "transpose_b": transpose_b},
                   name=name))


def batch_matmul(x, y, adj_x=False, adj_y=False, name=None):
    return _t(make("BatchMatMul", [x, y], {"adj_x": adj_x, "adj_y": adj_y}, name=name))


def bias_add(value, bias, data_format="NHWC", name=None):
    return _t(make("BiasAdd", [value, bias], {"data_format": data_format}, name=name))


def zeros_like(x, name=None):
    return _t(make("ZerosLike", [x], name=name))


def ones_like(x, name=None):
    return _t(make("OnesLike", [x], name=name))


def cast(x, dtype, name=None):
    from .array_ops import cast as _cast
    return _cast(x, dtype, name=name)
