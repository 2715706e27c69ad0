"""Our own format: a step directory with its index.csv (one row per tensor: names, io,
dtype, shape, statistics and the file that holds it), written last, so that a step with an
index is whole. The tensors are .npy files (formats.npy)."""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from typing import TYPE_CHECKING, Optional

import numpy as np

from ...errors import GraphFormatError, PrecisionToolError, WorkspaceError
from ...fileio import load_json, open_regular, parse_json, read_bytes
from ...table import Table, TableError, read_csv
from ...version import __version__
from .. import layout

if TYPE_CHECKING:
    import pandas as pd

STAT_COLUMNS = ("max", "min", "mean", "l2norm")    # every index has them, as floats
INDEX_COLUMNS = ("op_type", "op_name", "io", "index", "tensor", "dtype", "shape", "file")


def claims(step_dir: str) -> bool:
    return os.path.isfile(os.path.join(step_dir, layout.INDEX_FILE))


def read_index(step_dir: str, kind: str) -> Table:
    return read_index_file(os.path.join(step_dir, layout.INDEX_FILE))


INTEGER_COLUMNS = ("index", "task_id", "stream_id", "timestamp", "nan_count", "pos_inf_count",
                   "neg_inf_count")
NUMBER_COLUMNS = INTEGER_COLUMNS + STAT_COLUMNS        # the rest of an index is text


def read_index_file(path: str) -> Table:
    """An index.csv as a Table: every column of its header (numbers where NUMBER_COLUMNS
    says, text otherwise), refused with the row it stops at when it is not whole."""
    data = read_bytes(path, WorkspaceError, "the index")
    try:
        table = read_csv(data, {name: "f" for name in NUMBER_COLUMNS}, rest="t")
    except TableError as e:
        where = f"row {e.line} is incomplete or not a tensor row (was the file cut off?): " \
            if e.line else ""
        raise WorkspaceError(f"{path} is not a readable index: {where}{e.detail}") from None
    missing = [c for c in INDEX_COLUMNS if c not in table]
    if missing:
        raise WorkspaceError(f"{path} is not a readable index: no {', '.join(missing)} column")
    _check_rows(table, path)
    if data and not data.endswith(b"\n"):      # our index ends every row with a line break
        raise WorkspaceError(f"{path} is not a readable index: row {len(table) + 1} "
                             f"is cut off (no line break at the end of the file)")
    return table


def _check_rows(table: Table, path: str) -> None:
    """Every row of an index is whole: names present, io an io, integers integral. A file
    cut off mid-row (a dump killed while a foreign tool copied it, a full disk) is refused
    naming the row, never read as a row with holes. Rows count as lines of the file."""
    bad = ~np.isin(table["io"], ["input", "output"])
    for name in ("op_type", "op_name", "tensor", "dtype"):
        bad |= table[name] == ""
    for name in INTEGER_COLUMNS:
        if name in table:
            v = table[name]
            with np.errstate(invalid="ignore"):
                bad |= ~np.isfinite(v) | (v != np.round(v))
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise WorkspaceError(f"{path} is not a readable index: row {row + 2} is incomplete or "
                             f"not a tensor row (was the file cut off?)")


# -- a run's own files -------------------------------------------------------------------
def read_calls(step_dir: str) -> dict:
    """A step's call sites (calls.json: op name -> {"module": path, "source": line}), {}
    where the front-end wrote none; a broken file is an error, never an empty answer."""
    path = os.path.join(step_dir, layout.CALLS_FILE)
    if not os.path.isfile(path):
        return {}
    data = load_json(path, WorkspaceError, "call sites")
    if not isinstance(data, dict) or not all(
            isinstance(v, dict) and all(isinstance(x, str) for x in v.values())
            for v in data.values()):
        raise WorkspaceError(f"call sites {path} are broken: not op name -> "
                             f"{{module, source}} text")
    return data


def read_compiled_graph(run) -> Optional[dict]:
    """The run's compiled graph (NPU runs), read and checked: None where the run has none (a
    golden run, a foreign dump, a front-end that compiles no graph); one that cannot be read
    as a graph is an error, never an empty graph (the mapping would then silently miss every
    fused op), and so is a missing one where run.json says one was written (graph_sha1)."""
    gdir = os.path.join(run.path, "graph")
    files = sorted(f for f in os.listdir(gdir) if f.endswith(".json")) if os.path.isdir(gdir) else []
    if not files:
        if run.ours and run.kind == layout.DEVICE and run.info.get("graph_sha1"):
            raise WorkspaceError(f"{run.label} has no compiled graph ({gdir}/*.json is missing)")
        return None
    path = os.path.join(gdir, files[0])
    raw = read_bytes(path, WorkspaceError, "compiled graph")
    data = parse_json(raw, path, WorkspaceError, "compiled graph")
    # the bytes our dumper wrote, unchanged: well formed by construction
    written = run.ours and run.info.get("graph_sha1") == hashlib.sha1(raw).hexdigest() \
        and run.info.get("version") == __version__
    try:
        check_compiled_graph(data, walk=not written)
    except PrecisionToolError as e:
        raise WorkspaceError(f"compiled graph {path} is broken: {e}") from None
    return data


def read_fusion_result(run) -> Optional[dict]:
    """fusion_result.json of an NPU run as pass -> fused nodes, for the passes that fused
    something; None where the run has no such record (a golden run, a foreign dump). A
    broken one, or one missing where our NPU dump writes it (a run that records its fusion
    passes), is an error: "no pass fired" would be a guess."""
    path = os.path.join(run.path, "fusion_result.json")
    if not os.path.isfile(path):
        if run.ours and run.kind == layout.DEVICE and "fusion_passes" in run.info:
            raise WorkspaceError(f"{run.label} has no fusion result ({path} is missing)")
        return None
    data = load_json(path, WorkspaceError, "fusion result")
    fired = {}
    try:
        if not isinstance(data, dict):
            raise TypeError("not an object of graphs")
        for graph in data.values():
            for kind in ("graph_fusion", "ub_fusion"):
                for name, counts in graph.get(kind, {}).items():
                    effect = counts.get("effect_times", 0)
                    nodes = counts.get("fused_nodes", [])
                    if not isinstance(effect, int) or not isinstance(nodes, list) or \
                            not all(isinstance(n, str) for n in nodes):
                        raise TypeError(f"pass {name!r} has malformed counts")
                    if effect > 0:
                        fired[str(name)] = list(nodes)
    except (AttributeError, TypeError) as e:
        raise WorkspaceError(f"fusion result {path} is broken: {e}") from None
    return fired


def read_step_history(run) -> "pd.DataFrame":
    """step_history.csv: every observed step's status word, loss scale and loss (empty if
    the run predates it or observed no step; loss nan where not recorded). A torn last
    line is dropped."""
    import pandas as pd
    path = os.path.join(run.path, layout.HISTORY_FILE)
    columns = layout.HISTORY_HEADER.split(",")
    if not os.path.isfile(path):
        return pd.DataFrame(columns=columns)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        # rows are written whole, each ending its line: a last line without its end was
        # torn by a kill, and a number cut short in it would still parse
        text = text[:text.rfind("\n") + 1] if not text.endswith("\n") else text
        table = pd.read_csv(io.StringIO(text), on_bad_lines="skip")
        if list(table.columns) == layout.HISTORY_HEADER_V1.split(","):
            table["loss"] = float("nan")          # written before the loss was
        if list(table.columns) != columns:
            raise ValueError(f"columns {list(table.columns)}")
        table = table.dropna(subset=["step", "status"]).astype({"step": int, "status": int})
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError,
            OSError) as e:
        raise WorkspaceError(f"{path} is not a readable step history: {e}") from None
    return table.sort_values("step", kind="stable").reset_index(drop=True)


def skipped_steps(run) -> set:
    """The steps step_history.csv says the loss scale skipped (finite 0), read without
    pandas (a compare reads it, and vc imports no pandas)."""
    path = os.path.join(run.path, layout.HISTORY_FILE)
    if not os.path.isfile(path):
        return set()
    try:
        with open(path, encoding="utf-8") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError) as e:
        raise WorkspaceError(f"{path} is not a readable step history: {e}") from None
    if not rows or "finite" not in rows[0] or "step" not in rows[0]:
        return set()
    step, finite = rows[0].index("step"), rows[0].index("finite")
    return {int(r[step]) for r in rows[1:]
            if len(r) > max(step, finite) and r[finite] == "0" and r[step].isdigit()}


def check_compiled_graph(data, walk: bool = True) -> dict:
    """A compiled graph's JSON, checked as a graph: well formed, no dangling input, no
    cycle, every op type known (walk=False: its header and node list only, for the bytes our
    own dumper wrote). Not shape-checked: compiled tensors are in 5HD."""
    from ...graph.serialize import check_graph_dict, graph_nodes

    if not isinstance(data, dict):
        raise GraphFormatError("a compiled graph is a JSON object with a node list")
    if walk:
        from ...ops import REGISTRY     # the op implementations: only a walk asks them
        check_graph_dict(data, REGISTRY.__contains__)
    else:
        graph_nodes(data)
    return data


def read_run_json(path: str) -> dict:
    try:
        with open_regular(path) as f:
            data = json.loads(f.read().decode("utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}


