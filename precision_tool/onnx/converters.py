"""One rule per ONNX op type: the node's inputs and attributes -> the ops that compute it.

A rule names its main op after the node (`c.name`) and helper ops under it (`c.sub(...)`), and
raises Unsupported, with the reason, for attribute values our ops do not compute. Shapes are
fixed at import time, so shape arithmetic is done here in numpy, not in the graph.
"""
from __future__ import annotations

import numpy as np

from .. import ops
from ..graph import dtypes
from ..ops.math_ops import clip_by_value, erf_, hard_sigmoid
from ..ops.array_ops import broadcast_to
from ..ops.nn_ops import resolve_pads
from .importer import Context, Unsupported

RULES = {}


def rule(*names):
    def deco(fn):
        for n in names:
            RULES[n] = fn
        return fn
    return deco


def _float_dtype(c: Context, k: int) -> str:
    dt = c.dtype(k)
    if np.dtype(dt).kind != "f" and dt != "bfloat16":
        raise Unsupported(f"{dt} input {k} (the op is float-only here)")
    return dt


def _operand(c: Context, k: int, like: str):
    """Input k as a tensor; a constant one takes the other operand's dtype, as exports mix a
    float32 scalar into an fp16 model."""
    if c.is_static(k):
        arr = c.static(k)
        if arr.dtype != np.dtype(like) and arr.dtype.kind == np.dtype(like).kind:
            return ops.constant(arr.astype(like), dtype=like, name=c.sub(f"const{k}"))
    return c.tensor(k)


# -- elementwise -----------------------------------------------------------------------------
_BINARY = {"Add": ops.add, "Sub": ops.sub, "Mul": ops.mul, "Div": ops.div, "Pow": ops.pow_,
           "Equal": ops.equal, "Greater": ops.greater, "GreaterOrEqual": ops.greater_equal,
           "Less": ops.less, "LessOrEqual": ops.less_equal}


def _running_dtype(c: Context) -> str:
    """The dtype of the first input computed at run time (else of input 0)."""
    for k in range(c.n_inputs):
        if c.has(k) and not c.is_static(k):
            return c.dtype(k)
    return c.dtype(0)


@rule(*_BINARY)
def _binary(c: Context):
    like = _running_dtype(c)
    if {c.dtype(0), c.dtype(1)} - {like}:
        if c.type == "Pow" and np.dtype(like).kind == "f":
            pass                                   # an integer exponent: cast below
        elif not (c.is_static(0) or c.is_static(1)):
            raise Unsupported(f"mixed input dtypes {c.dtype(0)} and {c.dtype(1)}")
    if c.type in ("Div", "Pow") and np.dtype(c.dtype(0)).kind != "f":
        raise Unsupported(f"{c.type} on integers")   # the base's dtype is the result's
    if c.type == "Add" and not c.is_static(0) and c.is_static(1):
        bias = c.static(1)
        x_shape = c.shape(0)
        # x + b over the last axis is a BiasAdd, as TF writes it, so that MatMul + Add fuses
        if bias.ndim == 1 and len(x_shape) >= 2 and bias.shape[0] == x_shape[-1] > 1:
            return [ops.bias_add(c.tensor(0), _operand(c, 1, like), name=c.name)]
    x, y = _operand(c, 0, like), _operand(c, 1, like)
    if c.type == "Pow" and y.dtype != x.dtype:
        y = ops.cast(y, x.dtype, name=c.sub("Cast"))
    return [_BINARY[c.type](x, y, name=c.name)]


@rule("Max", "Min", "Sum")
def _variadic(c: Context):
    like = _running_dtype(c)
    xs = [_operand(c, k, like) for k in range(c.n_inputs)]
    if c.type == "Sum":
        return [ops.add_n(xs, name=c.name) if len(xs) > 1 else ops.identity(xs[0], name=c.name)]
    fn = ops.maximum if c.type == "Max" else ops.minimum
    if len(xs) == 1:
        return [ops.identity(xs[0], name=c.name)]
    out = xs[0]
    for k, x in enumerate(xs[1:], 1):
        out = fn(out, x, name=c.name if k == len(xs) - 1 else c.sub(f"{c.type}_{k}"))
    return [out]


_UNARY = {"Neg": ops.neg, "Sqrt": ops.sqrt, "Exp": ops.exp, "Log": ops.log, "Relu": ops.relu,
          "Tanh": ops.tanh, "Sigmoid": ops.sigmoid, "Identity": ops.identity, "Erf": erf_}


@rule(*_UNARY)
def _unary(c: Context):
    if c.type not in ("Neg", "Relu", "Identity"):
        _float_dtype(c, 0)
    return [_UNARY[c.type](c.tensor(0), name=c.name)]


_LOGICAL = {"And": ops.logical_and, "Or": ops.logical_or, "Xor": ops.not_equal}


@rule(*_LOGICAL)
def _logical(c: Context):
    return [_LOGICAL[c.type](c.tensor(0), c.tensor(1), name=c.name)]


@rule("Not")
def _not(c: Context):
    return [ops.logical_not(c.tensor(0), name=c.name)]


@rule("IsNaN")
def _is_nan(c: Context):
    _float_dtype(c, 0)
    return [ops.is_nan(c.tensor(0), name=c.name)]


@rule("IsInf")
def _is_inf(c: Context):
    _float_dtype(c, 0)
    attrs = {"detect_positive": bool(c.attrs.get("detect_positive", 1)),
             "detect_negative": bool(c.attrs.get("detect_negative", 1))}
    return [ops.make("IsInf", [c.tensor(0)], attrs, name=c.name).output(0)]


@rule("Reciprocal")
def _reciprocal(c: Context):
    x = c.tensor(0)
    _float_dtype(c, 0)
    return [ops.div(1.0, x, name=c.name)]


@rule("Gelu")
def _gelu(c: Context):
    approximate = c.attrs.get("approximate", "none")
    if approximate == "tanh":
        return [ops.make("FastGelu", [c.tensor(0)], name=c.name).output(0)]
    return [ops.gelu(c.tensor(0), name=c.name)]


@rule("HardSigmoid")
def _hard_sigmoid(c: Context):
    return [hard_sigmoid(c.tensor(0), c.attrs.get("alpha", 0.2), c.attrs.get("beta", 0.5),
                         name=c.name)]


@rule("HardSwish")
def _hard_swish(c: Context):
    x = c.tensor(0)
    return [ops.mul(x, hard_sigmoid(x, 1 / 6, 0.5, name=c.sub("HardSigmoid")), name=c.name)]


@rule("Clip")
def _clip(c: Context):
    bounds = []
    for k in (1, 2):
        if c.has(k):
            value = c.static(k)
            bounds.append(float(value.reshape(-1)[0]) if value.size else None)
        else:
            bounds.append(None)
    return [clip_by_value(c.tensor(0), bounds[0], bounds[1], name=c.name)]


@rule("Softmax", "LogSoftmax")
def _softmax(c: Context):
    fn = ops.softmax if c.type == "Softmax" else ops.log_softmax
    return [fn(c.tensor(0), c.attrs.get("axis", -1), name=c.name)]


@rule("Where")
def _where(c: Context):
    like = c.dtype(1) if not c.is_static(1) or c.is_static(2) else c.dtype(2)
    return [ops.select(c.tensor(0), _operand(c, 1, like), _operand(c, 2, like), name=c.name)]


@rule("Cast")
def _cast(c: Context):
    from onnx import helper
    to = str(helper.tensor_dtype_to_np_dtype(c.attrs["to"]))
    if to not in dtypes.ALL_DTYPES:
        raise Unsupported(f"a cast to {to}")
    return [ops.cast(c.tensor(0), to, name=c.name)]


# -- reductions ------------------------------------------------------------------------------
def _reduce_axes(c: Context):
    if c.has(1):
        return [int(a) for a in c.static(1)]
    return c.attrs.get("axes")


@rule("ReduceSum", "ReduceMean", "ReduceMax")
def _reduce(c: Context):
    if c.dtype(0) == "bool":
        raise Unsupported("reducing a bool tensor")
    axes = _reduce_axes(c)
    keep = bool(c.attrs.get("keepdims", 1))
    if not axes:
        if c.attrs.get("noop_with_empty_axes", 0):
            return [ops.identity(c.tensor(0), name=c.name)]
        axes = None
    fn = {"ReduceSum": ops.reduce_sum, "ReduceMean": ops.reduce_mean,
          "ReduceMax": ops.reduce_max}[c.type]
    return [fn(c.tensor(0), axes, keep_dims=keep, name=c.name)]


@rule("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(c: Context):
    rank = len(c.shape(0))
    fn = ops.reduce_mean if c.type == "GlobalAveragePool" else ops.reduce_max
    return [fn(c.tensor(0), list(range(2, rank)), keep_dims=True, name=c.name)]


# -- shapes ----------------------------------------------------------------------------------
def _reshape_to(c: Context, shape):
    return [ops.reshape(c.tensor(0), [int(d) for d in shape], name=c.name)]


@rule("Reshape")
def _reshape(c: Context):
    shape = [int(d) for d in c.static(1)]
    in_shape = c.shape(0)
    if not c.attrs.get("allowzero", 0):
        shape = [in_shape[k] if d == 0 else d for k, d in enumerate(shape)]  # 0 copies the dim
    return _reshape_to(c, shape)


@rule("Flatten")
def _flatten(c: Context):
    shape = c.shape(0)
    axis = c.attrs.get("axis", 1) % (len(shape) or 1) if shape else 0
    return _reshape_to(c, [int(np.prod(shape[:axis])), int(np.prod(shape[axis:]))])


@rule("Squeeze")
def _squeeze(c: Context):
    shape = c.shape(0)
    axes = [int(a) % len(shape) for a in c.static(1)] if c.has(1) else \
        [k for k, d in enumerate(shape) if d == 1]
    return _reshape_to(c, [d for k, d in enumerate(shape) if k not in axes])


@rule("Unsqueeze")
def _unsqueeze(c: Context):
    shape = list(c.shape(0))
    rank = len(shape) + len(c.static(1))
    for a in sorted(int(a) % rank for a in c.static(1)):
        shape.insert(a, 1)
    return _reshape_to(c, shape)


@rule("Transpose")
def _transpose(c: Context):
    return [ops.transpose(c.tensor(0), c.attrs.get("perm"), name=c.name)]


@rule("Concat")
def _concat(c: Context):
    like = _running_dtype(c)
    return [ops.concat([_operand(c, k, like) for k in range(c.n_inputs)], c.attrs["axis"],
                       name=c.name)]


@rule("Expand")
def _expand(c: Context):
    return [broadcast_to(c.tensor(0), [int(d) for d in c.static(1)], name=c.name)]


@rule("Gather")
def _gather(c: Context):
    return [ops.gather(c.tensor(0), c.tensor(1), c.attrs.get("axis", 0), name=c.name)]


def _gather_flat(c: Context, lead: int, flat: np.ndarray):
    """x[...] at the flat positions `flat` of its first `lead` axes (the rest kept), as one
    Gather on x reshaped to [prod(lead axes), rest...]: GatherND and GatherElements with
    indices fixed at import time, which exports use for masks and position ids."""
    shape = c.shape(0)
    rows = ops.reshape(c.tensor(0), [int(np.prod(shape[:lead], dtype=np.int64))] + list(shape[lead:]),
                       name=c.sub("rows"))
    index = ops.constant(flat.astype(np.int64), dtype="int64", name=c.sub("index"))
    return ops.gather(rows, index, 0, name=c.name)


def _flat_index(coords: np.ndarray, dims) -> np.ndarray:
    """Row-major positions of coordinates (last axis of coords), negative ones counted from
    the end as ONNX allows; Unsupported when one is out of range."""
    dims = np.asarray(dims, dtype=np.int64)
    coords = np.where(coords < 0, coords + dims, coords)
    if coords.size and ((coords < 0) | (coords >= dims)).any():
        raise Unsupported("an index out of range")
    return np.ravel_multi_index(tuple(np.moveaxis(coords, -1, 0)), tuple(int(d) for d in dims)) \
        if coords.shape[-1] else np.zeros(coords.shape[:-1], np.int64)


@rule("GatherND")
def _gather_nd(c: Context):
    if c.attrs.get("batch_dims", 0):
        raise Unsupported("batch_dims other than 0")
    index = c.static(1).astype(np.int64)
    depth = index.shape[-1]
    return [_gather_flat(c, depth, _flat_index(index, c.shape(0)[:depth]))]


@rule("GatherElements")
def _gather_elements(c: Context):
    shape = c.shape(0)
    axis = c.attrs.get("axis", 0) % len(shape)
    index = c.static(1).astype(np.int64)
    coords = np.stack(np.indices(index.shape), axis=-1)
    coords[..., axis] = index
    return [_gather_flat(c, len(shape), _flat_index(coords, shape))]


def _slice_window(shape, starts, ends, axes, steps):
    begin, size = [0] * len(shape), list(shape)
    for s, e, a, st in zip(starts, ends, axes, steps):
        if int(st) != 1:
            raise Unsupported("slice steps other than 1")
        a = int(a) % len(shape)
        n = shape[a]
        s = min(max(int(s) + n if s < 0 else int(s), 0), n)   # ONNX clamps out-of-range bounds
        e = min(max(int(e) + n if e < 0 else int(e), 0), n)
        begin[a], size[a] = s, max(e - s, 0)
    return begin, size


@rule("Slice")
def _slice(c: Context):
    starts, ends = c.static(1), c.static(2)
    axes = c.static(3) if c.has(3) else np.arange(len(starts))
    steps = c.static(4) if c.has(4) else np.ones(len(starts), int)
    begin, size = _slice_window(c.shape(0), starts, ends, axes, steps)
    return [ops.slice_(c.tensor(0), begin, size, name=c.name)]


@rule("Split")
def _split(c: Context):
    shape = c.shape(0)
    axis = c.attrs.get("axis", 0) % len(shape)
    n_out = len(c.node.output)
    if c.has(1):
        sizes = [int(s) for s in c.static(1)]
    elif "split" in c.attrs:
        sizes = [int(s) for s in c.attrs["split"]]
    else:
        step = -(-shape[axis] // n_out)               # ceil: the last part may be smaller
        sizes = [min(step, shape[axis] - k * step) for k in range(n_out)]
    x, outs, start = c.tensor(0), [], 0
    for k, size in enumerate(sizes):
        begin = [0] * len(shape)
        begin[axis] = start
        sz = list(shape)
        sz[axis] = size
        outs.append(ops.slice_(x, begin, sz, name=c.name if k == 0 else c.sub(f"part{k}")))
        start += size
    return outs


# -- matrix products -------------------------------------------------------------------------
def _matmul(c: Context, a, b, name):
    sa, sb = tuple(a.shape), tuple(b.shape)
    if len(sa) < 2 or len(sb) < 2:
        raise Unsupported("1-D operands")
    if len(sa) == 2 and len(sb) == 2:
        return ops.matmul(a, b, name=name)
    if len(sb) == 2:
        # [..., K] @ [K, N]: one MatMul over the flattened rows (as ATC compiles it), so that a
        # following bias Add fuses
        rows = int(np.prod(sa[:-1]))
        flat = ops.reshape(a, [rows, sa[-1]], name=c.sub("flatten"))
        out = ops.matmul(flat, b, name=name)
        return ops.reshape(out, list(sa[:-1]) + [sb[-1]], name=c.sub("unflatten"))
    if sa[:-2] != sb[:-2]:
        raise Unsupported(f"batch dimensions {list(sa[:-2])} and {list(sb[:-2])} that differ")
    if len(sa) == 3:
        return ops.batch_matmul(a, b, name=name)
    batch = int(np.prod(sa[:-2]))
    a3 = ops.reshape(a, [batch] + list(sa[-2:]), name=c.sub("a3d"))
    b3 = ops.reshape(b, [batch] + list(sb[-2:]), name=c.sub("b3d"))
    out = ops.batch_matmul(a3, b3, name=name)
    return ops.reshape(out, list(sa[:-2]) + [sa[-2], sb[-1]], name=c.sub("unflatten"))


@rule("MatMul")
def _matmul_rule(c: Context):
    like = _running_dtype(c)
    return [_matmul(c, _operand(c, 0, like), _operand(c, 1, like), c.name)]


@rule("Gemm")
def _gemm(c: Context):
    like = _running_dtype(c)
    a, b = _operand(c, 0, like), _operand(c, 1, like)
    alpha, beta = c.attrs.get("alpha", 1.0), c.attrs.get("beta", 1.0)
    main = c.name if not c.has(2) and alpha == 1.0 else c.sub("MatMul")
    y = ops.matmul(a, b, transpose_a=bool(c.attrs.get("transA", 0)),
                   transpose_b=bool(c.attrs.get("transB", 0)), name=main)
    if alpha != 1.0:
        y = ops.mul(y, float(alpha), name=c.name if not c.has(2) else c.sub("alpha"))
    if c.has(2):
        bias = _operand(c, 2, like)
        if beta != 1.0:
            bias = ops.mul(bias, float(beta), name=c.sub("beta"))
        if len(bias.shape) == 1 and bias.shape[0] == y.shape[-1]:
            y = ops.bias_add(y, bias, name=c.name)
        else:
            y = ops.add(y, bias, name=c.name)
    return [y]


# -- convolution, pooling, normalisation -----------------------------------------------------
def _pads(c: Context, kernel, strides):
    if len(kernel) != 2:
        raise Unsupported(f"{len(kernel)}-D windows (ours are 2-D)")
    auto = c.attrs.get("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        t, b, l, r = resolve_pads("SAME", c.shape(0)[2:], kernel, strides)
        return [t, b, l, r] if auto == "SAME_UPPER" else [b, t, r, l]
    if auto == "VALID":
        return [0, 0, 0, 0]
    p = c.attrs.get("pads", [0, 0, 0, 0])
    return [p[0], p[2], p[1], p[3]]   # ONNX [h_begin, w_begin, h_end, w_end]


@rule("Conv")
def _conv(c: Context):
    kernel = list(c.attrs.get("kernel_shape", c.shape(1)[2:]))
    if any(d != 1 for d in c.attrs.get("dilations", [1] * len(kernel))):
        raise Unsupported("dilations other than 1")
    strides = list(c.attrs.get("strides", [1] * len(kernel)))
    pads = _pads(c, kernel, strides)
    like = _running_dtype(c)
    attrs = {"strides": strides, "pads": pads, "groups": int(c.attrs.get("group", 1))}
    x, w = c.tensor(0), _operand(c, 1, like)
    if not c.has(2):
        return [ops.make("Conv2D", [x, w], attrs, name=c.name).output(0)]
    y = ops.make("Conv2D", [x, w], attrs, name=c.sub("Conv2D")).output(0)
    return [ops.bias_add(y, _operand(c, 2, like), data_format="NCHW", name=c.name)]


@rule("MaxPool", "AveragePool")
def _pool(c: Context):
    kernel = list(c.attrs["kernel_shape"])
    c.refuse(ceil_mode=0, storage_order=0)
    if any(d != 1 for d in c.attrs.get("dilations", [1] * len(kernel))):
        raise Unsupported("dilations other than 1")
    if len(c.node.output) > 1 and c.node.output[1]:
        raise Unsupported("the argmax (Indices) output")
    strides = list(c.attrs.get("strides", [1] * len(kernel)))
    attrs = {"ksize": kernel, "strides": strides, "pads": _pads(c, kernel, strides),
             "count_include_pad": bool(c.attrs.get("count_include_pad", 0))}
    op = "MaxPool" if c.type == "MaxPool" else "AvgPool"
    return [ops.make(op, [c.tensor(0)], attrs, name=c.name).output(0)]


@rule("BatchNormalization")
def _batch_norm(c: Context):
    if c.attrs.get("training_mode", 0):
        raise Unsupported("training_mode=1 (an imported model runs inference)")
    like = _running_dtype(c)
    node = ops.batch_norm(c.tensor(0), *[_operand(c, k, like) for k in range(1, 5)],
                          epsilon=c.attrs.get("epsilon", 1e-5), is_training=False, name=c.name)
    return [node.output(0)]


@rule("LayerNormalization")
def _layer_norm(c: Context):
    """Written out as TF's LayerNorm (mean, centre, square, mean, + eps, rsqrt, scale, shift),
    the pattern the NPU's LayerNormFusionPass fuses; the last op carries the node's name.
    The statistics are over the axes from `axis` on; the Mean and InvStdDev outputs are the
    helper ops that compute them."""
    rank = len(c.shape(0))
    axes = list(range(c.attrs.get("axis", -1) % rank, rank))
    like = _running_dtype(c)
    x = c.tensor(0)
    eps = float(c.attrs.get("epsilon", 1e-5))
    mean = ops.reduce_mean(x, axes, keep_dims=True, name=c.sub("mean"))
    centred = ops.sub(x, mean, name=c.sub("centred"))
    var = ops.reduce_mean(ops.square(centred, name=c.sub("square")), axes, keep_dims=True,
                          name=c.sub("variance"))
    inv = ops.rsqrt(ops.add(var, eps, name=c.sub("add_eps")), name=c.sub("rsqrt"))
    normed = ops.mul(centred, inv, name=c.sub("normalized"))
    scaled = ops.mul(normed, _operand(c, 1, like), name=c.sub("scale"))
    if c.has(2):
        out = ops.add(scaled, _operand(c, 2, like), name=c.name)
    else:
        out = ops.identity(scaled, name=c.name)
    return [out, mean, inv]


@rule("Dropout")
def _dropout(c: Context):
    if c.has(2) and bool(c.static(2)):
        raise Unsupported("training_mode=1 (an imported model runs inference)")
    # in inference the mask keeps every element: a constant, as ONNX defines it
    return [ops.identity(c.tensor(0), name=c.name), np.ones(c.shape(0), dtype=bool)]


@rule("LRN")
def _lrn(c: Context):
    """AlexNet's local response normalisation, x / (bias + alpha / size * sum of x^2 over the
    channels around)^beta, the channel window summed by a 1x1 convolution with a fixed band
    of ones (the cube unit, as the device would)."""
    shape = c.shape(0)
    if len(shape) != 4:
        raise Unsupported(f"{len(shape)}-D input (NCHW only)")
    dt = _float_dtype(c, 0)
    size = int(c.attrs["size"])
    ch = shape[1]
    lo, hi = (size - 1) // 2, -(-(size - 1) // 2)
    band = np.zeros((ch, ch, 1, 1), dtype=dt)
    for k in range(ch):
        band[k, max(0, k - lo):min(ch, k + hi + 1), 0, 0] = 1
    x = c.tensor(0)
    squares = ops.square(x, name=c.sub("square"))
    window = ops.constant(band, dtype=dt, name=c.sub("band"))
    sums = ops.make("Conv2D", [squares, window], {"strides": [1, 1], "pads": [0, 0, 0, 0]},
                    name=c.sub("window_sum")).output(0)
    scaled = ops.add(ops.mul(sums, float(c.attrs.get("alpha", 1e-4)) / size, name=c.sub("alpha")),
                     float(c.attrs.get("bias", 1.0)), name=c.sub("bias"))
    denom = ops.pow_(scaled, float(c.attrs.get("beta", 0.75)), name=c.sub("pow"))
    return [ops.div(x, denom, name=c.name)]


# -- values known at import time (used when a node could not be folded) ----------------------
@rule("Shape")
def _shape(c: Context):
    shape = np.array(c.shape(0), dtype=np.int64)
    start, end = c.attrs.get("start", 0), c.attrs.get("end", len(shape))
    return [shape[start:end]]


@rule("Size")
def _size(c: Context):
    return [np.array(int(np.prod(c.shape(0))), dtype=np.int64)]


@rule("Constant")
def _constant(c: Context):
    from onnx import numpy_helper
    for key in ("value", "value_float", "value_floats", "value_int", "value_ints"):
        if key in c.attrs:
            v = c.attrs[key]
            return [numpy_helper.to_array(v) if key == "value" else np.asarray(
                v, dtype=np.float32 if "float" in key else np.int64)]
    raise Unsupported(f"a {sorted(c.attrs)} Constant")


@rule("ConstantOfShape")
def _constant_of_shape(c: Context):
    from onnx import numpy_helper
    value = numpy_helper.to_array(c.attrs["value"]) if "value" in c.attrs else \
        np.zeros(1, np.float32)
    return [np.full([int(d) for d in c.static(0)], value.reshape(-1)[0], value.dtype)]
