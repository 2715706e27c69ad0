"""The op test table: for every registered op, inputs, attributes and an independent float64
reference (tests/refs.py or plain numpy written out). test_ops_forward checks every kernel
against it in fp32 and fp64; test_ops_grad checks every gradient rule on the same cases by
central finite differences."""
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import math

import numpy as np

import refs

R = np.random.default_rng(1234)


def normal(*shape):
    return R.normal(size=shape)


def positive(*shape):
    return R.uniform(0.5, 2.0, size=shape)


def away_from_zero(*shape):
    """Normal values with |x| >= 0.1: finite differences never straddle a kink at 0."""
    x = R.normal(size=shape)
    return np.where(np.abs(x) < 0.1, np.sign(x + 1e-12) * 0.1 + x, x)


def distinct(*shape):
    """A permutation of well-separated values: no ties for max/argmax-based ops."""
    n = int(np.prod(shape))
    return (R.permutation(n) * 0.37 - n * 0.15).reshape(shape)


@dataclass
class Case:
    op: str
    inputs: List[np.ndarray]
    ref: Callable
    attrs: Dict = field(default_factory=dict)
    id: str = ""
    dtypes: Optional[List[str]] = None     # IR dtypes of the inputs (default from the arrays)
    grad: bool = True                      # finite-difference check this case
    wrt: Optional[List[int]] = None        # inputs the gradient test checks (default: floats)

    def input_dtypes(self):
        if self.dtypes:
            return self.dtypes
        return ["float32" if a.dtype.kind == "f" else "bool" if a.dtype.kind == "b" else "int32"
                for a in self.inputs]

    @property
    def name(self):
        return f"{self.op}-{self.id}" if self.id else self.op


def _c(op, inputs, ref, **kw):
    return Case(op, inputs, ref, **kw)


X34, Y4, Y34 = normal(3, 4), normal(4), normal(3, 4)
CONV_X, CONV_F = normal(2, 3, 5, 6), normal(4, 3, 3, 2)
CONV_ATTRS = {"strides": [2, 1], "pads": [1, 0, 1, 1]}
CONV_DY = normal(*refs.conv2d(CONV_X, CONV_F, [2, 1], [1, 0, 1, 1]).shape)
POOL_X = distinct(2, 2, 5, 5)
POOL_ATTRS = {"ksize": [3, 2], "strides": [2, 2], "pads": [1, 1, 0, 1]}
POOL_DY = normal(*refs.max_pool(POOL_X, [3, 2], [2, 2], [1, 1, 0, 1]).shape)
BN_X = np.round((normal(4, 3, 2, 2) * 2 + 1) * 64) / 64   # exact batch statistics in fp32 too
BN_ARGS = [BN_X, positive(3), normal(3), normal(3), positive(3)]


def _pool_ref(fn, include=False):
    return lambda x: fn(x, [3, 2], [2, 2], [1, 1, 0, 1], include) if fn is refs.avg_pool \
        else fn(x, [3, 2], [2, 2], [1, 1, 0, 1])


CASES = [
    # elementwise arithmetic, broadcasting [3,4] with [4]
    _c("Add", [X34, Y4], lambda x, y: x + y),
    _c("Sub", [X34, Y4], lambda x, y: x - y),
    _c("Mul", [X34, Y4], lambda x, y: x * y),
    _c("Div", [X34, positive(4)], lambda x, y: x / y),
    _c("RealDiv", [normal(2, 1, 3), positive(4, 1)], lambda x, y: x / y, id="bcast-both"),
    _c("Pow", [positive(3, 4), normal(4)], lambda x, y: np.exp(y * np.log(x))),
    _c("Maximum", [distinct(3, 4), distinct(3, 4)[::-1].copy()], lambda x, y: np.where(x > y, x, y)),
    _c("Minimum", [distinct(3, 4), distinct(3, 4)[::-1].copy()], lambda x, y: np.where(x < y, x, y)),
    _c("AddN", [normal(2, 3), normal(2, 3), normal(2, 3)], lambda a, b, c: a + b + c),
    # comparisons and select (integer-valued floats so that ties occur)
    *[_c(op, [R.integers(-2, 3, (3, 4)).astype(float), R.integers(-2, 3, (4,)).astype(float)], fn)
      for op, fn in [("Equal", lambda x, y: x == y), ("NotEqual", lambda x, y: x != y),
                     ("Greater", lambda x, y: x > y), ("GreaterEqual", lambda x, y: x >= y),
                     ("Less", lambda x, y: x < y), ("LessEqual", lambda x, y: x <= y)]],
    _c("Select", [R.random((3, 4)) > 0.5, normal(3, 4), normal(4)],
       lambda c, x, y: np.array([[x[i, j] if c[i, j] else y[j] for j in range(4)] for i in range(3)])),
    # unary
    _c("Neg", [normal(3, 4)], lambda x: 0.0 - x),
    _c("Square", [normal(3, 4)], lambda x: x ** 2),
    _c("Sqrt", [positive(3, 4)], lambda x: x ** 0.5),
    _c("Rsqrt", [positive(3, 4)], lambda x: x ** -0.5),
    _c("Exp", [normal(3, 4)], lambda x: np.e ** x),
    _c("Log", [positive(3, 4)], lambda x: np.log(x)),
    _c("Relu", [away_from_zero(3, 4)], lambda x: x * (x > 0)),
    _c("Gelu", [normal(3, 4) * 2], refs.gelu),
    _c("Tanh", [normal(3, 4)], lambda x: (np.exp(2 * x) - 1) / (np.exp(2 * x) + 1)),
    _c("Sigmoid", [normal(3, 4) * 3], lambda x: 1 / (1 + np.exp(-x))),
    _c("Sigmoid", [np.array([-800.0, -50.0, 0.0, 50.0, 800.0])],
       lambda x: np.array([0.0, 1 / (1 + np.exp(50.0)), 0.5, 1 / (1 + np.exp(-50.0)), 1.0]),
       id="extremes", grad=False),
    # the activations' gradient kernels
    _c("ReluGrad", [normal(3, 4), away_from_zero(3, 4)], lambda dy, y: dy * (y > 0)),
    _c("TanhGrad", [np.tanh(normal(3, 4)), normal(3, 4)], lambda y, dy: dy * (1 - y ** 2)),
    _c("SigmoidGrad", [positive(3, 4) / 2.5, normal(3, 4)], lambda y, dy: dy * y * (1 - y)),
    _c("SqrtGrad", [positive(3, 4), normal(3, 4)], lambda y, dy: dy / (2 * y)),
    _c("RsqrtGrad", [positive(3, 4), normal(3, 4)], lambda y, dy: -0.5 * dy * y ** 3),
    _c("GeluGrad", [normal(3, 4), normal(3, 4) * 2], lambda dy, x: dy * refs.gelu_derivative(x)),
    # reductions and their gradient helpers
    _c("ReduceSum", [normal(3, 4, 2)], lambda x: x.sum(1), attrs={"axes": [1], "keep_dims": False}),
    _c("ReduceSum", [normal(3, 4)], lambda x: np.array(sum(x.ravel())), attrs={"axes": None},
       id="all"),
    _c("ReduceMean", [normal(3, 4, 2)], lambda x: x.mean((0, 2), keepdims=True),
       attrs={"axes": [0, -1], "keep_dims": True}),
    _c("ReduceMax", [distinct(3, 4, 2)], lambda x: x.max(2), attrs={"axes": [2]}),
    _c("SumToLike", [normal(2, 3, 4), normal(3, 1)], lambda g, like: g.sum(axis=(0, 2))[:, None],
       grad=False),
    _c("BroadcastLike", [normal(3), normal(3, 4)], lambda g, like: np.repeat(g[:, None], 4, 1) / 4,
       attrs={"axes": [1], "keep_dims": False, "mean": True}, grad=False),
    # matrix products
    _c("MatMul", [normal(3, 4), normal(4, 5)], lambda a, b: np.einsum("ik,kj->ij", a, b)),
    _c("MatMul", [normal(4, 3), normal(5, 4)], lambda a, b: np.einsum("ki,jk->ij", a, b),
       attrs={"transpose_a": True, "transpose_b": True}, id="tt"),
    _c("MatMul", [normal(3, 4), normal(5, 4)], lambda a, b: np.einsum("ik,jk->ij", a, b),
       attrs={"transpose_b": True}, id="nt"),
    _c("MatMul", [normal(4, 3), normal(4, 5)], lambda a, b: np.einsum("ki,kj->ij", a, b),
       attrs={"transpose_a": True}, id="tn"),
    _c("BatchMatMul", [normal(2, 3, 4), normal(2, 4, 5)], lambda a, b: np.einsum("bik,bkj->bij", a, b)),
    _c("BatchMatMul", [normal(2, 2, 4, 3), normal(1, 2, 5, 4)],
       lambda a, b: np.einsum("cbki,dbjk->cbij", a, b)[:, :, :, :],
       attrs={"adj_x": True, "adj_y": True}, id="adj-bcast"),
    _c("BiasAdd", [normal(3, 4), normal(4)], lambda x, b: x + b[None, :]),
    _c("BiasAdd", [normal(2, 3, 2, 2), normal(3)], lambda x, b: x + b[None, :, None, None],
       attrs={"data_format": "NCHW"}, id="nchw"),
    _c("BiasAddGrad", [normal(2, 3, 2, 2)], lambda g: g.sum(axis=(0, 2, 3)),
       attrs={"data_format": "NCHW"}),
    # data movement
    _c("Const", [], lambda: np.array([[1.5, -2.0], [0.25, 3.0]]),
       attrs={"value": {"dtype": "float32", "shape": [2, 2], "data": [1.5, -2.0, 0.25, 3.0]}}),
    _c("Cast", [normal(3, 4) * 3], lambda x: np.trunc(x).astype(np.int32), attrs={"dtype": "int32"},
       grad=False),
    _c("Cast", [normal(3, 4)], lambda x: x, attrs={"dtype": "float32"}, id="fp16-fp32",
       dtypes=["float16"], grad=False),
    _c("Cast", [normal(3, 4)], lambda x: x.astype(np.float16).astype(np.float64),
       attrs={"dtype": "float16"}, id="fp32-fp16", grad=False),
    _c("Cast", [normal(3, 4)], lambda x: x, attrs={"dtype": "float64"}, id="fp64"),
    _c("Identity", [normal(3, 4)], lambda x: x),
    _c("ZerosLike", [normal(3, 4)], lambda x: np.zeros((3, 4))),
    _c("OnesLike", [normal(3, 4)], lambda x: np.ones((3, 4))),
    _c("Reshape", [normal(2, 3, 4)], lambda x: np.array(x.ravel().tolist()).reshape(4, 6),
       attrs={"shape": [4, -1]}),
    _c("Transpose", [normal(2, 3, 4)], lambda x: np.einsum("abc->cab", x), attrs={"perm": [2, 0, 1]}),
    _c("Concat", [normal(2, 3), normal(2, 1), normal(2, 2)], lambda a, b, c: np.hstack([a, b, c]),
       attrs={"axis": -1}),
    _c("Slice", [normal(3, 4, 5)], lambda x: x[1:3, :, 2:4],
       attrs={"begin": [1, 0, 2], "size": [2, -1, 2]}, grad=False),
    _c("Gather", [normal(3, 5), np.array([[4, 0], [4, 2]])],
       lambda p, i: np.stack([np.stack([p[:, k] for k in row], axis=-1) for row in i], axis=1),
       attrs={"axis": 1}),
    _c("GatherGrad", [normal(4, 3), np.array([2, 0, 2, 1]), normal(5, 3)],
       lambda dy, i, p: refs.gather_grad(dy, i, p.shape, 0)),
    _c("OneHot", [np.array([[0, 3], [5, -1]])], lambda i: refs.one_hot(i, 4, 2.0, -1.0, 1),
       attrs={"depth": 4, "on_value": 2.0, "off_value": -1.0, "axis": 1}),
    # softmax family and the loss
    _c("Softmax", [normal(3, 4)], lambda x: refs.softmax(x, 1)),
    _c("Softmax", [normal(2, 3, 4)], lambda x: refs.softmax(x, 1), attrs={"axis": 1}, id="axis1"),
    _c("LogSoftmax", [normal(3, 4)], lambda x: np.log(refs.softmax(x, 1))),
    _c("SparseSoftmaxCrossEntropyWithLogits", [normal(4, 5), np.array([0, 4, 2, 2])],
       refs.sparse_softmax_ce),
    # convolution and pooling
    _c("Conv2D", [CONV_X, CONV_F], lambda x, f: refs.conv2d(x, f, [2, 1], [1, 0, 1, 1]),
       attrs=CONV_ATTRS),
    _c("Conv2DBackpropInput", [CONV_X, CONV_F, CONV_DY],
       lambda x, f, dy: refs.conv2d_input_grad(x.shape, f, dy, [2, 1], [1, 0, 1, 1]),
       attrs=CONV_ATTRS),
    _c("Conv2DBackpropFilter", [CONV_X, CONV_F, CONV_DY],
       lambda x, f, dy: refs.conv2d_filter_grad(x, f.shape, dy, [2, 1], [1, 0, 1, 1]),
       attrs=CONV_ATTRS),
    _c("MaxPool", [POOL_X], lambda x: refs.max_pool(x, [3, 2], [2, 2], [1, 1, 0, 1]),
       attrs=POOL_ATTRS),
    _c("MaxPoolGrad", [POOL_X, refs.max_pool(POOL_X, [3, 2], [2, 2], [1, 1, 0, 1]), POOL_DY],
       lambda x, y, dy: refs.max_pool_grad(x, dy, [3, 2], [2, 2], [1, 1, 0, 1]), attrs=POOL_ATTRS),
    _c("AvgPool", [normal(2, 2, 5, 5)], lambda x: refs.avg_pool(x, [3, 2], [2, 2], [1, 1, 0, 1], False),
       attrs=POOL_ATTRS),
    _c("AvgPool", [normal(2, 2, 5, 5)], lambda x: refs.avg_pool(x, [3, 2], [2, 2], [1, 1, 0, 1], True),
       attrs={**POOL_ATTRS, "count_include_pad": True}, id="include-pad"),
    _c("AvgPoolGrad", [normal(2, 2, 5, 5), POOL_DY],
       lambda x, dy: refs.avg_pool_grad(x.shape, dy, [3, 2], [2, 2], [1, 1, 0, 1], False),
       attrs=POOL_ATTRS),
    # batch norm
    _c("BatchNorm", BN_ARGS, lambda *a: refs.batch_norm(*a, 1e-3, True),
       attrs={"epsilon": 1e-3, "is_training": True}, wrt=[0, 1, 2]),
    _c("BatchNorm", BN_ARGS, lambda *a: refs.batch_norm(*a, 1e-3, False),
       attrs={"epsilon": 1e-3, "is_training": False}, id="inference", wrt=[0, 1, 2]),
    _c("BatchNorm", [normal(6, 3) * 3 + 2, positive(3), normal(3), normal(3), positive(3)],
       lambda *a: refs.batch_norm(*a, 1e-5, True), attrs={"is_training": True}, id="2d",
       wrt=[0, 1, 2]),
    _c("BatchNormGrad", [normal(4, 3, 2, 2), BN_X, positive(3), BN_X.mean((0, 2, 3)),
                         BN_X.var((0, 2, 3))],
       lambda dy, x, s, m, v: refs.batch_norm_grad(dy, x, s, m, v, 1e-3),
       attrs={"epsilon": 1e-3, "is_training": True}),
    # optimizer updates (inputs at updated positions are variables)
    _c("ApplyGradientDescent", [normal(3, 4), normal(3, 4)], lambda v, g: [v - 0.1 * g],
       attrs={"lr": 0.1}),
    _c("ApplyMomentum", [normal(3), normal(3), normal(3)],
       lambda v, a, g: [v - 0.1 * (0.9 * a + g), 0.9 * a + g], attrs={"lr": 0.1, "momentum": 0.9}),
    _c("ApplyMomentum", [normal(3), normal(3), normal(3)],
       lambda v, a, g: [v - 0.1 * (g + 0.9 * (0.9 * a + g)), 0.9 * a + g],
       attrs={"lr": 0.1, "momentum": 0.9, "use_nesterov": True}, id="nesterov"),
    _c("ApplyAdam", [normal(3), normal(3), positive(3), np.array(0.9 ** 3), np.array(0.999 ** 3),
                     normal(3)],
       lambda v, m, s, b1p, b2p, g: refs.adam_tf(v, m, s, b1p, b2p, g, 0.01, 0.9, 0.999, 1e-8),
       attrs={"lr": 0.01}),
    _c("AssignMovingAverage", [normal(3), normal(3)], lambda v, x: [0.8 * v + 0.2 * x],
       attrs={"decay": 0.8}),
]

LN_ROLES = ["y", "mean", "centered", "square", "variance", "var_eps", "inv", "normalized", "scaled"]
LN_X = normal(3, 8) * 2 + 0.5
RMS_ROLES = ["y", "square", "mean_square", "var_eps", "inv", "normalized"]
ELTWISE_STEPS = [{"type": "Mul", "inputs": ["in:0", "in:1"], "attrs": {}},
                 {"type": "Add", "inputs": ["step:0", "in:2"], "attrs": {}},
                 {"type": "Relu", "inputs": ["step:1"], "attrs": {}}]

# Op types of compiled NPU graphs (fused kernels, formats, status, loss scale). Their fp16
# behaviour is tested in test_npu.py; here their fp32/fp64 numerics.
CASES += [
    _c("LayerNorm", [LN_X, positive(8), normal(8)],
       lambda x, g, b: [refs.layer_norm_roles(x, g, b, 1e-3)[r] for r in LN_ROLES],
       attrs={"epsilon": 1e-3, "roles": LN_ROLES}),
    _c("RmsNorm", [LN_X, positive(8)],
       lambda x, g: refs.rms_norm_roles(x, g, 1e-3),
       attrs={"epsilon": 1e-3, "roles": RMS_ROLES}),
    _c("SoftmaxV2", [normal(2, 3, 5)], lambda x: refs.softmax(x, 2), attrs={"axis": -1}),
    _c("FastGelu", [normal(3, 4) * 2],
       lambda x: [x / 2 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))]),
    _c("MatMulV2", [normal(3, 4), normal(5, 4), normal(5)],
       lambda a, b, c: [a @ b.T + c, a @ b.T],
       attrs={"transpose_b": True, "roles": ["y", "matmul"]}),
    _c("BatchMatMulV2", [normal(2, 3, 4), normal(2, 5, 4)],
       lambda a, b: [np.einsum("bik,bjk->bij", a, b) * 0.25, np.einsum("bik,bjk->bij", a, b)],
       attrs={"adj_y": True, "alpha": 0.25, "roles": ["y", "batch_matmul"]}),
    _c("Conv2DBatchNorm", [CONV_X, CONV_F, positive(4), normal(4), normal(4), positive(4)],
       lambda x, f, s, o, m, v: [refs.batch_norm(refs.conv2d(x, f, [2, 1], [1, 0, 1, 1]), s, o, m, v,
                                                 1e-3, False)[0], refs.conv2d(x, f, [2, 1], [1, 0, 1, 1]), m, v],
       attrs={**CONV_ATTRS, "epsilon": 1e-3, "roles": ["y", "conv", "batch_mean", "batch_variance"]}),
    _c("FusedEltwise", [normal(3, 4), normal(3, 4), normal(4)],
       lambda a, b, c: [np.maximum(a * b + c, 0), a * b],
       attrs={"steps": ELTWISE_STEPS, "role_steps": {"y": "step:2", "product": "step:0"},
              "roles": ["y", "product"]}),
    _c("TransData", [normal(2, 20, 3, 2)], refs.to_5hd,
       attrs={"src_format": "ND", "dst_format": "NC1HWC0", "original_shape": [2, 20, 3, 2]}),
    _c("TransData", [refs.to_5hd(normal(2, 20, 3, 2))], lambda x: np.concatenate(
        [x[:, 0].transpose(0, 3, 1, 2), x[:, 1].transpose(0, 3, 1, 2)[:, :4]], axis=1),
       attrs={"src_format": "NC1HWC0", "dst_format": "ND", "original_shape": [2, 20, 3, 2]},
       id="to-nchw"),
    _c("NPUGetFloatStatus", [normal(3), normal(2, 2)], lambda a, b: np.array(0.0)),
    _c("NPUGetFloatStatus", [normal(3), np.array([1.0, np.inf])], lambda a, b: np.array(32.0),
       id="inf-input"),
    _c("NPUClearFloatStatus", [], lambda: np.array(0.0)),
    _c("UpdateLossScale", [np.array(1024.0), np.array(1999.0), np.array(0.0), np.array(1.0),
                           np.array(True)],
       lambda s, g, b, l, f: [np.array(2048.0), np.array(0.0), np.array(0.0), np.array(1.0)],
       attrs={"incr_every_n_steps": 2000}),
    _c("UpdateLossScale", [np.array(1024.0), np.array(5.0), np.array(0.0), np.array(1.0),
                           np.array(False)],
       lambda s, g, b, l, f: [np.array(512.0), np.array(0.0), np.array(0.0), np.array(0.0)],
       id="overflow"),
    _c("UpdateLossScale", [np.array(1024.0), np.array(5.0), np.array(0.0), np.array(1.0),
                           np.array(False)],
       lambda s, g, b, l, f: [np.array(1024.0), np.array(0.0), np.array(1.0), np.array(0.0)],
       attrs={"dynamic": False}, id="fixed"),
]

# Ops whose behaviour is not a function of inputs, tested where it lives instead.
STRUCTURAL = {
    "Placeholder": "test_runtime.py (feeds)",
    "Variable": "test_runtime.py (initializers, state across steps)",
    "NoOp": "test_runtime.py (train_op runs its inputs)",
    "Dropout": "test_ops_forward.py::test_dropout_mask (random by design)",
}

# Ops the ONNX import added (their own generator: the draws above stay as they were).
_R2 = np.random.default_rng(4321)
GCONV_X, GCONV_F = _R2.normal(size=(2, 4, 5, 5)), _R2.normal(size=(6, 2, 3, 3))
GCONV_ATTRS = {"strides": [1, 2], "pads": [1, 1, 0, 1], "groups": 2}


def _grouped(fn, x, f, g=2):
    """A grouped convolution as g plain ones on each group's channels (refs only)."""
    xs, fs = np.split(x, g, axis=1), np.split(f, g, axis=0)
    return np.concatenate([fn(a, b) for a, b in zip(xs, fs)], axis=1)


def _grouped_conv(x, f):
    return _grouped(lambda a, b: refs.conv2d(a, b, [1, 2], [1, 1, 0, 1]), x, f)


GCONV_DY = _R2.normal(size=_grouped_conv(GCONV_X, GCONV_F).shape)
CASES += [
    _c("Conv2D", [GCONV_X, GCONV_F], _grouped_conv, attrs=GCONV_ATTRS, id="groups2"),
    _c("Conv2DBackpropInput", [GCONV_X, GCONV_F, GCONV_DY],
       lambda x, f, dy: np.concatenate([refs.conv2d_input_grad(a.shape, b, d, [1, 2], [1, 1, 0, 1])
                                        for a, b, d in zip(np.split(x, 2, 1), np.split(f, 2, 0),
                                                           np.split(dy, 2, 1))], axis=1),
       attrs=GCONV_ATTRS, id="groups2"),
    _c("Conv2DBackpropFilter", [GCONV_X, GCONV_F, GCONV_DY],
       lambda x, f, dy: np.concatenate([refs.conv2d_filter_grad(a, b.shape, d, [1, 2], [1, 1, 0, 1])
                                        for a, b, d in zip(np.split(x, 2, 1), np.split(f, 2, 0),
                                                           np.split(dy, 2, 1))], axis=0),
       attrs=GCONV_ATTRS, id="groups2"),
    _c("Erf", [_R2.normal(size=(3, 5)) * 2], lambda x: np.vectorize(math.erf)(x)),
    _c("HardSigmoid", [_R2.normal(size=(4, 6)) * 4],
       lambda x: np.minimum(np.maximum(0.25 * x + 0.4, 0.0), 1.0),
       attrs={"alpha": 0.25, "beta": 0.4}),
    _c("ClipByValue", [np.array([[-3.0, -0.5, 0.0, 0.7, 6.5, np.nan]])],
       lambda x: np.where(np.isnan(x), np.nan, np.minimum(np.maximum(x, -1.0), 6.0)),
       attrs={"clip_min": -1.0, "clip_max": 6.0}, grad=False),
    _c("ClipByValue", [_R2.normal(size=(3, 4))], lambda x: np.minimum(x, 0.5),
       attrs={"clip_max": 0.5}, id="max-only"),
    _c("ClipByValue", [_R2.normal(size=(3, 4)) * 2], lambda x: np.clip(x, -1.0, 1.5),
       attrs={"clip_min": -1.0, "clip_max": 1.5}, id="both"),
    _c("BroadcastTo", [_R2.normal(size=(3, 1))], lambda x: np.tile(x, (2, 1, 4)),
       attrs={"shape": [2, 1, 4]}),
]

# Bool logic and float tests (the ONNX import's And / Or / Not / IsNaN / IsInf), reference
# elementwise in Python.
_B34, _B4 = _R2.random((3, 4)) > 0.5, _R2.random(4) > 0.5
_SPECIAL = np.array([[0.0, -1.5, np.nan, np.inf], [-np.inf, 65504.0, -0.0, np.nan]])
CASES += [
    _c("LogicalAnd", [_B34, _B4],
       lambda x, y: np.array([[bool(x[i, j]) and bool(y[j]) for j in range(4)] for i in range(3)])),
    _c("LogicalOr", [_B34, _B4],
       lambda x, y: np.array([[bool(x[i, j]) or bool(y[j]) for j in range(4)] for i in range(3)])),
    _c("LogicalNot", [_B34], lambda x: np.array([[not v for v in row] for row in x])),
    _c("IsNan", [_SPECIAL], lambda x: np.array([[v != v for v in row] for row in x]), grad=False),
    _c("IsInf", [_SPECIAL], lambda x: np.array([[abs(v) == math.inf for v in row] for row in x]),
       grad=False),
    _c("IsInf", [_SPECIAL], lambda x: np.array([[v == -math.inf for v in row] for row in x]),
       attrs={"detect_positive": False}, grad=False, id="negative-only"),
]
