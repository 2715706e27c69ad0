"""Vector compare (`vc`): every dumped NPU tensor of a step against the golden tensor it
stands for, with the metrics of metrics.py, as rows in execution order; where a side dumped
statistics only, from the two index rows (compare_stats).

The result CSV keeps msaccucmp's columns (Index, OpType, NPUDump, DataType, GroundTruth,
DataType, TensorIndex, Shape, OverFlow, the metrics, CompareFailReason) and adds the counts
and norms the verdict weighs, the verdict and its reason (verdicts.judge), the task id and
the pass that fused the op.

compare_step makes the result as a table.Table, without pandas (vc's start-up is
most of its time on a small dump); vector_compare is the same as a pandas DataFrame.
"""
from __future__ import annotations

import functools
import math
import os
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from ... import numerics
from ...dump import Workspace
from ...dump.bundle import bundle_fetches
from ...dump.formats.msprobe import CAST_APIS
from ...dump.formats.ours import skipped_steps
from ...dump.layout import DEVICE
from ...dump.workspace import Run
from ...graph import NOT_KERNELS, GraphView, split_tensor_name
from ...table import Table
from ...collector import collector_paused
from .engine import Pair, Side, compare_pairs, engine_for
from .mapping import TensorMap
from .matching import align_calls
from .metrics import METRICS
from .sums import call_kind, sum_kind
from .verdicts import (NO_COUNTERPART, NOT_IN_INDEX, STATS_ONLY, UNREADABLE, Criteria,
                       element_count, judge)

if TYPE_CHECKING:
    import pandas as pd


COLUMNS = (["Index", "OpType", "NPUDump", "NpuDataType", "GroundTruth", "GoldenDataType",
            "TensorIndex", "Shape", "OverFlow"] + list(METRICS) +
           ["NpuNanCount", "NpuInfCount", "GoldenNanCount", "GoldenInfCount", "NpuAtFp16Max",
            "FlushedToZeroRatio", "NpuNorm", "GoldenNorm", "NormRelativeDiff", "MaxDiff",
            "MinDiff", "MeanDiff", "Elements", "GoldenAbsMax", "CompareFailReason", "Verdict",
            "Reason", "TaskId", "PassName", "GoldenTensor", "GoldenOpType", "SumKind"])


def statistics_only(reasons) -> list:
    """Per CompareFailReason, whether its row was compared by statistics only (a side
    dumped no tensor: no cosine). A comprehension: pandas' string methods cost ten times as
    much on 100,000 rows."""
    return [isinstance(r, str) and r.startswith(STATS_ONLY) for r in reasons]


def norm_relative_diff(nx: float, ny: float) -> float:
    """(NPU norm - golden norm) / golden norm: signed (-0.94: the NPU's norm fell by 94%);
    0 when both are zero, inf when only the golden is, nan when a norm is unknown."""
    if nx != nx or ny != ny:
        return float("nan")
    if ny > 0:
        return (nx - ny) / ny
    return 0.0 if nx == 0 else float("inf")


def compare_stats(npu: dict, golden: dict) -> dict:
    """The comparison two index rows allow when a side dumped statistics only: the norms and
    their relative difference, the differences of max, min and mean, the nan/inf counts,
    whether the NPU reaches the fp16 maximum (1 or 0: the index holds no count). Every
    tensor metric is nan. (An NC1HWC0 tensor's statistics leave its padding out.)"""
    out = {name: float("nan") for name in METRICS}
    out.update(NpuNanCount=int(npu["nan_count"]), GoldenNanCount=int(golden["nan_count"]),
               NpuInfCount=int(npu["pos_inf_count"]) + int(npu["neg_inf_count"]),
               GoldenInfCount=int(golden["pos_inf_count"]) + int(golden["neg_inf_count"]),
               NpuAtFp16Max=int(max(abs(npu["max"]), abs(npu["min"])) >= numerics.FP16_MAX)
               if npu["max"] == npu["max"] else 0,
               FlushedToZeroRatio=float("nan"), NpuNorm=float(npu["l2norm"]),
               GoldenNorm=float(golden["l2norm"]))
    out["CompareFailReason"] = STATS_ONLY
    held = _held_saturated(npu, golden)
    if held:
        out.update(NpuNorm=held[1], NpuAtFp16Max=held[0])
        out["CompareFailReason"] += (f" (the golden's {held[0]} ±inf taken as the NPU's ±65504: "
                                     f"its norm without them)")
    out["NormRelativeDiff"] = norm_relative_diff(out["NpuNorm"], out["GoldenNorm"])
    out.update({f"{k.capitalize()}Diff": float(npu[k]) - float(golden[k]) for k in ("max", "min", "mean")})
    crc, golden_crc = npu.get("md5") or "", golden.get("md5") or ""
    if crc and golden_crc:      # msprobe's md5 summary (a CRC32 of the data): bit for bit?
        out["CompareFailReason"] += " (md5 equal: the same bits)" if crc == golden_crc \
            else " (md5 differs: not the same bits)"
    return out


def _held_saturated(npu: dict, golden: dict) -> Optional[tuple]:
    """Statistics of a golden holding infinities the NPU does not, where the NPU's extreme on
    that side is ±65504 (saturation mode holds a mask's -inf so): (k, the NPU's norm less k
    elements of 65504), k the golden's infinities the NPU lacks, as if those were the
    saturated ones; a tensor dump counts them (NpuAtFp16Max) and leaves them out of every
    metric, as the golden's statistics leave its infinities out. The subtraction cancels:
    the squares left are exact to about 2^-52 of k * 65504^2 (a relative 1e-7 on a mask's
    row, far below any threshold). None where the NPU's extremes do not reach 65504, or its
    norm cannot hold k of them (then more differs than the infinities, and the row is judged
    as it is)."""
    k = 0
    for side, extreme, sign in (("pos_inf_count", "max", 1.0), ("neg_inf_count", "min", -1.0)):
        lacking = int(golden[side]) - int(npu[side])
        if lacking > 0 and float(npu[extreme]) == sign * numerics.FP16_MAX:
            k += lacking
    squares = float(npu["l2norm"]) ** 2 - k * numerics.FP16_MAX ** 2
    if not k or not squares >= 0:
        return None
    return k, math.sqrt(squares)


def _nonfinite_recorded(index_row, path: str, ours: bool) -> tuple:
    """(path, nan + inf count the dump's index recorded for the file's tensor, or -1 where it
    recorded none). Only our dumps count them; msprobe's records no count (its reader infers
    flags from Max and Min, which msprobe computes leaving nan and inf out): its md5 mode's
    CRC32 is the check there."""
    counts = [index_row.get(k) for k in ("nan_count", "pos_inf_count", "neg_inf_count")]
    if not ours or any(c is None or c != c for c in counts):
        return path, -1
    return path, int(sum(counts))


def _changed_since_dumped(row: dict, recorded) -> dict:
    """A tensor file whose nan/inf are not those its dump recorded was changed or damaged
    since (a golden inf written in by hand, a bit flipped): it decides nothing, and its row
    is unreadable rather than a cause ("the golden holds inf: the data or the model")."""
    if not recorded or str(row.get("CompareFailReason") or "").startswith(UNREADABLE):
        return {}
    for (path, want), side in zip(recorded, ("Npu", "Golden")):
        got = row.get(f"{side}NanCount", 0) + row.get(f"{side}InfCount", 0)
        if want >= 0 and got == got and int(got) != want:
            return {**{name: np.nan for name in (*METRICS, "NpuNanCount", "NpuInfCount",
                                                 "GoldenNanCount", "GoldenInfCount")},
                    "CompareFailReason": f"{UNREADABLE}tensor file {path} holds {int(got)} "
                                         f"nan/inf, its dump recorded {want} (changed or "
                                         f"damaged since)"}
    return {}


def _undumped_ops(graph: Optional[GraphView], tmap: TensorMap, indexed: set,
                  fetched: Optional[list], start: int) -> list:
    """An error row for each kernel the step ran (the compiled graph's ancestors of what the
    step fetched, as its replay bundle records) that has no row in the step's index: the
    dump holds every kernel a step runs, so a missing one means an index cut off at a line
    break or rows removed. Without them the compare would look whole while it never saw
    those ops. A step without a bundle says nothing of what ran: no rows."""
    nodes = list(graph) if graph is not None else []
    if not fetched or all(n.name in indexed or n.type in NOT_KERNELS for n in nodes):
        return []                    # every kernel has its rows: nothing to walk
    wanted = set(fetched)
    todo = [n for n in nodes if n.name in wanted
            or wanted & set(n.attrs.get("original_op_names", []))]
    ran = set()
    while todo:
        node = todo.pop()
        if node.name in ran:
            continue
        ran.add(node.name)
        for t in node.inputs:
            producer = tmap.node(split_tensor_name(t)[0])
            if producer is not None:
                todo.append(producer)
    rows = []
    for node in nodes:
        if node.type in NOT_KERNELS or node.name in indexed or node.name not in ran:
            continue
        rows.append({"Index": start + len(rows), "OpType": node.type,
                     "NPUDump": node.name, "TensorIndex": f"{node.name}:output:0",
                     "PassName": node.attrs.get("pass_name", "") or "",
                     **{name: np.nan for name in METRICS},
                     "CompareFailReason": f"{NOT_IN_INDEX}: the step ran this op, its index has "
                                          f"no row of it",
                     "Verdict": "error"})
    return rows


GOLDEN_ONLY = "no NPU counterpart"


def _golden_only_ops(graph: Optional[GraphView], indexed: set, gold: Table,
                     gold_graph: Optional[GraphView], start: int) -> list:
    """An error row for each op the reference step ran that the compared run's graph has no
    counterpart of: no node of that name and none that absorbed it (a fused kernel's
    original ops). Two runs of different graphs (a 2-layer NPU run against a 3-layer
    golden) share the names of what they have in common, and compared only those they
    would look whole; these rows make such a compare incomplete, naming what is missing.
    Without a graph (our golden run on the left), the left step's own ops are its graph; an
    NPU run as the reference counts by its own originals (what its compiler inserted is
    no op of the model)."""
    known = _originals(graph) if graph is not None else indexed
    ran = {}
    outputs = np.asarray(gold["io"]) == "output"
    for name, op_type in zip(np.asarray(gold["op_name"])[outputs].tolist(),
                             np.asarray(gold["op_type"])[outputs].tolist()):
        if op_type not in NOT_KERNELS:
            ran.setdefault(name, op_type)
    if gold_graph is not None:
        ran = {o: ran.get(o, "") for name in ran for o in _originals(gold_graph, name)}
    rows = []
    for name, op_type in ran.items():
        if name in known:
            continue
        rows.append({"Index": start + len(rows), "OpType": op_type, "NPUDump": "",
                     "GroundTruth": name, "TensorIndex": f"{name}:output:0",
                     "GoldenTensor": f"{name}:0", **{m: np.nan for m in METRICS},
                     "CompareFailReason": f"{GOLDEN_ONLY}: the reference ran {name}, the "
                                          f"compared run's graph has no such op (a different "
                                          f"graph? map it with -g)",
                     "Verdict": "error"})
    return rows


def _skipped(ws: Workspace, run: Run, step: int) -> bool:
    """Whether the run's loss scale manager skipped the step (its history: not finite)."""
    return step in skipped_steps(run)


def _originals(graph: GraphView, name: Optional[str] = None) -> set:
    """The model's ops a compiled graph's nodes stand for (of one node, with `name`): a
    fused kernel's original ops, a node's own name, nothing for what the compiler inserted."""
    nodes = [graph.get(name)] if name is not None else list(graph)
    out = set()
    for node in nodes:
        if node is None:
            out.add(name)
        elif not node.attrs.get("inserted_by"):
            out.add(node.name)
            out.update(node.attrs.get("original_op_names", ()))
    return out


def _golden_rows(ws: Workspace, run: Run, step: int):
    """A step's index of the reference run, and two ways to find a row in it: by the
    compiled tensor's own name, and by the original (golden) tensor a row stands for. A
    golden run's tensors are their own originals; an NPU run's map through its compiled
    graph, and where several stand for one original (a tensor and the Cast the compiler
    inserted after it), the tensor itself holds it."""
    table = ws.index_table(run, step)
    graph = ws.compiled_graph(run) if run.kind == DEVICE else None
    tmap = TensorMap(graph) if graph else None
    exact, original_of, by_original, by_position = {}, {}, {}, {}
    # a tensor's own row is its producer's output row; the input rows of the ops that read
    # it name the same file under the reader's name (GroundTruth would name the reader)
    outputs = table["io"] == "output"
    tensors = table["tensor"].tolist()
    # output rows first: an input row stands for its tensor only where no output row does
    ops, indexes = table["op_name"].tolist(), table["index"].tolist()
    for k in np.flatnonzero(~outputs).tolist():
        by_position[(ops[k], indexes[k])] = k
    for k in [*np.flatnonzero(outputs).tolist(), *np.flatnonzero(~outputs).tolist()]:
        tensor = tensors[k]
        if tensor in exact:
            continue
        exact[tensor] = k
        original = original_of[tensor] = tmap.golden_tensor(tensor) if tmap else tensor
        if original is not None and (original not in by_original or tensor == original):
            by_original[original] = k
    return table, exact, original_of, by_original, by_position


def _cast_sources(table) -> dict:
    """Each output of a cast call (msprobe.CAST_APIS) -> the tensor it casts."""
    types = table["op_type"].tolist()
    if not CAST_APIS.intersection(types):
        return {}
    inputs, out = {}, {}
    for t, name, io, index, tensor in zip(types, table["op_name"].tolist(), table["io"].tolist(),
                                          table["index"].tolist(), table["tensor"].tolist()):
        if t in CAST_APIS:
            if io == "input" and index == 0:
                inputs[name] = tensor
            elif io == "output" and index == 0:
                out[tensor] = name
    return {tensor: inputs[name] for tensor, name in out.items() if name in inputs}


def _through_casts(tensor: str, casts: dict, gold_exact: dict):
    """(the reference's row, the tensor) of the first tensor up a chain of casts that the
    reference holds, (None, None) where none does."""
    for _ in range(64):                  # a malformed index must not loop forever
        tensor = casts.get(tensor)
        if tensor is None:
            break
        if tensor in gold_exact:
            return gold_exact[tensor], tensor
    return None, None


@functools.lru_cache(maxsize=256)
def _itemsize(dtype: str) -> int:
    try:
        return np.dtype(dtype).itemsize
    except (TypeError, ValueError):    # a name numpy does not know: the file will say
        return -1


def _data_bytes(elements: Optional[int], dtype: str) -> int:
    """A tensor's data size as its index row says, -1 where it cannot say."""
    size = _itemsize(dtype) if elements is not None else -1
    return elements * size if size >= 0 else -1


def vector_compare(ws: Workspace, npu_run: Run, golden_run: Run, step: int,
                   golden_step: Optional[int] = None, threshold=None,
                   progress: Optional[Callable[[int, int], None]] = None,
                   graph: Optional[GraphView] = None, workers: int = 1,
                   scheduler=None) -> "pd.DataFrame":
    """compare_step's result as a pandas DataFrame (its attrs included)."""
    return compare_step(ws, npu_run, golden_run, step, golden_step, threshold, progress, graph,
                        workers, scheduler).to_frame()


def compare_step(ws: Workspace, npu_run: Run, golden_run: Run, step: int,
                 golden_step: Optional[int] = None, threshold=None,
                 progress: Optional[Callable[[int, int], None]] = None,
                 graph: Optional[GraphView] = None, workers: int = 1,
                 scheduler=None) -> Table:
    """Every tensor of the NPU run's step against the tensor of golden_run it stands for
    (mapped through `graph`, a compiled graph, default the run's own), judged by
    `threshold` (verdicts.Criteria, or a cosine threshold).

    golden_run is normally the CPU golden; it may be another NPU run (fusion on against
    fusion off), whose tensors are mapped and converted from 5HD the same way: a tensor
    that both runs hold under the same compiled name (a Cast the compiler inserted in both)
    is compared with itself, any other with the tensor standing for the same original.
    The comparisons run here, in `workers` local processes, or on the Dask cluster of
    `scheduler` (an address or a distributed.Client): the same numbers either way."""
    # some forty containers a tensor and no cycles: the collector's passes over them took a
    # sixth of the time of comparing 10,000 small pairs
    with collector_paused():
        return _compare_step(ws, npu_run, golden_run, step, golden_step, threshold, progress,
                             graph, workers, scheduler)


def _compare_step(ws: Workspace, npu_run: Run, golden_run: Run, step: int,
                  golden_step: Optional[int], threshold, progress, graph: Optional[GraphView],
                  workers: int, scheduler) -> Table:
    gold_step = step if golden_step is None else golden_step
    npu = ws.index_table(npu_run, step)
    for column, default in (("task_id", -1), ("pass_name", ""), ("format", ""), ("original_shape", "")):
        if column not in npu:          # a golden run on the left: golden against golden
            npu = npu.with_column(column, np.full(len(npu), default,
                                                  dtype=object if default == "" else np.int64))
    gold, gold_exact, gold_original, gold_by_original, gold_inputs = \
        _golden_rows(ws, golden_run, gold_step)
    # only the rows a lookup can return (the golden's input rows mostly name a tensor its
    # output row stands for already)
    by_position = npu_run.calls_by_index
    # an msprobe dump names a call by its API's call index: two dumps whose call lists
    # differ are paired call by call (matching.align_calls), and the unpaired listed
    paired = align_calls(npu, gold) if by_position else None
    wanted = sorted(set(gold_exact.values()) | set(gold_by_original.values())
                    | (set(gold_inputs.values()) if by_position else set()))
    gold_rows = dict(zip(wanted, gold.take(wanted).records()))
    graph = graph if graph is not None else ws.compiled_graph(npu_run)
    tmap = TensorMap(graph)
    gold_format = "format" in gold.columns
    # joined by hand below: os.path.join per file is a measurable share on many small tensors
    npu_dir = os.path.join(ws.step_path(npu_run, step), "")
    gold_dir = os.path.join(ws.step_path(golden_run, gold_step), "")
    rows, pairs = [], []
    pair_of = {}    # (npu file, golden file) -> pair index: a tensor read by several ops once
    # a run without a compiled graph may name the kernel that made each output of its calls
    # (a script's: a bias gradient is a ReduceSum): their sum kinds are the kernels'
    casts = _cast_sources(npu)
    kernels = {name: site["kernels"].split(",")
               for name, site in ws.call_sites(npu_run, step).items() if site.get("kernels")} \
        if graph is None else {}

    def kind(op_type: str, op_name: str, k: int) -> str:
        made = kernels.get(op_name)
        if made is not None:
            return sum_kind(made[k], {}, 0) if k < len(made) else ""
        return sum_kind(op_type, tmap.attrs(op_name), k) or call_kind(op_type, op_name)
    for k, r in enumerate(npu.records()):
        golden_tensor = tmap.golden_tensor(r["tensor"])
        counterpart = paired.get(r["op_name"]) if paired is not None else r["op_name"]
        row = {"Index": k, "OpType": r["op_type"], "NPUDump": r["op_name"],
               "NpuDataType": r["dtype"], "GroundTruth": "", "GoldenDataType": "",
               "TensorIndex": f"{r['op_name']}:{r['io']}:{r['index']}", "Shape": r["shape"],
               "OverFlow": "", "TaskId": r["task_id"], "PassName": r["pass_name"] or "",
               "GoldenTensor": golden_tensor or "", "Elements": element_count(r["shape"]),
               "SumKind": "" if r["io"] != "output" else
               r.get("sum_kind") or kind(r["op_type"], r["op_name"], r["index"])}
        # an msprobe dump's input has a file of its own, and where it came from is known
        # only as far as its statistics or the calls say (formats.msprobe), which two runs
        # may say differently: it is compared with the reference's input of the same call
        # at the same position, and its name is the data flow the analysis follows
        g = None
        if by_position and r["io"] == "input":
            g = gold_inputs.get((counterpart, r["index"]))
        elif counterpart != r["op_name"] and counterpart is not None:
            # its counterpart's output (GoldenTensor keeps this run's name: the data flow)
            g = gold_exact.get(f"{counterpart}:{r['index']}")
        if g is None and counterpart == r["op_name"]:     # (a renamed call's are its own)
            g = gold_exact.get(r["tensor"])
            if g is None or golden_tensor is None or \
                    gold_original.get(r["tensor"]) != golden_tensor:
                g = gold_by_original.get(golden_tensor) if golden_tensor else None
        if g is None and counterpart in (None, r["op_name"]) and r["tensor"] in casts:
            # a cast only this run made (its backward, where the reference's tensor already
            # had the dtype, so that the reference recorded no call): it stands for the
            # tensor it casts, as a Cast the compiler inserted does
            g, source = _through_casts(r["tensor"], casts, gold_exact)
            if g is not None:
                row["GoldenTensor"] = source
        if paired is not None and counterpart is None and g is None:
            row.update({name: np.nan for name in METRICS}, Verdict="error",
                       CompareFailReason=f"{NO_COUNTERPART}: the reference made no call "
                                         f"that stands for it (its API, direction and shapes "
                                         f"at that place)")
            rows.append(row)
            continue
        if g is None:
            row.update({name: np.nan for name in METRICS},
                       CompareFailReason="no golden tensor: NPU-only" if golden_tensor is None
                       else f"no golden tensor {golden_tensor} in the golden dump",
                       Verdict="error" if golden_tensor else "npu-only")
        else:
            grow = gold_rows[g]
            row["GroundTruth"] = grow["op_name"]
            row["GoldenDataType"] = grow["dtype"]
            row["GoldenOpType"] = grow["op_type"]
            row["GoldenAbsMax"] = max(abs(grow["max"]), abs(grow["min"]))
            if not r["file"] or not grow["file"]:        # a side dumped statistics only
                row.update(compare_stats(r, grow))
            else:
                key = (r["file"], grow["file"])
                if key not in pair_of:
                    pair_of[key] = len(pairs)
                    pairs.append(Pair(
                        Side(npu_dir + r["file"], r["format"] or "",
                             r["original_shape"] or "", r["min"], r["max"],
                             _data_bytes(row["Elements"], r["dtype"]), r.get("md5") or "",
                             r["shape"]),
                        Side(gold_dir + grow["file"],
                             grow["format"] if gold_format else "",
                             grow["original_shape"] if gold_format else "",
                             grow["min"], grow["max"],
                             _data_bytes(element_count(grow["shape"]), grow["dtype"]),
                             grow.get("md5") or "", grow["shape"])))
                row["_pair"] = pair_of[key]
                row["_recorded"] = (
                    _nonfinite_recorded(r, npu_dir + r["file"], npu_run.ours),
                    _nonfinite_recorded(grow, gold_dir + grow["file"], golden_run.ours))
        rows.append(row)
    fetched = bundle_fetches(ws.bundle_path(npu_run, step)) \
        if step in npu_run.bundles else None
    rows += _undumped_ops(graph, tmap, set(npu["op_name"]), fetched, len(rows))
    # a foreign dump's fusion is not known; and a step the NPU's loss scale skipped ran no
    # update there (a script's optimizer step is not called): the golden's are no gap
    # (an msprobe dump names every call, as ours do: what only the reference called shows)
    if (graph is not None or npu_run.ours or npu_run.calls_by_index) \
            and not _skipped(ws, npu_run, step):
        rows += _golden_only_ops(graph, set(paired.values()) if paired is not None
                                 else set(npu["op_name"]), gold,
                                 ws.compiled_graph(golden_run), len(rows))
    engine = engine_for(workers, scheduler)
    try:
        results = compare_pairs(ws.where, pairs, engine, progress)
    finally:
        engine.close()
    for row in rows:
        p = row.pop("_pair", None)
        recorded = row.pop("_recorded", None)
        if p is not None:
            row.update(results[p])
            row.update(_changed_since_dumped(row, recorded))
            row["NormRelativeDiff"] = norm_relative_diff(row["NpuNorm"], row["GoldenNorm"])
    table = Table.from_rows(rows, COLUMNS)
    judged = judge(table, threshold)
    table = table.with_column("Verdict", judged["Verdict"]).with_column("Reason", judged["Reason"])
    # what it was computed from: write_result keeps it beside the CSV (result.Provenance)
    table.attrs["compared"] = {"npu_run": npu_run.label, "golden_run": golden_run.label,
                               "step": step, "golden_step": gold_step,
                               "criteria": Criteria.of(threshold).to_dict()}
    return table
