"""Canonical dtype names of the IR and their numpy types.

The IR names dtypes by string so that graphs serialise to JSON; bfloat16 comes from ml_dtypes.
"""
import ml_dtypes
import numpy as np

from ..errors import GraphError

_NUMPY = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "bool": np.dtype(np.bool_),
}
_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "bf16": "bfloat16",
            "fp16": "float16", "fp32": "float32", "fp64": "float64"}

ALL_DTYPES = frozenset(_NUMPY)             # every dtype a tensor of the IR may have
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
INT_DTYPES = frozenset({"int8", "uint8", "int32", "int64"})


def canonical(dtype) -> str:
    """Canonical name of a dtype given as a name, numpy dtype or numpy type."""
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype, dtype)
        if name in _NUMPY:
            return name
        raise GraphError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(_NUMPY))}")
    try:
        npd = np.dtype(dtype)
    except TypeError:
        raise GraphError(f"unknown dtype {dtype!r}") from None
    for name, known in _NUMPY.items():
        if known == npd:
            return name
    raise GraphError(f"unsupported dtype {npd}; supported: {', '.join(sorted(_NUMPY))}")


def to_numpy(dtype) -> np.dtype:
    return _NUMPY[canonical(dtype)]


def is_float(dtype) -> bool:
    return canonical(dtype) in FLOAT_DTYPES


def category(dtype) -> str:
    """'float', 'int', 'bool', or 'other' (bfloat16 is a float although numpy's kind is 'V')."""
    try:
        name = canonical(dtype)
    except GraphError:
        return "other"
    return "float" if name in FLOAT_DTYPES else "int" if name in INT_DTYPES else "bool"
