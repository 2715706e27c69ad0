"""Reusable shape/dtype rules for op entries. Unknown dimensions are None."""
from __future__ import annotations

from typing import List, Optional, Sequence

from ..errors import GraphError
from ..graph import TensorSpec, dtypes, format_shape


def fail(where: str, msg: str):
    raise GraphError(f"{where}: {msg}")


def where_of(node) -> str:
    """How errors name an op: its type and full name."""
    return f"{node.type} {node.name}"


def broadcast_shapes(a, b, where: str, names=("x", "y")):
    ra, rb = list(a), list(b)
    n = max(len(ra), len(rb))
    ra = [1] * (n - len(ra)) + ra
    rb = [1] * (n - len(rb)) + rb
    out = []
    for da, db in zip(ra, rb):
        if da == 1:
            out.append(db)
        elif db == 1:
            out.append(da)
        elif da is None:
            out.append(db)
        elif db is None or da == db:
            out.append(da)
        else:
            fail(where, f"shapes do not broadcast: {names[0]} is {format_shape(tuple(a))}, "
                        f"{names[1]} is {format_shape(tuple(b))}")
    return tuple(out)


def same_dtype(specs: Sequence[TensorSpec], where: str, names=None):
    first = specs[0].dtype
    for i, s in enumerate(specs[1:], 1):
        if s.dtype != first:
            labels = names or [f"input {k}" for k in range(len(specs))]
            fail(where, f"dtypes differ: {labels[0]} is {first}, {labels[i]} is {s.dtype}")
    return first


def require_float(spec: TensorSpec, where: str, what="input"):
    if not dtypes.is_float(spec.dtype):
        fail(where, f"{what} must be a float tensor, got {spec}")


def require_rank(spec: TensorSpec, ranks, where: str, what="input"):
    ranks = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    if len(spec.shape) not in ranks:
        fail(where, f"{what} must have rank {' or '.join(map(str, ranks))}, got {spec}")


def dims_equal(a: Optional[int], b: Optional[int]) -> bool:
    return a is None or b is None or a == b


def normalize_axis(axis: int, rank: int, where: str) -> int:
    if not -rank <= axis < max(rank, 1):
        fail(where, f"axis {axis} is out of range for rank {rank}")
    return axis % rank if rank else 0


def normalize_axes(axes, rank: int, where: str) -> List[int]:
    if axes is None:
        return list(range(rank))
    axes = [axes] if isinstance(axes, int) else list(axes)
    out = sorted({normalize_axis(a, rank, where) for a in axes})
    return out


def reduced_shape(shape, axes: List[int], keep_dims: bool):
    if keep_dims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


# -- entry-sized rules ------------------------------------------------------------------------
def unary_float(specs, attrs, where):
    require_float(specs[0], where)
    return [specs[0]]


def unary_numeric(specs, attrs, where):
    if specs[0].dtype == "bool":
        fail(where, f"input must be numeric, got {specs[0]}")
    return [specs[0]]


def same_as_first(specs, attrs, where):
    return [specs[0]]


def binary(specs, attrs, where):
    dtype = same_dtype(specs, where, ("x", "y"))
    if dtype == "bool":
        fail(where, "arithmetic on bool tensors is not supported")
    return [TensorSpec(broadcast_shapes(specs[0].shape, specs[1].shape, where), dtype)]


def binary_float(specs, attrs, where):
    out = binary(specs, attrs, where)
    require_float(specs[0], where, "x")
    return out


def comparison(specs, attrs, where):
    same_dtype(specs, where, ("x", "y"))
    return [TensorSpec(broadcast_shapes(specs[0].shape, specs[1].shape, where), "bool")]


def logical(specs, attrs, where):
    """bool tensors (broadcast) -> bool: LogicalAnd, LogicalOr, LogicalNot."""
    for k, s in enumerate(specs):
        if s.dtype != "bool":
            fail(where, f"input {k} must be bool, got {s}")
    shape = specs[0].shape
    for s in specs[1:]:
        shape = broadcast_shapes(shape, s.shape, where)
    return [TensorSpec(shape, "bool")]


def float_test(specs, attrs, where):
    """A float tensor -> a bool tensor of its shape: IsNan, IsInf."""
    require_float(specs[0], where)
    return [TensorSpec(specs[0].shape, "bool")]


def elementwise_grad(specs, attrs, where):
    """(a, b) of one shape and dtype -> that shape: the TF *Grad ops (ReluGrad, TanhGrad...)."""
    same_dtype(specs, where)
    a, b = specs[0].shape, specs[1].shape
    if len(a) != len(b) or not all(dims_equal(x, y) for x, y in zip(a, b)):
        fail(where, f"inputs must have one shape, got {format_shape(a)} and {format_shape(b)}")
    return [TensorSpec(tuple(x if x is not None else y for x, y in zip(a, b)), specs[0].dtype)]


def like_second(specs, attrs, where):
    """Output takes the shape of input 1 and the dtype of input 0 (SumToLike, BroadcastLike)."""
    if specs[0].dtype != specs[1].dtype:
        fail(where, f"dtypes differ: {specs[0].dtype} and {specs[1].dtype}")
    return [TensorSpec(specs[1].shape, specs[0].dtype)]
