"""Layers that build common patterns out of registry ops, with TF-style names.

Each layer opens a name scope (`dense`, `dense_1`, ... unless named) and creates its
variables there (`dense/kernel`, `dense/bias`), in the dtype of its input. Pass `reuse=True` with the same name to build
a second path over the same variables (e.g. an inference branch).
"""
from __future__ import annotations

import math

from ..errors import GraphError
from ..graph import get_default_graph
from .. import ops


def _scope_name(graph, name, reuse):
    """A fresh scope under the current one, unless reusing an existing one."""
    if reuse:
        return name
    prefix = f"{graph.current_scope}/" if graph.current_scope else ""
    taken = {n.name for n in graph.nodes}
    candidate, k = name, 0
    while any(t == prefix + candidate or t.startswith(prefix + candidate + "/") for t in taken):
        k += 1
        candidate = f"{name}_{k}"
    return candidate


def _variable(graph, name, shape, init, reuse, trainable=True, dtype="float32"):
    full = f"{graph.current_scope}/{name}"
    if reuse:
        if full not in graph:
            raise GraphError(f"reuse=True but variable {full!r} does not exist")
        v = graph.node(full).output(0)
        if list(v.shape) != list(shape):
            raise GraphError(f"variable {full!r} has shape {list(v.shape)}, reuse asked for {list(shape)}")
        return v
    return ops.variable(name, shape, init=init, dtype=dtype, trainable=trainable)


def _static_dim(x, axis, what):
    d = x.shape[axis]
    if d is None:
        raise GraphError(f"{what} needs a static size on axis {axis} of {x.name} {x.spec}")
    return d


def dense(x, units, activation=None, use_bias=True, kernel_init="glorot_uniform", name="dense",
          reuse=False):
    """y = activation(x @ kernel + bias) on a 2-D input."""
    g = get_default_graph()
    with g.name_scope(_scope_name(g, name, reuse)):
        kernel = _variable(g, "kernel", [_static_dim(x, -1, "dense"), units], kernel_init, reuse,
                           dtype=x.dtype)
        y = ops.matmul(x, kernel)
        if use_bias:
            y = ops.bias_add(y, _variable(g, "bias", [units], "zeros", reuse, dtype=x.dtype))
        return activation(y) if activation else y


def conv2d(x, filters, kernel_size, strides=1, padding="SAME", activation=None, use_bias=True,
           name="conv2d", reuse=False):
    """NCHW convolution with an OIHW kernel (He-normal initialised) and a per-channel bias."""
    g = get_default_graph()
    kh, kw = (kernel_size, kernel_size) if isinstance(kernel_size, int) else kernel_size
    with g.name_scope(_scope_name(g, name, reuse)):
        kernel = _variable(g, "kernel", [filters, _static_dim(x, 1, "conv2d"), kh, kw],
                           "he_normal", reuse, dtype=x.dtype)
        y = ops.conv2d(x, kernel, strides=strides, padding=padding)
        if use_bias:
            y = ops.bias_add(y, _variable(g, "bias", [filters], "zeros", reuse, dtype=x.dtype),
                             data_format="NCHW")
        return activation(y) if activation else y


def batch_norm(x, training=True, momentum=0.9, epsilon=1e-5, name="batch_normalization",
               reuse=False):
    """BatchNorm over axis 1. In training the batch statistics normalise and the moving
    statistics are updated by AssignMovingAverage ops in the "update_ops" collection, which
    optimizers run with every step; in inference the moving statistics normalise."""
    g = get_default_graph()
    c = _static_dim(x, 1, "batch_norm")
    with g.name_scope(_scope_name(g, name, reuse)):
        gamma = _variable(g, "gamma", [c], "ones", reuse, dtype=x.dtype)
        beta = _variable(g, "beta", [c], "zeros", reuse, dtype=x.dtype)
        mean = _variable(g, "moving_mean", [c], "zeros", reuse, trainable=False, dtype=x.dtype)
        var = _variable(g, "moving_variance", [c], "ones", reuse, trainable=False, dtype=x.dtype)
        node = ops.batch_norm(x, gamma, beta, mean, var, epsilon=epsilon, is_training=training)
        if training:
            for v, stat, label in ((mean, node.output(1), "AssignMovingAvg"),
                                   (var, node.output(2), "AssignMovingAvg_1")):
                upd = ops.make("AssignMovingAverage", [v, stat], {"decay": momentum}, name=label)
                g.add_to_collection("update_ops", upd)
        return node.output(0)


def layer_norm(x, epsilon=1e-5, name="LayerNorm", reuse=False):
    """LayerNorm over the last axis, emitted decomposed exactly as a TF graph holds it:
    ReduceMean, Sub, Square, ReduceMean, Add eps, Rsqrt, Mul, Mul (gamma), Add (beta)."""
    g = get_default_graph()
    d = _static_dim(x, -1, "layer_norm")
    with g.name_scope(_scope_name(g, name, reuse)):
        gamma = _variable(g, "gamma", [d], "ones", reuse, dtype=x.dtype)
        beta = _variable(g, "beta", [d], "zeros", reuse, dtype=x.dtype)
        mean = ops.reduce_mean(x, -1, keep_dims=True, name="moments/mean")
        centered = ops.sub(x, mean)
        variance = ops.reduce_mean(ops.square(centered), -1, keep_dims=True,
                                   name="moments/variance")
        inv = ops.rsqrt(ops.add(variance, ops.constant(epsilon, dtype=x.dtype, name="epsilon")))
        return ops.add(ops.mul(ops.mul(centered, inv), gamma), beta)


def rms_norm(x, epsilon=1e-6, name="RMSNorm", reuse=False):
    """RMSNorm over the last axis (Llama's, T5's), emitted decomposed: Square, ReduceMean,
    Add eps, Rsqrt, Mul, Mul (gamma)."""
    g = get_default_graph()
    d = _static_dim(x, -1, "rms_norm")
    with g.name_scope(_scope_name(g, name, reuse)):
        gamma = _variable(g, "gamma", [d], "ones", reuse, dtype=x.dtype)
        mean_square = ops.reduce_mean(ops.square(x), -1, keep_dims=True, name="mean_square")
        inv = ops.rsqrt(ops.add(mean_square, ops.constant(epsilon, dtype=x.dtype,
                                                          name="epsilon")))
        return ops.mul(ops.mul(x, inv), gamma)


def multi_head_attention(x, num_heads, name="attention", reuse=False):
    """Self-attention on [batch, tokens, d_model]: Q/K/V projections, softmax(QK^T/sqrt(dh)) V
    over `num_heads` heads (BatchMatMul), and the output projection."""
    g = get_default_graph()
    t, d = _static_dim(x, 1, "attention"), _static_dim(x, 2, "attention")
    if d % num_heads:
        raise GraphError(f"attention: d_model {d} is not divisible by {num_heads} heads")
    dh = d // num_heads
    with g.name_scope(_scope_name(g, name, reuse)):
        flat = ops.reshape(x, [-1, d])

        def heads(label):
            proj = dense(flat, d, name=label, reuse=reuse)
            return ops.transpose(ops.reshape(proj, [-1, t, num_heads, dh]), [0, 2, 1, 3])
        q, k, v = heads("query"), heads("key"), heads("value")
        scores = ops.mul(ops.batch_matmul(q, k, adj_y=True),
                         ops.constant(1.0 / math.sqrt(dh), dtype=x.dtype, name="scale"))
        probs = ops.softmax(scores, axis=-1)
        context = ops.transpose(ops.batch_matmul(probs, v), [0, 2, 1, 3])
        out = dense(ops.reshape(context, [-1, d]), d, name="output", reuse=reuse)
        return ops.reshape(out, [-1, t, d])


def embedding(ids, vocab_size, dim, name="embedding", reuse=False):
    """Rows of a [vocab_size, dim] table (normal, stddev 0.02) at integer ids (Gather)."""
    g = get_default_graph()
    with g.name_scope(_scope_name(g, name, reuse)):
        table = _variable(g, "table", [vocab_size, dim], {"kind": "normal", "stddev": 0.02}, reuse)
        return ops.gather(table, ids)


def dropout(x, rate, training=True, seed=0, name=None):
    return ops.dropout(x, rate, seed=seed, name=name) if training and rate > 0 else x


relu = ops.relu
gelu = ops.gelu
tanh = ops.tanh
sigmoid = ops.sigmoid
softmax = ops.softmax

__all__ = ["dense", "conv2d", "embedding", "batch_norm", "layer_norm", "rms_norm",
           "multi_head_attention", "dropout",
           "relu", "gelu", "tanh", "sigmoid", "softmax"]


class SoftmaxCrossEntropyWithLogits:
    """A loss as a callable, MindSpore's `nn.SoftmaxCrossEntropyWithLogits(sparse=True,
    reduction="mean")`: `loss_fn(logits, labels)` builds the ops under a `loss` scope.
    Labels are class ids (sparse=True: the graph's loss op is the sparse one)."""

    REDUCTIONS = ("mean", "sum", "none")

    def __init__(self, sparse: bool = True, reduction: str = "mean"):
        if not sparse:
            raise GraphError("SoftmaxCrossEntropyWithLogits: only class-id labels (sparse=True) "
                             "are supported; pass labels as int32 class ids")
        if reduction not in self.REDUCTIONS:
            raise GraphError(f"reduction must be one of {self.REDUCTIONS}, got {reduction!r}")
        self.reduction = reduction

    def __call__(self, logits, labels):
        graph = logits.graph
        with graph.name_scope(_scope_name(graph, "loss", False)):
            per_example = ops.sparse_softmax_cross_entropy_with_logits(logits, labels)
            if self.reduction == "none":
                return per_example
            reduce = ops.reduce_mean if self.reduction == "mean" else ops.reduce_sum
            return reduce(per_example)
