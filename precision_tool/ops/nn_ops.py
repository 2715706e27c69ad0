"""Neural-network ops: softmax family, the cross-entropy loss, Conv2D, pooling, BatchNorm,
Dropout, and their gradient kernels. Image tensors are NCHW, filters OIHW."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..graph import TensorSpec, dtypes
from . import rules
from .array_ops import reshape
from .math_ops import exp, mul, reduce_sum, sub
from .registry import CUBE, make, register


def _t(node):
    return node.output(0)


# -- softmax family --------------------------------------------------------------------------
def _axis_infer(specs, attrs, where):
    rules.require_float(specs[0], where)
    rules.normalize_axis(attrs["axis"], len(specs[0].shape), where)
    return [specs[0]]


def _softmax(x, axis):
    z = x - x.max(axis=axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=axis, keepdims=True)


def _log_softmax(x, axis):
    z = x - x.max(axis=axis, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=axis, keepdims=True))


def _grad_softmax(c):
    y, axis = c.y[0], c.attrs["axis"]
    return [mul(sub(c.dy, reduce_sum(mul(c.dy, y), axis, keep_dims=True)), y)]


def _grad_log_softmax(c):
    y, axis = c.y[0], c.attrs["axis"]
    return [sub(c.dy, mul(exp(y), reduce_sum(c.dy, axis, keep_dims=True)))]


register("Softmax", infer=_axis_infer, kernel=lambda i, a, c: _softmax(i[0], a["axis"]),
         grad=_grad_softmax, min_inputs=1, attrs={"axis": -1},
         doc="exp(x - max) / sum(exp(x - max)) along axis")
register("LogSoftmax", infer=_axis_infer, kernel=lambda i, a, c: _log_softmax(i[0], a["axis"]),
         grad=_grad_log_softmax, min_inputs=1, attrs={"axis": -1},
         doc="x - max - log(sum(exp(x - max))) along axis")


def _sce_infer(specs, attrs, where):
    logits, labels = specs
    rules.require_float(logits, where, "logits")
    rules.require_rank(logits, 2, where, "logits")
    rules.require_rank(labels, 1, where, "labels")
    if labels.dtype not in dtypes.INT_DTYPES:
        rules.fail(where, f"labels must be integer class ids, got {labels}")
    if not rules.dims_equal(logits.shape[0], labels.shape[0]):
        rules.fail(where, f"logits {logits} and labels {labels} differ in batch size")
    return [TensorSpec(logits.shape[:1], logits.dtype), logits]


def _sce_kernel(i, a, c):
    logits, labels = i
    n_class = logits.shape[1]
    if labels.size and (labels.min() < 0 or labels.max() >= n_class):
        bad = labels[(labels < 0) | (labels >= n_class)][0]
        raise ValueError(f"label {int(bad)} is outside [0, {n_class})")
    logp = _log_softmax(logits, 1)
    rows = np.arange(logits.shape[0])
    loss = -logp[rows, labels]
    backprop = np.exp(logp)
    backprop[rows, labels] -= 1
    return [loss.astype(logits.dtype), backprop.astype(logits.dtype)]


def _grad_sce(c):
    if c.dys[1] is not None:
        rules.fail(rules.where_of(c.node), "the backprop output is not differentiable")
    return [mul(reshape(c.dy, [-1, 1]), c.y[1]), None]


register("SparseSoftmaxCrossEntropyWithLogits", infer=_sce_infer, kernel=_sce_kernel,
         grad=_grad_sce, min_inputs=2,
         doc="(logits[N,C], labels[N]) -> (loss[N] = -log softmax[label], backprop = softmax - onehot)")


# -- windows (shared by Conv2D and pooling) --------------------------------------------------
def _pair(v):
    return [int(v), int(v)] if isinstance(v, (int, np.integer)) else [int(x) for x in v]


def resolve_pads(padding, in_hw, kernel_hw, strides):
    """'SAME' (extra padding at the end, as TF and ONNX SAME_UPPER), 'VALID' or [t, b, l, r]."""
    if isinstance(padding, str):
        if padding.upper() == "VALID":
            return [0, 0, 0, 0]
        if padding.upper() != "SAME":
            raise ValueError(f"padding must be 'SAME', 'VALID' or [top, bottom, left, right], "
                             f"got {padding!r}")
        pads = []
        for size, k, s in zip(in_hw, kernel_hw, strides):
            if size is None:
                raise ValueError("SAME padding needs static height and width")
            out = -(-size // s)
            total = max((out - 1) * s + k - size, 0)
            pads += [total // 2, total - total // 2]
        return pads
    pads = [int(p) for p in padding]
    if len(pads) != 4 or min(pads) < 0:
        raise ValueError(f"pads must be [top, bottom, left, right] >= 0, got {padding!r}")
    return pads


def _out_dim(size, k, s, p0, p1, where):
    if size is None:
        return None
    span = size + p0 + p1 - k
    if span < 0:
        rules.fail(where, f"window {k} is larger than the padded input {size + p0 + p1}")
    return span // s + 1


def _window_geometry(x_shape, k_hw, attrs, where):
    strides = attrs["strides"]
    pads = attrs["pads"]
    if len(strides) != 2 or min(strides) < 1 or len(pads) != 4 or min(pads) < 0:
        rules.fail(where, f"strides {strides} and pads {pads} must be 2 positive and 4 non-negative ints")
    oh = _out_dim(x_shape[2], k_hw[0], strides[0], pads[0], pads[1], where)
    ow = _out_dim(x_shape[3], k_hw[1], strides[1], pads[2], pads[3], where)
    return oh, ow


def _pad(x, pads, value=0.0):
    t, b, l, r = pads
    if not any(pads):
        return x
    return np.pad(x, ((0, 0), (0, 0), (t, b), (l, r)), constant_values=value)


def _windows(xp, kh, kw, strides):
    """(N, C, OH, OW, kh, kw) view of a padded NCHW tensor."""
    v = sliding_window_view(xp, (kh, kw), axis=(2, 3))
    return v[:, :, ::strides[0], ::strides[1]]


def _scatter_windows(x_shape, pads, kh, kw, strides, contribution):
    """Sum contribution(i, j) -> (N, C, OH, OW) into the input positions each window reads."""
    n, ch, h, w = x_shape
    t, b, l, r = pads
    first = contribution(0, 0)
    out = np.zeros((n, ch, h + t + b, w + l + r), dtype=first.dtype)
    oh, ow = first.shape[2], first.shape[3]
    sh, sw = strides
    for i in range(kh):
        for j in range(kw):
            out[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw] += \
                first if (i, j) == (0, 0) else contribution(i, j)
    return out[:, :, t:t + h, l:l + w]


# -- Conv2D ----------------------------------------------------------------------------------
_CONV_ATTRS = {"strides": [1, 1], "pads": [0, 0, 0, 0], "data_format": "NCHW", "groups": 1}


def _conv_infer(specs, attrs, where):
    x, f = specs
    rules.same_dtype(specs, where, ("input", "filter"))
    rules.require_float(x, where)
    rules.require_rank(x, 4, where, "input (NCHW)")
    rules.require_rank(f, 4, where, "filter (OIHW)")
    if attrs["data_format"] != "NCHW":
        rules.fail(where, f"only NCHW is supported, got {attrs['data_format']!r}")
    groups = attrs.get("groups", 1)
    if groups < 1 or f.shape[0] % groups:
        rules.fail(where, f"groups={groups} must divide the {f.shape[0]} output channels")
    if not rules.dims_equal(x.shape[1], None if f.shape[1] is None else f.shape[1] * groups):
        rules.fail(where, f"input channels of {x} differ from filter {f} (OIHW) times "
                          f"groups={groups}")
    oh, ow = _window_geometry(x.shape, f.shape[2:], attrs, where)
    return [TensorSpec((x.shape[0], f.shape[0], oh, ow), x.dtype)]


def _im2col(x, f_shape, attrs):
    kh, kw = f_shape[2], f_shape[3]
    win = _windows(_pad(x, attrs["pads"]), kh, kw, attrs["strides"])
    n, ch, oh, ow = win.shape[:4]
    cols = win.transpose(0, 2, 3, 1, 4, 5).reshape(n * oh * ow, ch * kh * kw)
    return cols, (n, oh, ow)


def _per_group(kernel, split, join_axis):
    """A grouped convolution's kernel: the plain one on each group's channels (inputs split on
    the axes `split` gives per input), the results joined on join_axis."""
    def grouped(i, a, c):
        g = a.get("groups", 1)
        if g == 1:
            return kernel(i, a, c)
        parts = []
        for k in range(g):
            sub = [x if axis is None else np.split(x, g, axis=axis)[k]
                   for x, axis in zip(i, split)]
            parts.append(kernel(sub, a, c))
        return np.concatenate(parts, axis=join_axis)
    return grouped


def _conv_plain(i, a, c):
    x, f = i
    kh, kw = f.shape[2], f.shape[3]
    win = _windows(_pad(x, a["pads"]), kh, kw, a["strides"])
    n, ch, oh, ow = win.shape[:4]
    # columns laid out (C*kh*kw, N*OH*OW): gathering them copies whole rows of each window
    # offset, where the (N*OH*OW, C*kh*kw) layout copies kh*kw elements at a time (2-3x slower)
    cols = win.transpose(1, 4, 5, 0, 2, 3).reshape(ch * kh * kw, n * oh * ow)
    out = f.reshape(f.shape[0], -1) @ cols
    return np.ascontiguousarray(out.reshape(f.shape[0], n, oh, ow).transpose(1, 0, 2, 3))


def _conv_input_grad_plain(i, a, c):
    x, f, dy = i
    o, ch, kh, kw = f.shape
    n, _, oh, ow = dy.shape
    dcols = (dy.transpose(0, 2, 3, 1).reshape(-1, o) @ f.reshape(o, -1)).reshape(n, oh, ow, ch, kh, kw)
    return _scatter_windows(x.shape, a["pads"], kh, kw, a["strides"],
                            lambda r, s: dcols[:, :, :, :, r, s].transpose(0, 3, 1, 2))


def _conv_filter_grad_plain(i, a, c):
    x, f, dy = i
    cols, _ = _im2col(x, f.shape, a)
    return (dy.transpose(0, 2, 3, 1).reshape(-1, f.shape[0]).T @ cols).reshape(f.shape)


# groups split the input's channels (axis 1), the filter's outputs (axis 0) and dy's channels
_conv_kernel = _per_group(_conv_plain, (1, 0), 1)
_conv_input_grad_kernel = _per_group(_conv_input_grad_plain, (1, 0, 1), 1)
_conv_filter_grad_kernel = _per_group(_conv_filter_grad_plain, (1, 0, 1), 0)


def _grad_conv(c):
    x, f = c.x
    keep = {k: c.attrs[k] for k in _CONV_ATTRS}
    return [_t(make("Conv2DBackpropInput", [x, f, c.dy], keep)),
            _t(make("Conv2DBackpropFilter", [x, f, c.dy], keep))]


register("Conv2D", infer=_conv_infer, kernel=_conv_kernel, grad=_grad_conv, unit=CUBE,
         min_inputs=2, attrs=_CONV_ATTRS, five_hd=((0,), (0,)), doc="2-D convolution, NCHW input, OIHW filter")
register("Conv2DBackpropInput", infer=lambda s, a, w: [TensorSpec(s[0].shape, s[2].dtype)],
         kernel=_conv_input_grad_kernel, unit=CUBE, min_inputs=3, attrs=_CONV_ATTRS,
         shape_inputs=(0,), five_hd=((2,), (0,)),
         doc="(input, filter, dy) -> d input; input is read for its shape only")
register("Conv2DBackpropFilter", infer=lambda s, a, w: [TensorSpec(s[1].shape, s[2].dtype)],
         kernel=_conv_filter_grad_kernel, unit=CUBE, min_inputs=3, attrs=_CONV_ATTRS,
         shape_inputs=(1,), five_hd=((0, 2), ()),
         doc="(input, filter, dy) -> d filter; filter is read for its shape only")


# -- pooling ---------------------------------------------------------------------------------
_POOL_ATTRS = {"ksize": [2, 2], "strides": [2, 2], "pads": [0, 0, 0, 0], "data_format": "NCHW",
               "count_include_pad": False}


def _pool_infer(specs, attrs, where):
    x = specs[0]
    rules.require_float(x, where)
    rules.require_rank(x, 4, where, "input (NCHW)")
    if len(attrs["ksize"]) != 2 or min(attrs["ksize"]) < 1:
        rules.fail(where, f"ksize must be two positive ints, got {attrs['ksize']}")
    oh, ow = _window_geometry(x.shape, attrs["ksize"], attrs, where)
    return [TensorSpec((x.shape[0], x.shape[1], oh, ow), x.dtype)]


def _max_pool_kernel(i, a, c):
    x = i[0]
    kh, kw = a["ksize"]
    win = _windows(_pad(x, a["pads"], -np.inf), kh, kw, a["strides"])
    # one maximum per window offset over whole output planes: a reduction over the two
    # small trailing axes of the strided view is several times slower; nan propagates alike
    out = np.array(win[..., 0, 0])
    for r in range(kh):
        for s in range(kw):
            if r or s:
                np.maximum(out, win[..., r, s], out=out)
    return out


def _max_pool_grad_kernel(i, a, c):
    x, y, dy = i
    kh, kw = a["ksize"]
    win = _windows(_pad(x, a["pads"], -np.inf), kh, kw, a["strides"])
    first_max = win.reshape(win.shape[:4] + (kh * kw,)).argmax(axis=4)  # ties: first, as TF
    return _scatter_windows(x.shape, a["pads"], kh, kw, a["strides"],
                            lambda r, s: np.where(first_max == r * kw + s, dy, 0).astype(dy.dtype))


def _avg_counts(x_shape, a, dtype):
    kh, kw = a["ksize"]
    if a["count_include_pad"]:
        return dtype.type(kh * kw)
    ones = _pad(np.ones((1, 1) + tuple(x_shape[2:]), dtype=dtype), a["pads"])
    return _windows(ones, kh, kw, a["strides"]).sum(axis=(4, 5))


def _avg_pool_kernel(i, a, c):
    x = i[0]
    kh, kw = a["ksize"]
    total = _windows(_pad(x, a["pads"]), kh, kw, a["strides"]).sum(axis=(4, 5))
    return (total / _avg_counts(x.shape, a, x.dtype)).astype(x.dtype)


def _avg_pool_grad_kernel(i, a, c):
    x, dy = i
    kh, kw = a["ksize"]
    share = (dy / _avg_counts(x.shape, a, dy.dtype)).astype(dy.dtype)
    return _scatter_windows(x.shape, a["pads"], kh, kw, a["strides"], lambda r, s: share)


def _pool_keep(c):
    return {k: c.attrs[k] for k in _POOL_ATTRS}


register("MaxPool", infer=_pool_infer, kernel=_max_pool_kernel, min_inputs=1, attrs=_POOL_ATTRS,
         five_hd=((0,), (0,)),
         grad=lambda c: [_t(make("MaxPoolGrad", [c.x[0], c.y[0], c.dy], _pool_keep(c)))],
         doc="max over ksize windows (padding never wins)")
register("MaxPoolGrad", infer=lambda s, a, w: [s[0]], kernel=_max_pool_grad_kernel,
         min_inputs=3, attrs=_POOL_ATTRS, five_hd=((0, 1, 2), (0,)),
         doc="(x, y, dy) -> dx: each window's dy goes to its first maximum")
register("AvgPool", infer=_pool_infer, kernel=_avg_pool_kernel, min_inputs=1, attrs=_POOL_ATTRS,
         five_hd=((0,), (0,)),
         grad=lambda c: [_t(make("AvgPoolGrad", [c.x[0], c.dy], _pool_keep(c)))],
         doc="mean over ksize windows; padding counted only with count_include_pad")
register("AvgPoolGrad", infer=lambda s, a, w: [TensorSpec(s[0].shape, s[1].dtype)],
         kernel=_avg_pool_grad_kernel, min_inputs=2, attrs=_POOL_ATTRS, shape_inputs=(0,),
         five_hd=((1,), (0,)),
         doc="(x, dy) -> dx: dy shared equally over each window; x is read for its shape only")


# -- BatchNorm -------------------------------------------------------------------------------
def _bn_infer(specs, attrs, where):
    x = specs[0]
    rules.require_float(x, where)
    rules.same_dtype(specs, where, ["x", "scale", "offset", "mean", "variance"])
    if len(x.shape) < 2:
        rules.fail(where, f"x must have rank >= 2 (channels on axis 1), got {x}")
    for name, s in zip(("scale", "offset", "mean", "variance"), specs[1:]):
        if len(s.shape) != 1 or not rules.dims_equal(s.shape[0], x.shape[1]):
            rules.fail(where, f"{name} must be [{x.shape[1]}] for x {x}, got {s}")
    channel = TensorSpec((x.shape[1],), x.dtype)
    return [x, channel, channel]


def _bn_stats(x):
    axes = (0,) + tuple(range(2, x.ndim))
    mean = x.mean(axis=axes)
    var = np.square(x - _per_channel(mean, x.ndim)).mean(axis=axes)   # biased, as TF's batch_variance in the forward pass
    return axes, mean.astype(x.dtype), var.astype(x.dtype)


def _per_channel(v, ndim):
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def _bn_kernel(i, a, c):
    x, scale, offset, mean, var = i
    if a["is_training"]:
        _, mean, var = _bn_stats(x)
    inv = 1.0 / np.sqrt(var + x.dtype.type(a["epsilon"]))
    y = (x - _per_channel(mean, x.ndim)) * _per_channel(inv * scale, x.ndim) + _per_channel(offset, x.ndim)
    return [y.astype(x.dtype), mean.copy(), var.copy()]


def _bn_grad_kernel(i, a, c):
    dy, x, scale, mean, var = i
    axes = (0,) + tuple(range(2, x.ndim))
    inv = 1.0 / np.sqrt(var + x.dtype.type(a["epsilon"]))
    xhat = (x - _per_channel(mean, x.ndim)) * _per_channel(inv, x.ndim)
    d_offset = dy.sum(axis=axes)
    d_scale = (dy * xhat).sum(axis=axes)
    if a["is_training"]:
        m = x.size // x.shape[1]
        dx = _per_channel(scale * inv / m, x.ndim) * (
            m * dy - _per_channel(d_offset, x.ndim) - xhat * _per_channel(d_scale, x.ndim))
    else:
        dx = dy * _per_channel(scale * inv, x.ndim)
    return [dx.astype(x.dtype), d_scale.astype(x.dtype), d_offset.astype(x.dtype)]


def _grad_bn(c):
    if c.dys[1] is not None or c.dys[2] is not None:
        rules.fail(rules.where_of(c.node), "the batch mean and variance outputs are not differentiable")
    x, scale, offset, mean, var = c.x
    stats = (c.y[1], c.y[2]) if c.attrs["is_training"] else (mean, var)
    node = make("BatchNormGrad", [c.dy, x, scale, stats[0], stats[1]],
                {"epsilon": c.attrs["epsilon"], "is_training": c.attrs["is_training"]})
    return [node.output(0), node.output(1), node.output(2), None, None]


register("BatchNorm", infer=_bn_infer, kernel=_bn_kernel, grad=_grad_bn, min_inputs=5,
         five_hd=((0,), (0,)),
         attrs={"epsilon": 1e-5, "is_training": True},
         doc="(x, scale, offset, mean, variance) -> (y, batch_mean, batch_variance); training "
             "normalises with the batch's biased statistics, inference with the given ones")
register("BatchNormGrad", infer=lambda s, a, w: [s[1], s[2], s[2]], kernel=_bn_grad_kernel,
         min_inputs=5, five_hd=((0, 1), (0,)), attrs={"epsilon": 1e-5, "is_training": True},
         doc="(dy, x, scale, mean, variance) -> (dx, d scale, d offset)")


# -- Dropout ---------------------------------------------------------------------------------
def _dropout_infer(specs, attrs, where):
    rules.require_float(specs[0], where)
    if not 0.0 <= attrs["rate"] < 1.0:
        rules.fail(where, f"rate must be in [0, 1), got {attrs['rate']}")
    return [specs[0], specs[0]]


def _dropout_kernel(i, a, c):
    x = i[0]
    keep = 1.0 - a["rate"]
    u = c.rng(a["seed"]).random(x.shape)
    mask = ((u >= a["rate"]) / keep).astype(x.dtype)
    return [x * mask, mask]


register("Dropout", infer=_dropout_infer, kernel=_dropout_kernel, min_inputs=1,
         grad=lambda c: [mul(c.dy, c.y[1])], attrs={"rate": 0.1, "seed": 0},
         doc="(x) -> (x * mask, mask); mask is 0 or 1/(1-rate), drawn from (graph seed, seed, step)")


# -- builders --------------------------------------------------------------------------------
def softmax(x, axis=-1, name=None):
    return _t(make("Softmax", [x], {"axis": int(axis)}, name=name))


def log_softmax(x, axis=-1, name=None):
    return _t(make("LogSoftmax", [x], {"axis": int(axis)}, name=name))


def sparse_softmax_cross_entropy_with_logits(logits, labels, name=None):
    """Per-example loss -log softmax(logits)[label]; returns the loss tensor [N]."""
    return _t(make("SparseSoftmaxCrossEntropyWithLogits", [logits, labels], name=name))


def conv2d(x, filters, strides=1, padding="SAME", name=None):
    """NCHW convolution with an OIHW filter; padding 'SAME', 'VALID' or [top, bottom, left, right]."""
    strides = _pair(strides)
    try:
        pads = resolve_pads(padding, x.shape[2:], filters.shape[2:], strides)
    except ValueError as e:
        rules.fail(f"Conv2D {name or 'Conv2D'}", str(e))
    return _t(make("Conv2D", [x, filters], {"strides": strides, "pads": pads}, name=name))


def _pool(type_, x, ksize, strides, padding, name, count_include_pad=False):
    ksize, strides = _pair(ksize), _pair(strides if strides is not None else ksize)
    try:
        pads = resolve_pads(padding, x.shape[2:], ksize, strides)
    except ValueError as e:
        rules.fail(f"{type_} {name or type_}", str(e))
    attrs = {"ksize": ksize, "strides": strides, "pads": pads, "count_include_pad": count_include_pad}
    return _t(make(type_, [x], attrs, name=name))


def max_pool(x, ksize=2, strides=None, padding="VALID", name=None):
    return _pool("MaxPool", x, ksize, strides, padding, name)


def avg_pool(x, ksize=2, strides=None, padding="VALID", count_include_pad=False, name=None):
    return _pool("AvgPool", x, ksize, strides, padding, name, count_include_pad)


def batch_norm(x, scale, offset, mean, variance, epsilon=1e-5, is_training=True, name=None):
    """Returns the BatchNorm node: outputs (y, batch_mean, batch_variance)."""
    return make("BatchNorm", [x, scale, offset, mean, variance],
                {"epsilon": float(epsilon), "is_training": bool(is_training)}, name=name)


def dropout(x, rate, seed=0, name=None):
    return _t(make("Dropout", [x], {"rate": float(rate), "seed": int(seed)}, name=name))
