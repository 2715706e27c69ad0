"""Translate a single-node ONNX backend test into a precision_tool graph.

Used only by the conformance test. Inputs our ops take as static attributes (shapes, axes,
slice bounds, depths) are read from the test's data; everything else becomes a placeholder.
Anything our op set does not express raises Unsupported with the reason, and the test is
reported as skipped with it."""
import numpy as np
import onnx
from onnx import helper, numpy_helper

import precision_tool as pt
from precision_tool import ops

DTYPES = {"float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool"}


class Unsupported(Exception):
    pass


class Ctx:
    def __init__(self, node, values):
        self.node = node
        self.attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        for k, v in list(self.attrs.items()):
            if isinstance(v, bytes):
                self.attrs[k] = v.decode()
        self.values = values
        self.feeds = {}
        self._tensors = {}

    def has(self, k):
        return k < len(self.node.input) and self.node.input[k] != ""

    def tensor(self, k):
        if k not in self._tensors:
            value = self.values[k]
            if isinstance(value, onnx.TensorProto):
                value = self.values[k] = numpy_helper.to_array(value)
            if not isinstance(value, np.ndarray):
                raise Unsupported(f"{type(value).__name__} inputs (sequence/optional types)")
            dtype = str(value.dtype)
            if dtype not in DTYPES:
                raise Unsupported(f"{dtype} tensors")
            t = ops.placeholder(f"input_{k}", list(value.shape), dtype)
            self.feeds[t] = value
            self._tensors[k] = t
        return self._tensors[k]

    def static(self, k):
        value = self.values[k]
        return numpy_helper.to_array(value) if isinstance(value, onnx.TensorProto) else np.asarray(value)

    def unsupported_attrs(self, **allowed):
        """Refuse attributes whose value differs from what our op computes."""
        for name, value in self.attrs.items():
            if name in allowed and value != allowed[name]:
                raise Unsupported(f"attribute {name}={value!r}")


RULES = {}


def rule(*names):
    def deco(fn):
        for n in names:
            RULES[n] = fn
        return fn
    return deco


def _same_dtypes(c, n):
    kinds = {str(c.values[k].dtype) for k in range(n)}
    if len(kinds) > 1:
        raise Unsupported(f"mixed input dtypes {sorted(kinds)} (our binary ops take one dtype)")


@rule("Add", "Sub", "Mul", "Div", "Pow", "Equal", "Greater", "GreaterOrEqual", "Less",
      "LessOrEqual")
def _binary(c):
    _same_dtypes(c, 2)
    kind = c.values[0].dtype.kind
    if c.node.op_type in ("Div", "Pow") and kind != "f":
        raise Unsupported(f"{c.node.op_type} on integers (ours is float-only)")
    fn = {"Add": ops.add, "Sub": ops.sub, "Mul": ops.mul, "Div": ops.div, "Pow": ops.pow,
          "Equal": ops.equal, "Greater": ops.greater, "GreaterOrEqual": ops.greater_equal,
          "Less": ops.less, "LessOrEqual": ops.less_equal}[c.node.op_type]
    return [fn(c.tensor(0), c.tensor(1))]


@rule("Max", "Min", "Sum")
def _variadic(c):
    n = len(c.node.input)
    _same_dtypes(c, n)
    xs = [c.tensor(k) for k in range(n)]
    if c.node.op_type == "Sum":
        return [ops.add_n(xs)]
    fn = ops.maximum if c.node.op_type == "Max" else ops.minimum
    out = xs[0] if n > 1 else ops.identity(xs[0])
    for x in xs[1:]:
        out = fn(out, x)
    return [out]


@rule("Neg", "Sqrt", "Exp", "Log", "Relu", "Tanh", "Sigmoid", "Identity")
def _unary(c):
    fn = {"Neg": ops.neg, "Sqrt": ops.sqrt, "Exp": ops.exp, "Log": ops.log, "Relu": ops.relu,
          "Tanh": ops.tanh, "Sigmoid": ops.sigmoid, "Identity": ops.identity}[c.node.op_type]
    return [fn(c.tensor(0))]


@rule("Gelu")
def _gelu(c):
    c.unsupported_attrs(approximate="none")
    return [ops.gelu(c.tensor(0))]


@rule("Softmax", "LogSoftmax")
def _softmax(c):
    fn = ops.softmax if c.node.op_type == "Softmax" else ops.log_softmax
    return [fn(c.tensor(0), c.attrs.get("axis", -1))]


@rule("ReduceSum", "ReduceMean", "ReduceMax")
def _reduce(c):
    x = c.tensor(0)
    if c.values[0].dtype == bool:
        raise Unsupported("reducing bool tensors")
    axes = [int(a) for a in c.static(1)] if c.has(1) else c.attrs.get("axes")
    keep = bool(c.attrs.get("keepdims", 1))
    if not axes:
        if c.attrs.get("noop_with_empty_axes", 0):
            return [ops.identity(x)]
        axes = None
    fn = {"ReduceSum": ops.reduce_sum, "ReduceMean": ops.reduce_mean,
          "ReduceMax": ops.reduce_max}[c.node.op_type]
    return [fn(x, axes, keep_dims=keep)]


@rule("Reshape")
def _reshape(c):
    c.unsupported_attrs(allowzero=0)
    shape = [int(d) for d in c.static(1)]
    in_shape = c.values[0].shape
    shape = [in_shape[k] if d == 0 else d for k, d in enumerate(shape)]  # ONNX: 0 copies the dim
    return [ops.reshape(c.tensor(0), shape)]


@rule("Transpose")
def _transpose(c):
    return [ops.transpose(c.tensor(0), c.attrs.get("perm"))]


@rule("Concat")
def _concat(c):
    return [ops.concat([c.tensor(k) for k in range(len(c.node.input))], c.attrs["axis"])]


@rule("Gather")
def _gather(c):
    return [ops.gather(c.tensor(0), c.tensor(1), c.attrs.get("axis", 0))]


@rule("Slice")
def _slice(c):
    shape = c.values[0].shape
    starts, ends = c.static(1), c.static(2)
    axes = c.static(3) if c.has(3) else np.arange(len(starts))
    steps = c.static(4) if c.has(4) else np.ones(len(starts), int)
    if (steps != 1).any():
        raise Unsupported("slice steps other than 1")
    begin, size = [0] * len(shape), [-1] * len(shape)
    for s, e, a in zip(starts, ends, axes):
        a = int(a) % len(shape)
        n = shape[a]
        s = min(max(int(s) + n if s < 0 else int(s), 0), n)    # ONNX clamps out-of-range bounds
        e = min(max(int(e) + n if e < 0 else int(e), 0), n)
        begin[a], size[a] = s, max(e - s, 0)
    return [ops.slice(c.tensor(0), begin, size)]


def _onnx_pads(c, kernel, strides):
    if len(kernel) != 2:
        raise Unsupported(f"{len(kernel)}-D windows (ours are 2-D)")
    auto = c.attrs.get("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        from precision_tool.ops.nn_ops import resolve_pads
        t, b, l, r = resolve_pads("SAME", c.values[0].shape[2:], kernel, strides)
        return [t, b, l, r] if auto == "SAME_UPPER" else [b, t, r, l]
    if auto == "VALID":
        return [0, 0, 0, 0]
    p = c.attrs.get("pads", [0, 0, 0, 0])
    return [p[0], p[2], p[1], p[3]]   # ONNX [h_begin, w_begin, h_end, w_end]


@rule("Conv")
def _conv(c):
    c.unsupported_attrs(group=1, dilations=[1, 1])
    kernel = list(c.attrs.get("kernel_shape", c.values[1].shape[2:]))
    strides = list(c.attrs.get("strides", [1, 1]))
    pads = _onnx_pads(c, kernel, strides)
    y = ops.make("Conv2D", [c.tensor(0), c.tensor(1)], {"strides": strides, "pads": pads}).output(0)
    if c.has(2):
        y = ops.bias_add(y, c.tensor(2), data_format="NCHW")
    return [y]


@rule("MaxPool", "AveragePool")
def _pool(c):
    c.unsupported_attrs(ceil_mode=0, dilations=[1] * len(c.attrs.get("kernel_shape", [])),
                        storage_order=0)
    if len(c.node.output) > 1:
        raise Unsupported("the argmax (Indices) output")
    if str(c.values[0].dtype) not in ("float16", "float32", "float64"):
        raise Unsupported(f"{c.values[0].dtype} pooling")
    kernel = list(c.attrs["kernel_shape"])
    strides = list(c.attrs.get("strides", [1] * len(kernel)))
    pads = _onnx_pads(c, kernel, strides)
    attrs = {"ksize": kernel, "strides": strides, "pads": pads,
             "count_include_pad": bool(c.attrs.get("count_include_pad", 0))}
    op = "MaxPool" if c.node.op_type == "MaxPool" else "AvgPool"
    return [ops.make(op, [c.tensor(0)], attrs).output(0)]


@rule("BatchNormalization")
def _batch_norm(c):
    eps = c.attrs.get("epsilon", 1e-5)
    training = bool(c.attrs.get("training_mode", 0))
    node = ops.batch_norm(*[c.tensor(k) for k in range(5)], epsilon=eps, is_training=training)
    if not training:
        return [node.output(0)]
    m = c.attrs.get("momentum", 0.9)
    running = [ops.add(ops.mul(c.tensor(k), m), ops.mul(node.output(k - 2), 1 - m)) for k in (3, 4)]
    return [node.output(0)] + running


@rule("Dropout")
def _dropout(c):
    training = bool(c.static(2)) if c.has(2) else False
    ratio = float(c.static(1)) if c.has(1) else c.attrs.get("ratio", 0.5)
    if not training:
        raise Unsupported("inference-mode Dropout (our graphs omit the op outside training)")
    if ratio != 0:
        raise Unsupported("a random mask: ONNX's random stream is not ours")
    node = ops.make("Dropout", [c.tensor(0)], {"rate": ratio, "seed": 0})
    return [node.output(0), ops.greater(node.output(1), 0.0)][:len(c.node.output)]


@rule("Cast")
def _cast(c):
    from onnx import helper as h
    to = h.tensor_dtype_to_np_dtype(c.attrs["to"])
    if str(to) not in DTYPES:
        raise Unsupported(f"cast to {to}")
    return [ops.cast(c.tensor(0), str(to))]


@rule("OneHot")
def _one_hot(c):
    idx, depth, values = c.static(0), int(c.static(1)), c.static(2)
    if (idx < 0).any():
        raise Unsupported("negative indices (ONNX counts them from the end; TF, and we, give "
                          "an all-off row)")
    if str(values.dtype) not in DTYPES:
        raise Unsupported(f"{values.dtype} values")
    x = c.tensor(0)
    if c.values[0].dtype.kind == "f":
        x = ops.cast(x, "int64")
    return [ops.one_hot(x, depth, float(values[1]), float(values[0]), c.attrs.get("axis", -1),
                        dtype=str(values.dtype))]


@rule("Where")
def _where(c):
    return [ops.select(c.tensor(0), c.tensor(1), c.tensor(2))]


@rule("MatMul")
def _matmul(c):
    a, b = c.values[0], c.values[1]
    if a.ndim < 2 or b.ndim < 2:
        raise Unsupported("1-D operands")
    if a.ndim == 2 and b.ndim == 2:
        return [ops.matmul(c.tensor(0), c.tensor(1))]
    if a.ndim < 3 or b.ndim < 3:
        raise Unsupported("a 2-D operand against a batched one")
    return [ops.batch_matmul(c.tensor(0), c.tensor(1))]


@rule("SoftmaxCrossEntropyLoss")
def _sce(c):
    if c.values[0].ndim != 2:
        raise Unsupported("scores beyond [N, C]")
    if c.has(2):
        raise Unsupported("class weights")
    if "ignore_index" in c.attrs:
        raise Unsupported("ignore_index")
    loss = ops.sparse_softmax_cross_entropy_with_logits(c.tensor(0), c.tensor(1))
    reduction = c.attrs.get("reduction", "mean")
    if reduction == "mean":
        loss = ops.reduce_mean(loss)
    elif reduction == "sum":
        loss = ops.reduce_sum(loss)
    outputs = [loss]
    if len(c.node.output) > 1:
        outputs.append(ops.log_softmax(c.tensor(0), axis=1))
    return outputs


def translate(test_case):
    """(graph, feeds, outputs) for an ONNX node test, or Unsupported."""
    node = test_case.model.graph.node[0]
    inputs, expected = test_case.data_sets[0]
    g = pt.Graph("onnx_" + test_case.name)
    c = Ctx(node, inputs)
    with g.as_default():
        outputs = RULES[node.op_type](c)
    return g, c.feeds, outputs, expected
