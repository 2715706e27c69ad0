"""The fast paths' one seam. Each function here computes what its numpy code defines; where
the C module (precision_tool._reduce) is built and PRECISION_TOOL_NUMPY_ONLY is not set, C
loops compute the same numbers (the tests run both ways). Callers do not ask which runs.

- stats: tensor statistics (tensor_stats, stats_row, stats_table / batch_stats, table_text /
  stats_text, SourceRows)
- rounding: fp16/bf16 rounding of results with saturation and the overflow it shows
  (round_result, rounder)
- totals: the totals of a pair that every comparison metric is made of, KL's sums
  (Totals, span_totals, span_kl)
- writer_running: whether the C module's dump writer thread is alive (a process that forks
  must not copy its locks); threads: how many threads a comparison may use here
- write: the bytes of a dumped step and the call that writes them (npy headers, the index
  text, write_files), and the C writer thread (native_writer) that dump.writer drives
- csv_columns: a CSV file's columns parsed by the C module (table.read_csv defines them)
- native: the C module itself, imported by this package alone
"""
from .native import threads, writer_running  # noqa: F401
from .csv import csv_columns  # noqa: F401
from .rounding import round_result, rounder  # noqa: F401
from .stats import (STAT_FIELDS, STATS_BLOCK, SourceRows, batch_stats, stats_kind,  # noqa: F401
                    stats_row, stats_table, stats_text, table_text, tensor_stats)
