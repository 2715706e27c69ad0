"""Session configuration."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import PrecisionToolError

GOLDEN_DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class SessionConfig:
    """How a Session runs its graph.

    golden_dtype: the float dtype the CPU golden executor computes in ("float32", or
    "float64" for a reference run); every float tensor of the graph runs as this dtype.
    """
    golden_dtype: str = "float32"

    def __post_init__(self):
        if self.golden_dtype not in GOLDEN_DTYPES:
            raise PrecisionToolError(f"golden_dtype must be one of {GOLDEN_DTYPES}, "
                                     f"got {self.golden_dtype!r}")
