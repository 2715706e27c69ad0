"""The analysis layer (in progress): metrics first; overflow analysis, vector compare, root
cause and replays build on them."""
from .metrics import METRICS, compare_tensors

__all__ = ["METRICS", "compare_tensors"]
