"""The on-disk formats a workspace's steps are read in, one module each: ours (an index.csv
beside the tensors), msprobe's (a dump.json of calls), Ascend's (no index: the files' names
say what they hold), and the tensor files they hold (.npy, torch.save's .pt). The workspace lists runs and steps and asks the first format that
claims a step directory for its index: a Table of INDEX_COLUMNS (and any more a format has),
the statistics where it knows them."""
from __future__ import annotations

from ...table import Table
from . import ascend, msprobe, ours
from .npy import MMAP_BYTES, BFLOAT16, npy_header, read_tensor_file, stored_dtype  # noqa: F401
from .ours import INDEX_COLUMNS, INTEGER_COLUMNS, NUMBER_COLUMNS, STAT_COLUMNS  # noqa: F401

# in the order they are asked: each module has claims(step_dir), read_index(step_dir, kind)
# and read_calls(step_dir); the last claims any directory
FORMATS = (ours, msprobe, ascend)


def read_step_index(step_dir: str, kind: str) -> Table:
    """The index of a whole step directory of a run of this kind (layout.DEVICE or
    layout.REFERENCE), read by the first format that claims it."""
    for fmt in FORMATS:
        if fmt.claims(step_dir):
            return fmt.read_index(step_dir, kind)
    raise AssertionError("the last format claims every directory")


def read_step_calls(step_dir: str) -> dict:
    """A step's call sites (op name -> {"module", "source"}) as its format knows them, {}
    where it knows none."""
    for fmt in FORMATS:
        if fmt.claims(step_dir):
            return fmt.read_calls(step_dir)
    return {}
