"""The fast paths' one seam. Each function here computes what its numpy code defines; where
the C module (precision_tool._reduce) is built and PRECISION_TOOL_NUMPY_ONLY is not set, C
loops compute the same numbers (the tests run both ways). Callers do not ask which runs.

- stats: tensor statistics (tensor_stats, stats_row, batch_stats, stats_text, SourceRows)
- grid: fp16/bf16 rounding of results with saturation and the overflow it shows
  (round_result, rounder)
- native: the C module itself; the compare totals (analysis.metrics) and the step writing
  (dump.writer, dump.stepplan, dump.replay) still call it directly: the next to move here.
"""
from .grid import round_result, rounder  # noqa: F401
from .stats import (STAT_FIELDS, STATS_BLOCK, SourceRows, batch_stats, stats_row,  # noqa: F401
                    stats_text, tensor_stats)
