"""Vector compare (`vc`): every dumped NPU tensor of a step against the golden tensor it
stands for, with the metrics of metrics.py, as rows in execution order; where a side dumped
statistics only, from the two index rows (compare_stats).

The result CSV keeps msaccucmp's columns (Index, OpType, NPUDump, DataType, GroundTruth,
DataType, TensorIndex, Shape, OverFlow, the metrics, CompareFailReason) and adds the verdict,
the task id and the pass that fused the op.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Optional

import numpy as np
import pandas as pd

from .. import numerics
from ..fileio import write_text_atomic
from ..dump import Workspace
from ..dump.workspace import Run
from .mapping import TensorMap
from .engine import UNREADABLE, Pair, Side, compare_pairs, engine_for
from .metrics import METRICS

# A tensor passes when its cosine similarity reaches the threshold (vcs's default). The
# per-dtype tolerances are for telling an op's own error from fp16 rounding (root cause):
# an fp16 tensor against an fp32 golden is expected to differ by that much.
COSINE_THRESHOLD = 0.98
TOLERANCE = {"float16": 1e-3, "bfloat16": 1e-2, "float32": 1e-5, "float64": 1e-7}


COLUMNS = (["Index", "OpType", "NPUDump", "NpuDataType", "GroundTruth", "GoldenDataType",
            "TensorIndex", "Shape", "OverFlow"] + list(METRICS) +
           ["NpuNanCount", "NpuInfCount", "GoldenNanCount", "GoldenInfCount", "NpuAtFp16Max",
            "FlushedToZeroRatio", "NpuNorm", "GoldenNorm", "NormRelativeDiff", "MaxDiff",
            "MinDiff", "MeanDiff", "CompareFailReason", "Verdict", "TaskId", "PassName",
            "GoldenTensor"])


def verdict(row: dict, threshold: float = COSINE_THRESHOLD) -> str:
    """pass, fail, nan (the NPU produced inf/nan where the golden is finite) or error. From
    statistics alone (no cosine), fail means the L2 norms differ by more than 1 - threshold
    relatively: a norm-preserving error passes, which only tensors can show."""
    reason = row.get("CompareFailReason", "")
    if reason.startswith(("shape mismatch", "no golden", UNREADABLE)):
        return "error"
    if row["NpuNanCount"] + row["NpuInfCount"] > row["GoldenNanCount"] + row["GoldenInfCount"]:
        return "nan"
    if reason.startswith(STATS_ONLY):
        diff = row["NormRelativeDiff"]
        return "fail" if diff > 1 - threshold or (diff != diff and row["NpuNorm"] > 0) else "pass"
    cos = row["CosineSimilarity"]
    if cos != cos:                                   # nan cosine: one side all zero
        return "fail" if row["MaxAbsoluteError"] > 0 else "pass"
    return "fail" if cos < threshold else "pass"


STATS_ONLY = "statistics only"


def statistics_only(reasons) -> list:
    """Per CompareFailReason, whether its row was compared by statistics only (a side
    dumped no tensor: no cosine). A comprehension: pandas' string methods cost ten times as
    much on 100,000 rows."""
    return [isinstance(r, str) and r.startswith(STATS_ONLY) for r in reasons]


def diverging(rows: pd.DataFrame, threshold: float = COSINE_THRESHOLD) -> pd.Series:
    """The rows of a result table that diverge at this threshold (which may differ from the
    one the table was made with): cosine under it; nan/inf the golden lacks; without a
    cosine, norms apart by more than 1 - threshold (statistics only) or exactly one side all
    zero. NPU-only rows and error rows do not count."""
    cos = rows.CosineSimilarity
    no_cos = cos.isna()
    reason = rows.get("CompareFailReason", pd.Series("", index=rows.index))
    stats = pd.Series(statistics_only(reason.tolist()), index=rows.index, dtype=bool)
    norm_diff = rows.get("NormRelativeDiff", pd.Series(np.nan, index=rows.index))
    return (cos < threshold) | (rows.Verdict == "nan") | \
        (no_cos & stats & (rows.Verdict == "fail") & ~(norm_diff <= 1 - threshold)) | \
        (no_cos & ~stats & (rows.Verdict == "fail"))


def compare_stats(npu: dict, golden: dict, five_hd: bool = False) -> dict:
    """The comparison two index rows allow when a side dumped statistics only: the norms and
    their relative difference, the differences of max, min and mean, the nan/inf counts.
    Every tensor metric is nan. 5HD padding zeros do not change a norm, but they do enter
    the max, min and mean of the NPU side, which are then left out."""
    out = {name: float("nan") for name in METRICS}
    out.update(NpuNanCount=int(npu["nan_count"]), GoldenNanCount=int(golden["nan_count"]),
               NpuInfCount=int(npu["pos_inf_count"]) + int(npu["neg_inf_count"]),
               GoldenInfCount=int(golden["pos_inf_count"]) + int(golden["neg_inf_count"]),
               NpuAtFp16Max=int(max(abs(npu["max"]), abs(npu["min"])) >= numerics.FP16_MAX)
               if npu["max"] == npu["max"] else 0,
               FlushedToZeroRatio=float("nan"), NpuNorm=float(npu["l2norm"]),
               GoldenNorm=float(golden["l2norm"]))
    nx, ny = out["NpuNorm"], out["GoldenNorm"]
    out["NormRelativeDiff"] = abs(nx - ny) / ny if ny > 0 else (0.0 if nx == 0 else float("nan"))
    reasons = [STATS_ONLY]
    if five_hd:
        reasons.append("5HD padding enters max/min/mean: left out")
        out.update(MaxDiff=float("nan"), MinDiff=float("nan"), MeanDiff=float("nan"))
    else:
        out.update({f"{k.capitalize()}Diff": float(npu[k]) - float(golden[k]) for k in ("max", "min", "mean")})
    out["CompareFailReason"] = "; ".join(reasons)
    return out


def records(table: pd.DataFrame) -> list:
    """The table's rows as dicts of Python values, column by column: pandas' own row
    iteration (itertuples, to_dict) takes each string element through its array's
    __getitem__, ten times slower on a dump of thousands of small tensors."""
    columns = list(table.columns)
    return [dict(zip(columns, values)) for values in zip(*(table[c].tolist() for c in columns))]


def _by_original(ws: Workspace, run: Run, step: int):
    """A step's index and, per original (golden) tensor name, the row that holds it. An NPU
    run's tensors map through its compiled graph; where several do (a tensor and the Cast the
    compiler inserted after it), the tensor itself wins."""
    table = ws.index(run, step)
    graph = ws.graph_json(run) if run.target == "npu" else None
    tmap = TensorMap(graph) if graph else None
    rows = {}
    for k, tensor in enumerate(table["tensor"]):
        original = tmap.golden_tensor(tensor) if tmap else tensor
        if original is not None and (original not in rows or tensor == original):
            rows[original] = k
    return table, rows


def vector_compare(ws: Workspace, npu_run: Run, golden_run: Run, step: int,
                   golden_step: Optional[int] = None, threshold: float = COSINE_THRESHOLD,
                   progress: Optional[Callable[[int, int], None]] = None,
                   graph: Optional[dict] = None, workers: int = 1,
                   scheduler=None) -> pd.DataFrame:
    """Every tensor of the NPU run's step against the tensor of golden_run it stands for
    (mapped through `graph`, a compiled graph's JSON, default the run's own).
    golden_run is normally the CPU golden; it may be another NPU run (fusion on against
    fusion off), whose tensors are mapped and converted from 5HD the same way.
    The comparisons run here, in `workers` local processes, or on the Dask cluster of
    `scheduler` (an address or a distributed.Client): the same numbers either way."""
    gold_step = step if golden_step is None else golden_step
    npu = ws.index(npu_run, step)
    for column, default in (("task_id", -1), ("pass_name", ""), ("format", ""), ("original_shape", "")):
        if column not in npu:          # a golden run on the left: golden against golden
            npu[column] = default
    gold, gold_by_tensor = _by_original(ws, golden_run, gold_step)
    gold_rows = records(gold)
    tmap = TensorMap(graph if graph is not None else ws.graph_json(npu_run) or {})
    gold_format = "format" in gold.columns
    npu_dir, gold_dir = ws.step_path(npu_run, step), ws.step_path(golden_run, gold_step)
    rows, pairs = [], []
    pair_of = {}    # (npu file, golden file) -> pair index: a tensor read by several ops once
    for k, r in enumerate(records(npu)):
        golden_tensor = tmap.golden_tensor(r["tensor"])
        row = {"Index": k, "OpType": r["op_type"], "NPUDump": r["op_name"],
               "NpuDataType": r["dtype"], "GroundTruth": "", "GoldenDataType": "",
               "TensorIndex": f"{r['op_name']}:{r['io']}:{r['index']}", "Shape": r["shape"],
               "OverFlow": "", "TaskId": r["task_id"], "PassName": r["pass_name"] or "",
               "GoldenTensor": golden_tensor or ""}
        g = gold_by_tensor.get(golden_tensor) if golden_tensor else None
        if g is None:
            row.update({name: np.nan for name in METRICS},
                       CompareFailReason="no golden tensor: NPU-only" if golden_tensor is None
                       else f"no golden tensor {golden_tensor} in the golden dump",
                       Verdict="error" if golden_tensor else "npu-only")
        else:
            grow = gold_rows[g]
            row["GroundTruth"] = grow["op_name"]
            row["GoldenDataType"] = grow["dtype"]
            if not r["file"] or not grow["file"]:        # a side dumped statistics only
                row.update(compare_stats(r, grow, r["format"] == "NC1HWC0"))
            else:
                key = (r["file"], grow["file"])
                if key not in pair_of:
                    pair_of[key] = len(pairs)
                    pairs.append(Pair(
                        Side(os.path.join(npu_dir, r["file"]), r["format"] or "",
                             r["original_shape"] or "", r["min"], r["max"]),
                        Side(os.path.join(gold_dir, grow["file"]),
                             grow["format"] if gold_format else "",
                             grow["original_shape"] if gold_format else "",
                             grow["min"], grow["max"])))
                row["_pair"] = pair_of[key]
        rows.append(row)
    engine = engine_for(workers, scheduler)
    try:
        results = compare_pairs(ws.root, pairs, engine, progress)
    finally:
        engine.close()
    for row in rows:
        p = row.pop("_pair", None)
        if p is not None:
            row.update(results[p])
        if "Verdict" not in row:
            row["Verdict"] = verdict(row, threshold)
    return pd.DataFrame(rows, columns=COLUMNS)


def write_result(ws: Workspace, table: pd.DataFrame) -> str:
    """temp/vector_compare/<ts>/result_<ts>.csv; a second run in the same second gets its
    own directory."""
    stamp = time.strftime("%Y%m%d%H%M%S")
    parent = os.path.join(ws.root, "temp", "vector_compare")
    os.makedirs(parent, exist_ok=True)
    k = 0
    while True:
        name = stamp if k == 0 else f"{stamp}_{k}"
        try:
            os.mkdir(os.path.join(parent, name))
            break
        except FileExistsError:
            k += 1
    path = os.path.join(parent, name, f"result_{stamp}.csv")
    write_text_atomic(path, table.to_csv(index=False))
    return path
