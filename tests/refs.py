"""Independent float64 reference implementations for the op tests.

Written differently from the package's kernels on purpose: explicit loops for windows,
textbook formulas, math.erf. They are slow and only ever see tiny tensors.
"""
import itertools
import math

import numpy as np


def erf(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def gelu(x):
    return x * 0.5 * (1.0 + erf(x / math.sqrt(2.0)))


def gelu_derivative(x):
    return 0.5 * (1.0 + erf(x / math.sqrt(2.0))) + x * np.exp(-x * x / 2) / math.sqrt(2 * math.pi)


def softmax(x, axis):
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def _padded(x, pads, value):
    t, b, l, r = pads
    n, c, h, w = x.shape
    out = np.full((n, c, h + t + b, w + l + r), value, dtype=np.float64)
    out[:, :, t:t + h, l:l + w] = x
    return out


def _out_size(x_shape, k, strides, pads):
    h, w = x_shape[2], x_shape[3]
    return ((h + pads[0] + pads[1] - k[0]) // strides[0] + 1,
            (w + pads[2] + pads[3] - k[1]) // strides[1] + 1)


def conv2d(x, f, strides, pads):
    n, c, _, _ = x.shape
    o, _, kh, kw = f.shape
    oh, ow = _out_size(x.shape, (kh, kw), strides, pads)
    xp = _padded(x, pads, 0.0)
    out = np.zeros((n, o, oh, ow))
    for b, oc, i, j in itertools.product(range(n), range(o), range(oh), range(ow)):
        patch = xp[b, :, i * strides[0]:i * strides[0] + kh, j * strides[1]:j * strides[1] + kw]
        out[b, oc, i, j] = float(np.sum(patch * f[oc]))
    return out


def conv2d_input_grad(x_shape, f, dy, strides, pads):
    """Adjoint of conv2d in x: every output position sends dy * filter back to its patch."""
    n, c, h, w = x_shape
    o, _, kh, kw = f.shape
    t, _, l, _ = pads
    dx = np.zeros((n, c, h + pads[0] + pads[1], w + pads[2] + pads[3]))
    for b, oc, i, j in itertools.product(range(n), range(o), range(dy.shape[2]), range(dy.shape[3])):
        dx[b, :, i * strides[0]:i * strides[0] + kh, j * strides[1]:j * strides[1] + kw] += \
            dy[b, oc, i, j] * f[oc]
    return dx[:, :, t:t + h, l:l + w]


def conv2d_filter_grad(x, f_shape, dy, strides, pads):
    o, c, kh, kw = f_shape
    xp = _padded(x, pads, 0.0)
    df = np.zeros(f_shape)
    for b, oc, i, j in itertools.product(range(x.shape[0]), range(o), range(dy.shape[2]),
                                         range(dy.shape[3])):
        df[oc] += dy[b, oc, i, j] * xp[b, :, i * strides[0]:i * strides[0] + kh,
                                       j * strides[1]:j * strides[1] + kw]
    return df


def max_pool(x, k, strides, pads):
    xp = _padded(x, pads, -np.inf)
    oh, ow = _out_size(x.shape, k, strides, pads)
    out = np.zeros(x.shape[:2] + (oh, ow))
    for b, c, i, j in itertools.product(range(x.shape[0]), range(x.shape[1]), range(oh), range(ow)):
        out[b, c, i, j] = xp[b, c, i * strides[0]:i * strides[0] + k[0],
                             j * strides[1]:j * strides[1] + k[1]].max()
    return out


def max_pool_grad(x, dy, k, strides, pads):
    t, _, l, _ = pads
    xp = _padded(x, pads, -np.inf)
    dx = np.zeros(xp.shape)
    for b, c, i, j in itertools.product(range(x.shape[0]), range(x.shape[1]), range(dy.shape[2]),
                                        range(dy.shape[3])):
        win = xp[b, c, i * strides[0]:i * strides[0] + k[0], j * strides[1]:j * strides[1] + k[1]]
        r, s = np.unravel_index(np.argmax(win), win.shape)   # first maximum in row-major order
        dx[b, c, i * strides[0] + r, j * strides[1] + s] += dy[b, c, i, j]
    return dx[:, :, t:t + x.shape[2], l:l + x.shape[3]]


def avg_pool(x, k, strides, pads, count_include_pad):
    xp = _padded(x, pads, 0.0)
    inside = _padded(np.ones_like(x), pads, 0.0)
    oh, ow = _out_size(x.shape, k, strides, pads)
    out = np.zeros(x.shape[:2] + (oh, ow))
    for b, c, i, j in itertools.product(range(x.shape[0]), range(x.shape[1]), range(oh), range(ow)):
        sl = (b, c, slice(i * strides[0], i * strides[0] + k[0]),
              slice(j * strides[1], j * strides[1] + k[1]))
        count = k[0] * k[1] if count_include_pad else inside[sl].sum()
        out[b, c, i, j] = xp[sl].sum() / count
    return out


def avg_pool_grad(x_shape, dy, k, strides, pads, count_include_pad):
    t, _, l, _ = pads
    inside = _padded(np.ones(x_shape), pads, 0.0)
    dx = np.zeros(inside.shape)
    for b, c, i, j in itertools.product(range(x_shape[0]), range(x_shape[1]), range(dy.shape[2]),
                                        range(dy.shape[3])):
        sl = (b, c, slice(i * strides[0], i * strides[0] + k[0]),
              slice(j * strides[1], j * strides[1] + k[1]))
        count = k[0] * k[1] if count_include_pad else inside[sl].sum()
        dx[sl] += dy[b, c, i, j] / count
    return dx[:, :, t:t + x_shape[2], l:l + x_shape[3]]


def batch_norm(x, scale, offset, mean, var, eps, training):
    axes = tuple(k for k in range(x.ndim) if k != 1)
    shape = [1, -1] + [1] * (x.ndim - 2)
    if training:
        mean, var = x.mean(axis=axes), x.var(axis=axes)
    y = (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps) * scale.reshape(shape) \
        + offset.reshape(shape)
    return [y, mean, var]


def numeric_jacobian_vjp(f, inputs, dy, wrt, eps=1e-6):
    """sum(dy * f(inputs)) differentiated in inputs[wrt] by central differences."""
    x = inputs[wrt].astype(np.float64)
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        for sign in (1, -1):
            xs = list(inputs)
            moved = x.copy()
            moved[idx] += sign * eps
            xs[wrt] = moved
            grad[idx] += sign * float(np.sum(dy * f(*xs)))
    return grad / (2 * eps)


def sparse_softmax_ce(logits, labels):
    loss = np.array([-math.log(math.exp(row[l]) / sum(math.exp(v) for v in row))
                     for row, l in zip(logits, labels)])
    backprop = softmax(logits, 1)
    backprop[np.arange(len(labels)), labels] -= 1.0
    return [loss, backprop]


def gather_grad(dy, indices, params_shape, axis):
    out = np.zeros(params_shape)
    moved = np.moveaxis(out, axis, 0)
    dmoved = np.moveaxis(dy, axis, 0) if indices.ndim == 1 else None
    for k, index in enumerate(indices.ravel()):
        moved[index] += dmoved[k]
    return out


def one_hot(indices, depth, on, off, axis):
    out = np.full(indices.shape + (depth,), off, dtype=np.float64)
    for idx in np.ndindex(indices.shape):
        if 0 <= indices[idx] < depth:
            out[idx + (indices[idx],)] = on
    return np.moveaxis(out, -1, axis)


def adam_tf(var, m, v, b1p, b2p, grad, lr, b1, b2, eps):
    """TF ApplyAdam, with the beta powers advanced first (see the op's doc)."""
    b1p, b2p = b1p * b1, b2p * b2
    m = b1 * m + (1 - b1) * grad
    v = b2 * v + (1 - b2) * grad ** 2
    alpha = lr * math.sqrt(1 - b2p) / (1 - b1p)
    return [var - alpha * m / (np.sqrt(v) + eps), m, v, b1p, b2p]


def batch_norm_grad(dy, x, scale, mean, var, eps):
    """Training-mode BatchNorm backprop as Ioffe & Szegedy (2015) write it, step by step."""
    axes = tuple(k for k in range(x.ndim) if k != 1)
    shape = [1, -1] + [1] * (x.ndim - 2)
    m = x.size // x.shape[1]
    mu, v, gamma = mean.reshape(shape), var.reshape(shape), scale.reshape(shape)
    dxhat = dy * gamma
    dvar = np.sum(dxhat * (x - mu) * -0.5 * (v + eps) ** -1.5, axis=axes).reshape(shape)
    dmu = (np.sum(-dxhat / np.sqrt(v + eps), axis=axes).reshape(shape)
           + dvar * np.sum(-2.0 * (x - mu), axis=axes).reshape(shape) / m)
    dx = dxhat / np.sqrt(v + eps) + dvar * 2.0 * (x - mu) / m + dmu / m
    xhat = (x - mu) / np.sqrt(v + eps)
    return [dx, np.sum(dy * xhat, axis=axes), np.sum(dy, axis=axes)]


def layer_norm_roles(x, gamma, beta, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    inv = 1 / np.sqrt(var + eps)
    norm = (x - mean) * inv
    return {"y": norm * gamma + beta, "mean": mean, "centered": x - mean,
            "square": (x - mean) ** 2, "variance": var, "var_eps": var + eps, "inv": inv,
            "normalized": norm, "scaled": norm * gamma}


def rms_norm_roles(x, gamma, eps):
    """RMSNorm over the last axis, role by role in RmsNorm's order (y, square, mean_square,
    var_eps, inv, normalized)."""
    square = x * x
    mean_square = square.mean(-1, keepdims=True)
    inv = 1 / np.sqrt(mean_square + eps)
    return [x * inv * gamma, square, mean_square, mean_square + eps, inv, x * inv]


def to_5hd(x, c0=16):
    n, c, h, w = x.shape
    out = np.zeros((n, -(-c // c0), h, w, c0))
    for i, j, k, m in itertools.product(range(n), range(c), range(h), range(w)):
        out[i, j // c0, k, m, j % c0] = x[i, j, k, m]
    return out


def tensor_stats(a):
    """max, min, mean, l2norm over the finite elements (nan without any), then the nan, +inf
    and -inf counts: what a dump index row holds, from float64 numpy."""
    f = np.asarray(a, dtype=np.float64).reshape(-1)
    fin = f[np.isfinite(f)]
    counts = [int(np.isnan(f).sum()), int(np.isposinf(f).sum()), int(np.isneginf(f).sum())]
    if not fin.size:
        return [np.nan] * 4 + counts
    return [fin.max(), fin.min(), fin.mean(), np.sqrt((fin * fin).sum())] + counts


def kl_excess(p, q):
    """p log(p / q) - (p - q) per element in extended precision (long double): for
    |p / q - 1| < 1/16 the sum over k >= 2 of (-1)^k d^k / (k (k - 1)) q to k = 40 (the
    textbook difference cancels there), elsewhere the difference itself."""
    p, q = np.asarray(p, np.longdouble), np.asarray(q, np.longdouble)
    d = (p - q) / q
    near = np.abs(d) < 0.0625
    series = sum((-1.0) ** k * d ** k / (k * (k - 1)) for k in range(2, 41)) * q
    return np.where(near, series, p * np.log(p / q) - (p - q))


def kl_divergence(p, q):
    """KL of the pdfs P = p / sum p and Q = q / sum q in extended precision, as the sum of
    kl_excess(P, Q) (which is sum P log(P / Q), as sum P = sum Q = 1, without its
    cancellation)."""
    p, q = np.asarray(p, np.longdouble), np.asarray(q, np.longdouble)
    return float(kl_excess(p / p.sum(), q / q.sum()).sum())
