"""Shape and data-movement ops: Const, Cast, Identity, Reshape, Transpose, Concat, Slice,
Gather, OneHot, ZerosLike/OnesLike."""
from __future__ import annotations

import numpy as np

from ..graph import Tensor, TensorSpec, dtypes
from . import rules
from .registry import AICPU, make, register


def _t(node):
    return node.output(0)


# -- Const -----------------------------------------------------------------------------------
def encode_value(array: np.ndarray, dtype: str) -> dict:
    """A constant as JSON-exact data: floats through float64 (exact for every float dtype)."""
    arr = np.asarray(array, dtype=dtypes.to_numpy(dtype))
    data = arr.astype(np.float64) if dtypes.is_float(dtype) else arr
    return {"dtype": dtype, "shape": list(arr.shape), "data": data.ravel().tolist()}


def decode_value(value: dict, float_dtype=None) -> np.ndarray:
    dtype = dtypes.to_numpy(value["dtype"])
    if float_dtype is not None and dtypes.is_float(value["dtype"]):
        # a constant is rounded to its declared dtype first, as the original graph would hold it
        arr = np.asarray(value["data"], dtype=np.float64).astype(dtype).astype(float_dtype)
    else:
        arr = np.asarray(value["data"], dtype=np.float64 if dtype.kind == "f" else None).astype(dtype)
    return arr.reshape(value["shape"])


def _const_infer(specs, attrs, where):
    v = attrs.get("value")
    if not isinstance(v, dict) or not {"dtype", "shape", "data"} <= set(v):
        rules.fail(where, "Const needs a value attribute {dtype, shape, data}")
    spec = TensorSpec.make(v["shape"], v["dtype"])
    if int(np.prod(spec.shape)) != len(v["data"]):
        rules.fail(where, f"Const value of shape {list(spec.shape)} has {len(v['data'])} elements")
    return [spec]


register("Const", infer=_const_infer, kernel=lambda i, a, c: decode_value(a["value"], c.float_dtype),
         constant=True, doc="a constant tensor held in the graph")


def constant(value, dtype=None, name=None) -> Tensor:
    """A Const tensor; dtype defaults to float32 for floats and int32 for ints."""
    arr = np.asarray(value)
    if dtype is None:
        dtype = "float32" if arr.dtype.kind == "f" else "int32" if arr.dtype.kind in "iu" else arr.dtype
    return _t(make("Const", [], {"value": encode_value(arr, dtypes.canonical(dtype))},
                   name=name or "Const"))


# -- Cast / Identity / *Like -----------------------------------------------------------------
def _cast_infer(specs, attrs, where):
    return [TensorSpec(specs[0].shape, dtypes.canonical(attrs["dtype"]))]


def _cast_kernel(i, a, c):
    # Rounds to the target dtype, then holds the result in the run dtype: an explicit cast to
    # fp16 in a model rounds even in an fp32 golden run.
    with np.errstate(over="ignore", invalid="ignore"):
        return i[0].astype(dtypes.to_numpy(a["dtype"])).astype(c.resolve_dtype(a["dtype"]))


def _grad_cast(c):
    x = c.x[0]
    if not (dtypes.is_float(x.dtype) and dtypes.is_float(c.attrs["dtype"])):
        return [None]
    return [cast(c.dy, x.dtype)]


register("Cast", infer=_cast_infer, kernel=_cast_kernel, grad=_grad_cast, min_inputs=1,
         doc="convert to attrs.dtype (round to nearest even; out-of-range floats become inf; "
             "float to int truncates toward zero)")
register("Identity", infer=rules.same_as_first, kernel=lambda i, a, c: i[0].copy(),
         grad=lambda c: [c.dy], min_inputs=1, doc="y = x")
register("ZerosLike", infer=rules.same_as_first, kernel=lambda i, a, c: np.zeros_like(i[0]),
         min_inputs=1, doc="zeros of x's shape and dtype")
register("OnesLike", infer=rules.same_as_first, kernel=lambda i, a, c: np.ones_like(i[0]),
         min_inputs=1, doc="ones of x's shape and dtype")


def cast(x, dtype, name=None):
    return _t(make("Cast", [x], {"dtype": dtypes.canonical(dtype)}, name=name))


def identity(x, name=None):
    return _t(make("Identity", [x], name=name))


# -- Reshape / Transpose ---------------------------------------------------------------------
def _reshape_infer(specs, attrs, where):
    x = specs[0]
    shape = list(attrs["shape"])
    if sum(1 for d in shape if d == -1) > 1 or any(d < -1 for d in shape):
        rules.fail(where, f"shape {shape} may hold at most one -1 and no other negative")
    known = int(np.prod([d for d in shape if d != -1]))
    if None in x.shape:
        return [TensorSpec(tuple(None if d == -1 else d for d in shape), x.dtype)]
    total = int(np.prod(x.shape))
    if -1 in shape:
        if known == 0 or total % known:
            rules.fail(where, f"cannot reshape {x} into {shape}")
        shape = [total // known if d == -1 else d for d in shape]
    elif known != total:
        rules.fail(where, f"cannot reshape {x} ({total} elements) into {shape} ({known} elements)")
    return [TensorSpec(tuple(shape), x.dtype)]


def _reshape_kernel(i, a, c):
    x = i[0]
    try:
        return x.reshape(a["shape"])
    except ValueError:
        raise ValueError(f"cannot reshape array of shape {list(x.shape)} into {a['shape']}") from None


def _grad_reshape(c):
    x = c.x[0]
    if sum(1 for d in x.shape if d is None) > 1:
        rules.fail(rules.where_of(c.node), "gradient needs at most one unknown dimension in the input")
    return [reshape(c.dy, [-1 if d is None else d for d in x.shape])]


register("Reshape", infer=_reshape_infer, kernel=_reshape_kernel, grad=_grad_reshape,
         min_inputs=1, doc="reshape to attrs.shape (one -1 allowed)")


def _transpose_infer(specs, attrs, where):
    x = specs[0]
    perm = attrs.get("perm")
    rank = len(x.shape)
    if perm is None:
        perm = list(range(rank))[::-1]
    if sorted(perm) != list(range(rank)):
        rules.fail(where, f"perm {perm} is not a permutation of the {rank} axes of {x}")
    return [TensorSpec(tuple(x.shape[p] for p in perm), x.dtype)]


def _perm(a, x):
    return a["perm"] if a.get("perm") is not None else list(range(x.ndim))[::-1]


def _inverse_perm(c):
    perm = c.attrs.get("perm")
    perm = list(range(c.x[0].ndim))[::-1] if perm is None else perm
    return [int(k) for k in np.argsort(perm)]


register("Transpose", infer=_transpose_infer,
         kernel=lambda i, a, c: np.transpose(i[0], _perm(a, i[0])).copy(),
         grad=lambda c: [transpose(c.dy, _inverse_perm(c))],
         min_inputs=1, attrs={"perm": None}, doc="permute axes (reverse them by default)")


def _broadcast_to_infer(specs, attrs, where):
    return [TensorSpec(rules.broadcast_shapes(specs[0].shape, tuple(attrs["shape"]), where),
                       specs[0].dtype)]


register("BroadcastTo", infer=_broadcast_to_infer,
         kernel=lambda i, a, c: np.array(np.broadcast_to(
             i[0], np.broadcast_shapes(i[0].shape, tuple(a["shape"])))),
         grad=lambda c: [_t(make("SumToLike", [c.dy, c.x[0]], name="SumToLike"))],
         min_inputs=1, attrs={"shape": []},
         doc="numpy broadcasting against attrs.shape (ONNX Expand: the result may be larger)")


def broadcast_to(x, shape, name=None):
    return _t(make("BroadcastTo", [x], {"shape": [int(d) for d in shape]}, name=name))


def reshape(x, shape, name=None):
    return _t(make("Reshape", [x], {"shape": [int(d) for d in shape]}, name=name))


def transpose(x, perm=None, name=None):
    return _t(make("Transpose", [x], {"perm": None if perm is None else [int(p) for p in perm]},
                   name=name))


# -- Concat / Slice --------------------------------------------------------------------------
def _concat_infer(specs, attrs, where):
    dtype = rules.same_dtype(specs, where)
    rank = len(specs[0].shape)
    axis = rules.normalize_axis(attrs["axis"], rank, where)
    out = list(specs[0].shape)
    for k, s in enumerate(specs[1:], 1):
        if len(s.shape) != rank or not all(rules.dims_equal(a, b) for i, (a, b) in
                                           enumerate(zip(out, s.shape)) if i != axis):
            rules.fail(where, f"input {k} is {s}, which does not fit {specs[0]} outside axis {axis}")
        out[axis] = None if out[axis] is None or s.shape[axis] is None else out[axis] + s.shape[axis]
    return [TensorSpec(tuple(out), dtype)]


def _grad_concat(c):
    axis = c.attrs["axis"] % c.x[0].ndim
    sizes = [x.shape[axis] for x in c.x]
    if None in sizes:
        rules.fail(rules.where_of(c.node), "gradient needs static sizes along the concat axis")
    grads, start = [], 0
    for x, size in zip(c.x, sizes):
        begin = [0] * x.ndim
        begin[axis] = start
        extent = [-1] * x.ndim
        extent[axis] = size
        grads.append(slice_(c.dy, begin, extent))
        start += size
    return grads


register("Concat", infer=_concat_infer, kernel=lambda i, a, c: np.concatenate(i, axis=a["axis"]),
         grad=_grad_concat, min_inputs=1, max_inputs=-1, attrs={"axis": 0},
         doc="join tensors along axis")


def _slice_infer(specs, attrs, where):
    x = specs[0]
    begin, size = attrs["begin"], attrs["size"]
    if len(begin) != len(x.shape) or len(size) != len(x.shape):
        rules.fail(where, f"begin {begin} and size {size} must have one entry per axis of {x}")
    out = []
    for b, s, d in zip(begin, size, x.shape):
        if b < 0 or s < -1 or (d is not None and b + max(s, 0) > d):
            rules.fail(where, f"slice begin {begin} size {size} does not fit {x}")
        out.append((None if d is None else d - b) if s == -1 else s)
    return [TensorSpec(tuple(out), x.dtype)]


def _slice_kernel(i, a, c):
    x = i[0]
    index = tuple(slice(b, None if s == -1 else b + s) for b, s in zip(a["begin"], a["size"]))
    return x[index].copy()


register("Slice", infer=_slice_infer, kernel=_slice_kernel, min_inputs=1,
         doc="x[begin : begin + size] per axis (size -1: to the end)")


def concat(values, axis, name=None):
    return _t(make("Concat", list(values), {"axis": int(axis)}, name=name))


def slice_(x, begin, size, name=None):
    return _t(make("Slice", [x], {"begin": [int(b) for b in begin], "size": [int(s) for s in size]},
                   name=name))


# -- Gather / OneHot -------------------------------------------------------------------------
def _gather_infer(specs, attrs, where):
    params, indices = specs
    if indices.dtype not in dtypes.INT_DTYPES:
        rules.fail(where, f"indices must be integers, got {indices}")
    axis = rules.normalize_axis(attrs["axis"], len(params.shape), where)
    shape = params.shape[:axis] + indices.shape + params.shape[axis + 1:]
    return [TensorSpec(shape, params.dtype)]


def _gather_kernel(i, a, c):
    params, indices = i
    n = params.shape[a["axis"]]
    if indices.size and (indices.min() < -n or indices.max() >= n):
        raise IndexError(f"index {int(indices.max() if indices.max() >= n else indices.min())} "
                         f"is out of range for axis {a['axis']} of size {n}")
    return np.take(params, indices, axis=a["axis"])


def _grad_gather(c):
    params, indices = c.x
    return [_t(make("GatherGrad", [c.dy, indices, params], {"axis": c.attrs["axis"]})), None]


def _gather_grad_infer(specs, attrs, where):
    return [TensorSpec(specs[2].shape, specs[0].dtype)]


def _gather_grad_kernel(i, a, c):
    dy, indices, params = i
    axis = a["axis"] % params.ndim
    out = np.zeros(params.shape, dtype=dy.dtype)
    moved = np.moveaxis(out, axis, 0)           # a view: writes land in `out`
    g = np.moveaxis(dy.reshape(params.shape[:axis] + (-1,) + params.shape[axis + 1:]), axis, 0)
    np.add.at(moved, indices.ravel() % params.shape[axis], g)
    return out


register("Gather", infer=_gather_infer, kernel=_gather_kernel, grad=_grad_gather, min_inputs=2,
         attrs={"axis": 0}, doc="take slices of params along axis at integer indices (embedding)")
register("GatherGrad", infer=_gather_grad_infer, kernel=_gather_grad_kernel, unit=AICPU,
         min_inputs=3, attrs={"axis": 0}, shape_inputs=(2,),
         doc="(dy, indices, params): scatter-add dy into zeros shaped like params")


def _one_hot_infer(specs, attrs, where):
    idx = specs[0]
    if idx.dtype not in dtypes.INT_DTYPES:
        rules.fail(where, f"indices must be integers, got {idx}")
    rank = len(idx.shape) + 1
    axis = rules.normalize_axis(attrs["axis"], rank, where)
    shape = list(idx.shape)
    shape.insert(axis, int(attrs["depth"]))
    return [TensorSpec(tuple(shape), dtypes.canonical(attrs["dtype"]))]


def _one_hot_kernel(i, a, c):
    idx = i[0].astype(np.int64)
    depth = int(a["depth"])
    dtype = c.resolve_dtype(a["dtype"])
    hot = np.arange(depth).reshape((depth,) + (1,) * idx.ndim) == idx[None]
    out = np.where(hot, a["on_value"], a["off_value"]).astype(dtype)
    return np.moveaxis(out, 0, a["axis"] % (idx.ndim + 1))


register("OneHot", infer=_one_hot_infer, kernel=_one_hot_kernel, min_inputs=1,
         attrs={"axis": -1, "on_value": 1.0, "off_value": 0.0, "dtype": "float32"},
         doc="one-hot encoding; indices outside [0, depth) give an all-off row")


def gather(params, indices, axis=0, name=None):
    return _t(make("Gather", [params, indices], {"axis": int(axis)}, name=name))


def one_hot(indices, depth, on_value=1.0, off_value=0.0, axis=-1, dtype="float32", name=None):
    return _t(make("OneHot", [indices], {"depth": int(depth), "on_value": float(on_value),
                                         "off_value": float(off_value), "axis": int(axis),
                                         "dtype": dtypes.canonical(dtype)}, name=name))
