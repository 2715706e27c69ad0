"""Dumps written by Ascend's tools: no index, the tensors' names say what they are
(<OpType>.<op_name>.<task_id>[.<stream_id>].<timestamp>.<input|output>.<i>.npy on the NPU,
<op_name>.<output>.<timestamp>.npy for the golden), their .npy headers the dtype and shape.
Any step directory is read this way when no other format claims it."""
from __future__ import annotations

import os
import re

import numpy as np

from ...table import Table
from .. import layout
from .npy import npy_header
from .ours import INDEX_COLUMNS, NUMBER_COLUMNS

ASCEND_NPU_NAME = re.compile(
    r"^(?P<op_type>[^.]+)\.(?P<op_name>[^.]+)\.(?P<task_id>\d+)(?:\.(?P<stream_id>\d+))?"
    r"\.(?P<timestamp>\d+)\.(?P<io>input|output)\.(?P<index>\d+)\.npy$")
CPU_NAME = re.compile(r"^(?P<op_name>[^.]+)\.(?P<index>\d+)\.(?P<timestamp>\d+)\.npy$")


def claims(step_dir: str) -> bool:
    return True


def read_index(step_dir: str, kind: str) -> Table:
    """Index a step directory written by Ascend's tools from its file names and npy headers."""
    rows = []
    pattern = ASCEND_NPU_NAME if kind == layout.DEVICE else CPU_NAME
    for name in sorted(os.listdir(step_dir)):
        m = pattern.match(name)
        if not m:
            continue
        try:
            shape, _, dtype = npy_header(os.path.join(step_dir, name))
        except (OSError, ValueError):
            continue        # unreadable files are not indexed (the analysis reports them)
        row = m.groupdict()
        io_ = row.get("io", "output")
        # an output is its op's tensor; what an input file holds, its name does not say
        row.update(file=name, shape=" ".join(map(str, shape)), dtype=str(dtype), io=io_,
                   op_type=row.get("op_type", ""),
                   tensor=f"{row['op_name']}:{row['index']}" if io_ == "output" else "")
        for col in ("task_id", "stream_id", "timestamp", "index"):
            if col in row:
                row[col] = float(row[col]) if row[col] is not None else np.nan
        rows.append(row)
    names = list(dict.fromkeys([*INDEX_COLUMNS, *(k for r in rows for k in r)]))
    if not rows:        # the index's columns even where no file matched: an empty step
        return Table({k: np.empty(0, float if k in NUMBER_COLUMNS else object) for k in names}, 0)
    return Table.from_rows(rows, names)


def read_calls(step_dir: str) -> dict:
    return {}           # file names say nothing of modules or source lines
