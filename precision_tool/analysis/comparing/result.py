"""A compare result on disk, and what it can be trusted for.

`vc` writes temp/vector_compare/<ts>/result_<ts>.csv (msaccucmp's columns, and ours after
them) and beside it result_<ts>.json, its provenance: the runs and steps compared, the
criteria, a fingerprint of each step's index (so that a dump written again since is noticed)
and the coverage. A summary read later (`vcs`) says which runs and step it summarises, and
refuses a result that no longer describes the workspace: a run gone, an index changed, or
newer runs than the ones it compared.

Coverage: how many tensors a compare should have compared and how many it could not, by
reason. An answer of "nothing diverges" is only as good as it: an incomplete compare is never
"sound".
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import numpy as np

from ...dump import Workspace
from ...dump.workspace import Run, WorkspaceError
from ...fileio import load_json, read_bytes, write_text_atomic
from ...table import Table, TableError, column, read_csv
from .verdicts import ERROR, NO_COUNTERPART, NOT_IN_INDEX, NPU_ONLY, UNREADABLE

RESULT_VERSION = 1


@dataclass
class Coverage:
    """What a compare saw: `tensors` rows that stand for a golden tensor, `compared` of them
    compared, and the others by reason (a tensor file missing or corrupt, no golden tensor
    in the golden dump, shapes that differ). NPU-only tensors (nothing in the golden stands
    for them) are counted apart: they are not a gap."""
    tensors: int = 0
    compared: int = 0
    npu_only: int = 0
    missing: Dict[str, int] = field(default_factory=dict)
    # per reason, the first few ops not compared for it (what the user goes looking for)
    examples: Dict[str, List[str]] = field(default_factory=dict)
    # per reason, how many ops (its tensors are counted in missing)
    ops: Dict[str, int] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """Every tensor compared, and at least one: a compare that saw nothing (a step with
        no tensor a golden one stands for) is no evidence that precision is sound."""
        return self.compared == self.tensors > 0

    @property
    def not_compared(self) -> int:
        return self.tensors - self.compared

    def text(self) -> str:
        """One line: "374 of 375 tensors compared; 1 not: unreadable (file missing)"."""
        head = f"{self.compared} of {self.tensors} tensors compared"
        if self.complete:
            return head
        if not self.tensors:
            return f"{head}: the step holds no tensor that a golden one stands for" + \
                (f" ({self.npu_only} NPU-only)" if self.npu_only else "")
        why = ", ".join(f"{n} {reason}" + (f" ({', '.join(self.examples[reason])}"
                                           f"{', ...' if self.ops.get(reason, n) > len(self.examples[reason]) else ''})"
                                           if self.examples.get(reason) else "")
                        for reason, n in sorted(self.missing.items(), key=lambda kv: -kv[1]))
        return f"{head}; {self.not_compared} not: {why}"

    def to_dict(self) -> dict:
        return asdict(self)


EXAMPLES = 3      # ops named per reason in a coverage's text


SHAPES_DIFFER = "shapes differ"
_DISCRETE = re.compile(r"^(u?int\d*|bool)$")


def _gap(reason: str) -> str:
    """Why a row was not compared, without its paths (they differ row by row)."""
    if reason.startswith(UNREADABLE):
        detail = reason[len(UNREADABLE):]
        for word, kind in (("is missing", "file missing"), ("outside the workspace", "outside the workspace"),
                           ("corrupt", "file corrupt"), ("unpickling", "file holds objects"),
                           ("not a numeric", "not a numeric tensor"), ("directory", "not a file"),
                           ("is refused", "pickle refused: it asks for more than a tensor"),
                           ("does not hold what was dumped", "CRC32 differs from the dump's"),
                           ("cut off", "file cut off"),
                           ("damaged since", "nan/inf not those the dump recorded")):
            if word in detail:
                return f"unreadable ({kind})"
        return "unreadable"
    if reason.startswith(NO_COUNTERPART):
        return "of calls the reference did not make"
    if reason.startswith("no golden tensor"):
        return "no golden tensor in the golden dump"
    if reason.startswith("no NPU counterpart"):
        return "reference op(s) with no counterpart in the compared graph"
    if reason.startswith(NOT_IN_INDEX):
        return "op missing from the step's index"
    if reason.startswith("shape mismatch"):
        return SHAPES_DIFFER
    return reason or "not compared"


def coverage(table) -> Coverage:
    if "Verdict" not in table:
        return Coverage()
    verdicts = column(table, "Verdict", "")
    npu_only = int((verdicts == NPU_ONLY).sum())
    errors = np.flatnonzero(verdicts == ERROR)        # few rows: their reasons one by one
    reasons = column(table, "CompareFailReason", "")[errors]
    gaps = [_gap(r if isinstance(r, str) else "") for r in reasons]
    ops = [a or b for a, b in zip(column(table, "NPUDump", "")[errors].tolist(),
                                  column(table, "GroundTruth", "")[errors].tolist())]
    examples: Dict[str, List[str]] = {}
    distinct: Dict[str, set] = {}
    for gap, op in zip(gaps, ops):
        shown = examples.setdefault(gap, [])
        if isinstance(op, str) and op:
            distinct.setdefault(gap, set()).add(op)
            if len(shown) < EXAMPLES and op not in shown:
                shown.append(op)
    tensors = len(verdicts) - npu_only
    return Coverage(tensors, tensors - len(errors), npu_only, dict(Counter(gaps)),
                    {gap: shown for gap, shown in examples.items() if shown},
                    {gap: len(names) for gap, names in distinct.items()})


def first_parting(table) -> Optional[dict]:
    """Where the two runs take different paths, for a compare whose tensors' shapes differ:
    the first integer or boolean tensor (an index, a mask: a decision) of the same shape
    whose values differ from the golden's, before the first tensor whose shape differs (a
    mixture of experts' top-k choosing another expert: its rows then go elsewhere, in other
    numbers). {tensor, dtype, max_diff}; None where shapes all agree or none such comes
    first."""
    if "CompareFailReason" not in table or "NpuDataType" not in table:
        return None
    reasons = column(table, "CompareFailReason", "")
    shapes = [i for i, r in enumerate(reasons.tolist())
              if isinstance(r, str) and _gap(r) == SHAPES_DIFFER]
    if not shapes:
        return None
    dtypes = column(table, "NpuDataType", "").tolist()
    diffs = column(table, "MaxAbsoluteError", np.nan)
    names = column(table, "TensorIndex", "").tolist()
    for i in range(shapes[0]):
        if isinstance(dtypes[i], str) and _DISCRETE.match(dtypes[i]) and diffs[i] > 0:
            return {"tensor": names[i], "dtype": dtypes[i], "max_diff": float(diffs[i])}
    return None


# -- provenance -------------------------------------------------------------------------------
def fingerprint(ws: Workspace, run: Run, step: int) -> list:
    """What notices a step dumped again: its index's size and a hash of its bytes (a foreign
    step without an index: its file names and sizes). Not the modification time: a workspace
    copied to another machine is the same workspace."""
    path = ws.step_path(run, step)
    index = os.path.join(path, "index.csv")
    digest = hashlib.sha1()
    if os.path.isfile(index):
        with open(index, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        return [os.path.getsize(index), digest.hexdigest()]
    names = sorted(os.listdir(path))
    for name in names:
        digest.update(f"{name}\0{os.path.getsize(os.path.join(path, name))}\0".encode())
    return [len(names), digest.hexdigest()]


@dataclass
class Provenance:
    npu_run: str                     # the run checked (npu/debug_0), the left side
    golden_run: str                  # the reference, the right side
    step: int
    golden_step: int
    criteria: dict
    inputs: Dict[str, list]          # run label -> fingerprint of the step compared
    coverage: dict
    graph: Optional[str] = None      # a compiled graph given instead of the run's own
    created: str = ""
    version: int = RESULT_VERSION

    @classmethod
    def of(cls, ws: Workspace, table, graph: Optional[str] = None) -> Optional["Provenance"]:
        """What a table of vector_compare was computed from (its attrs say which runs, steps
        and criteria), with the steps' fingerprints as they are now and its coverage; None
        for a table made otherwise."""
        c = table.attrs.get("compared")
        if c is None:
            return None
        npu, golden = c["npu_run"], c["golden_run"]
        return cls(npu, golden, c["step"], c["golden_step"], c["criteria"],
                   {npu: fingerprint(ws, ws.resolve_run(npu, "npu"), c["step"]),
                    golden: fingerprint(ws, ws.resolve_run(golden, "cpu"), c["golden_step"])},
                   coverage(table).to_dict(), graph, time.strftime("%Y-%m-%d %H:%M:%S"))

    def describes(self) -> str:
        """"npu/debug_0 against cpu/debug_0, step 0"."""
        steps = f"step {self.step}" if self.step == self.golden_step else \
            f"step {self.step} against step {self.golden_step}"
        return f"{self.npu_run} against {self.golden_run}, {steps}"


def sidecar(csv_path: str) -> str:
    return csv_path[:-len(".csv")] + ".json" if csv_path.endswith(".csv") else csv_path + ".json"


def write_result(ws: Workspace, table, graph: Optional[str] = None) -> str:
    """temp/vector_compare/<ts>/result_<ts>.csv (of a Table or a DataFrame) and, for a
    table of compare_step or vector_compare, its provenance beside it (Provenance.of;
    graph: the compiled graph file the compare was given instead of the run's own). The
    CSV is written last: a result is found by its CSV, so it is never found without the
    sidecar it was written with. A second run in the same second gets its own directory."""
    provenance = Provenance.of(ws, table, graph)
    stamp = time.strftime("%Y%m%d%H%M%S")
    parent = ws.results_dir("temp", "vector_compare")
    k = 0
    while True:
        name = stamp if k == 0 else f"{stamp}_{k}"
        try:
            os.mkdir(os.path.join(parent, name))
            break
        except FileExistsError:
            k += 1
    path = os.path.join(parent, name, f"result_{stamp}.csv")
    if provenance is not None:
        write_text_atomic(sidecar(path), json.dumps(asdict(provenance), indent=1) + "\n")
    write_text_atomic(path, table.to_csv() if isinstance(table, Table) else table.to_csv(index=False))
    return path


@dataclass
class CompareReport:
    """What `vc` found, as its --json gives it: the step's compare table counted (rows, their
    verdicts, the ops that diverge under the criteria), what it covered, and where the
    result was written (result_file; None with why in `unsaved` when it could not be)."""
    npu_run: str
    golden_run: str
    step: int
    rows: int
    verdicts: Dict[str, int]
    diverging_ops: int
    coverage: Coverage
    criteria: dict
    result_file: Optional[str] = None
    unsaved: Optional[str] = None

    @classmethod
    def of(cls, table, npu_run: str, golden_run: str, step: int, criteria) -> "CompareReport":
        from collections import Counter
        from .summary import count_findings
        counts = dict(Counter(str(v) for v in table["Verdict"]))
        return cls(npu_run, golden_run, step, len(table), counts,
                   count_findings(table, criteria), coverage(table), criteria.to_dict())

    def to_dict(self) -> dict:
        return asdict(self)


def write_failure(e: Exception) -> str:
    """Why a result could not be written, in one line naming the path."""
    if isinstance(e, OSError) and not isinstance(e, WorkspaceError):
        return f"cannot write {e.filename or 'the result'}: {e.strerror or e}"
    return str(e)


def read_provenance(csv_path: str) -> Optional[Provenance]:
    """The result's provenance, or None when it has none (an older result, a file from
    elsewhere); a sidecar that cannot be read is an error."""
    path = sidecar(csv_path)
    if not os.path.isfile(path):
        return None
    data = load_json(path, WorkspaceError, "compare result provenance")
    try:
        if data.get("version") != RESULT_VERSION:
            raise ValueError(f"version {data.get('version')!r}")
        return Provenance(**data)
    except (TypeError, ValueError, AttributeError) as e:
        raise WorkspaceError(f"compare result provenance {path} is broken: {e}") from None


def result_files(ws: Workspace) -> List[str]:
    """The workspace's compare results, newest first (by the time in their names, which
    sorts as it reads; the modification time breaks ties)."""
    found = [path for place in ws.places
             for path in glob.glob(os.path.join(place, "temp", "vector_compare", "*", "result_*.csv"))]

    def key(path):
        stamp = os.path.basename(os.path.dirname(path))
        m = re.fullmatch(r"(\d{14})(?:_(\d+))?", stamp)
        return (m.group(1), int(m.group(2) or 0)) if m else ("", 0), os.path.getmtime(path)
    return sorted(found, key=key, reverse=True)


def staleness(ws: Workspace, p: Provenance) -> Optional[str]:
    """Why a result no longer describes what it compared, or None when it still does: a run
    it compared is gone, or a step it compared was dumped again since."""
    for label, fp in p.inputs.items():
        target, _, name = label.partition("/")
        step = p.step if label == p.npu_run else p.golden_step
        try:
            now = fingerprint(ws, ws.run(target, name), step)
        except (WorkspaceError, OSError):
            return f"{label} step {step} is no longer in the workspace"
        if now != list(fp):
            return f"{label} step {step} was dumped again since"
    return None


class StaleResultError(WorkspaceError):
    """No compare result describes the workspace's default runs as they are now."""


def current_result(ws: Workspace) -> Optional[tuple]:
    """(path, provenance) of the newest result that compares the default NPU run with its
    default reference (Workspace.default_reference) as they are now; None when the workspace holds no result at all.
    Results exist but none is current: StaleResultError, saying what the newest one holds
    and why it does not do."""
    files = result_files(ws)
    if not files:
        return None
    npu_run = ws.run("npu")
    # the golden `vc` compares it with by default: its own rank's, else the newest
    npu, golden = npu_run.label, ws.default_reference(npu_run).label
    for path in files:
        p = read_provenance(path)
        if p is not None and p.npu_run == npu and p.golden_run == golden and \
                staleness(ws, p) is None:
            return path, p
    newest = read_provenance(files[0])
    if newest is None:
        held = "has no record of what it compared (written by an older version, or copied in)"
    else:
        why = staleness(ws, newest)
        held = f"compares {newest.describes()}" + (f", but {why}" if why else
                                                    f", not the newest runs {npu} against {golden}")
    raise StaleResultError(f"the newest compare result {files[0]} {held}: run vc again, or "
                           f"name the file with vcs -f")


# what the summary and the root cause read of a result table (a third of its columns)
SUMMARY_COLUMNS = frozenset({"Index", "OpType", "NPUDump", "NpuDataType", "GroundTruth",
                             "TensorIndex", "PassName", "GoldenTensor", "GoldenOpType",
                             "CosineSimilarity", "MaxAbsoluteError", "RelativeEuclideanDistance",
                             "NpuNanCount", "NpuInfCount", "GoldenNanCount", "GoldenInfCount",
                             "NpuAtFp16Max", "FlushedToZeroRatio", "NpuNorm", "GoldenNorm",
                             "NormRelativeDiff", "Elements", "GoldenAbsMax", "SumKind",
                             "CompareFailReason", "Verdict"})
TEXT_COLUMNS = ("NPUDump", "TensorIndex", "GoldenTensor", "GoldenOpType", "PassName",
                "GroundTruth", "CompareFailReason", "Verdict", "SumKind", "NpuDataType", "OpType")


def read_result(path: str) -> Table:
    """A result CSV as the summary reads it: its SUMMARY_COLUMNS as a table.Table.
    Text columns are read as text, never as numbers: an op named "nan", a verdict...
    (an empty number is nan). No pandas: a summary of a result starts quickly."""
    data = read_bytes(path, WorkspaceError, "compare result")
    try:
        table = read_csv(data, {c: "t" if c in TEXT_COLUMNS else "f" for c in SUMMARY_COLUMNS})
    except TableError as e:
        raise WorkspaceError(f"{path} is not a readable compare result: {e}") from None
    missing = {"NPUDump", "OpType", "TensorIndex", "CosineSimilarity", "Verdict", "Index"} - set(table.columns)
    if missing:
        raise WorkspaceError(f"{path} is not a compare result of precision-tool vc: no "
                             f"{', '.join(sorted(missing))} column")
    order = table["Index"]
    if not np.array_equal(order, np.round(order)):        # nan too
        raise WorkspaceError(f"{path} is not a readable compare result: an Index that is not "
                             f"a whole number")
    return table.with_column("Index", order.astype(np.int64))
