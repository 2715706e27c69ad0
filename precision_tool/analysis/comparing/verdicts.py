"""What makes a compared tensor diverge: one rule, on all the evidence a compare row holds.

Cosine similarity alone is blind to magnitude and to small elements: a row clipped at 65504
keeps its direction while its norm falls by 94%, a gradient whose small entries flushed to
zero keeps a cosine of 0.9999, and a scalar (the loss) 10% off has a cosine of 1. A row
diverges when any of these holds (Criteria, each a documented option):

- nonfinite: the NPU holds more nan/inf elements than the golden (always);
- cosine: its cosine similarity is under `cosine`;
- norm: its L2 norm is more than `norm` apart from the golden's, relatively;
- at max: an fp16 NPU tensor holds elements at 65504 (or beyond) where the golden stays under
  it: saturation clipped them (in inf_nan mode they would be inf: nonfinite). As many as the
  golden holds infinities the NPU does not are those infinities, held saturated (a mask's
  -inf at -65504), and no clip;
- flushed: of a tensor of more than `small_size` elements, the NPU holds as zero more than
  `flushed` of the elements the golden holds as non-zero (underflow). Only a narrow float
  (fp16, bf16, or a dtype the table does not give) flushes: a zero a float32 NPU tensor holds
  where the golden holds 4e-6 is a sum's terms cancelling in another order, rounding that the
  cosine and the norm judge (two ranks' gradients of +-0.0149 all-reduced). A float32 tensor
  carries the holes of a flush it reads, though (an fp16 gradient cast to float32 for the
  update): where the table names the tensors, a float32 row holding flushed elements fails
  when it holds a flushed tensor (the same golden tensor) or its op reads one;
- relative error: a tensor of at most `small_size` elements, whose cosine says little, is
  more than `rel_error` away from the golden (relative Euclidean distance);
- one side all zero and not the other.

The defaults sit well above what fp16 or bf16 rounding does against an fp32 golden in the
shipped models' clean runs (norms within 6%, at most 3% flushed, scalars within 3%), so the
verdict stays dtype-aware: rounding passes. A row compared by statistics only (a side dumped
no tensor) has no cosine and no flush count: it is judged on its norms, its nan/inf counts
and its extremes. Where its golden holds infinities the NPU does not and the NPU's extreme on
that side is 65504, those infinities are taken as held saturated and left out of the NPU's
norm (compare.compare_stats), as a tensor compare leaves them out. `judge` takes a whole table (one pass of column operations), so a table
made with one set of criteria is judged again with another without reading any tensor.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from ... import numerics
from ...table import Table, column, numbers as _numbers, texts as _text

UNREADABLE = "unreadable: "       # a result row's reason when a tensor file could not be read
STATS_ONLY = "statistics only"
NOT_IN_INDEX = "not in the index"    # a compiled graph's kernel that the step's index lacks
# a call of an msprobe dump that the reference's calls have nothing in place of
NO_COUNTERPART = "no counterpart call"
ERROR_REASONS = ("shape mismatch", "no golden", UNREADABLE, NOT_IN_INDEX, NO_COUNTERPART)
# verdicts of a row: the first two diverge; error rows were not compared (coverage)
FAIL, NONFINITE, PASS, ERROR, NPU_ONLY = "fail", "nonfinite", "pass", "error", "npu-only"
DIVERGING = frozenset({FAIL, NONFINITE})
# NPU dtypes whose zeros are not underflow (see "flushed" in the module doc)
WIDE_FLOATS = ("float32", "float64")
_VERDICTS = np.array([PASS, FAIL, NONFINITE, ERROR, NPU_ONLY], dtype=object)


@dataclass(frozen=True)
class Criteria:
    """The thresholds of a verdict (see the module doc)."""
    cosine: float = 0.98      # cosine similarity under this fails
    norm: float = 0.1         # |NPU norm - golden norm| / golden norm over this fails
    flushed: float = 0.05     # share of the golden's non-zero elements the NPU holds as 0
    rel_error: float = 0.05   # relative Euclidean distance of a tensor of few elements
    small_size: int = 4       # "few elements": scalars and tiny vectors

    def __post_init__(self):
        for name in ("norm", "flushed", "rel_error"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"the {name} threshold must be 0 or more, got {getattr(self, name)}")
        if not -1.0 <= self.cosine <= 1.0:
            raise ValueError(f"the cosine threshold must be within [-1, 1], got {self.cosine}")

    @classmethod
    def of(cls, value) -> "Criteria":
        """Criteria from Criteria, a cosine threshold (the older calling convention), a dict
        of its fields, or None (the defaults)."""
        if value is None:
            return cls()
        if isinstance(value, Criteria):
            return value
        if isinstance(value, dict):
            return cls(**value)
        return cls(cosine=float(value))

    def to_dict(self) -> dict:
        return asdict(self)


def judge(table, criteria=None) -> Table:
    """Verdict and Reason of every row of a table (a table.Table or a pandas
    DataFrame): pass, fail (with the evidence that decided, e.g. "norm -94.1%; 32 at
    65504"), nonfinite, error (not compared: CompareFailReason says why) or npu-only.
    Missing evidence columns count as no evidence (a hand-made table)."""
    judged = evaluate(table, criteria)
    return Table({"Verdict": judged.verdicts, "Reason": judged.reasons()})


class Judged:
    """The verdicts of a table's rows and the tests behind them; the reasons' text is made
    when asked for, for the rows asked (a summary shows a few of tens of thousands)."""

    def __init__(self, verdicts, tests, shown, columns, stats):
        self.verdicts = verdicts       # per row: pass, fail, nonfinite, error, npu-only
        self.stats = stats             # rows compared by their statistics only
        self.tests = tests             # evidence name -> rows it fails ("nonfinite" first)
        self.shown = shown             # rows whose verdict has a reason (fail, nonfinite)
        self._columns = columns

    def only(self, name: str) -> np.ndarray:
        """The rows that this evidence alone fails."""
        others = np.zeros(len(self.verdicts), dtype=bool)
        for other, mask in self.tests.items():
            if other != name:
                others |= mask
        return self.shown & self.tests[name] & ~others

    def reasons(self, rows=None) -> np.ndarray:
        """The reason of each row (all rows when None), "" where it passes."""
        every = rows is None
        rows = np.arange(len(self.verdicts)) if every else np.asarray(rows, dtype=np.int64)
        out = np.full(len(rows), "", dtype=object)
        shown = self.shown[rows]
        for name, mask in self.tests.items():
            at = np.flatnonzero(mask[rows] & shown)
            if len(at):
                got = _EVIDENCE[name](self._columns)(rows[at])
                before = out[at]
                out[at] = np.where(before == "", got, before + "; " + got)
        out[shown & (out == "")] = "judged so when the table was made"
        return out


def evaluate(table, criteria=None) -> Judged:
    """judge's verdicts and their tests, the reasons' text left for later (see Judged)."""
    c = Criteria.of(criteria)
    n = len(table)
    reason = _text(table, "CompareFailReason")
    given = _text(table, "Verdict")
    # numpy's string functions, in C, over the rows that give a reason at all (most do not)
    some = np.flatnonzero(reason != "")
    text = reason[some].astype(str)
    error, stats = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    for prefix in ERROR_REASONS:
        error[some] |= np.char.startswith(text, prefix)
    error |= given == ERROR
    npu_only = given == NPU_ONLY
    stats[some] = np.char.startswith(text, STATS_ONLY)

    counts = [_numbers(table, k) for k in ("NpuNanCount", "NpuInfCount", "GoldenNanCount",
                                           "GoldenInfCount")]
    npu_bad = np.nan_to_num(counts[0]) + np.nan_to_num(counts[1])
    gold_bad = np.nan_to_num(counts[2]) + np.nan_to_num(counts[3])
    # a hand-made or older table may say "nan" (the former name) without the counts
    nonfinite = (npu_bad > gold_bad) | np.isin(given, ["nan", NONFINITE]) & np.isnan(counts[0])

    cos = _numbers(table, "CosineSimilarity")
    nx, ny = _numbers(table, "NpuNorm"), _numbers(table, "GoldenNorm")
    with np.errstate(divide="ignore", invalid="ignore"):
        norm_diff = np.where(ny > 0, (nx - ny) / ny, np.where(nx > 0, np.inf, 0.0))
    norm_diff = np.where(np.isnan(nx) | np.isnan(ny), np.nan, norm_diff)
    # a hand-made table with the cosine only: no norm evidence
    if "NormRelativeDiff" in table and "NpuNorm" not in table:
        norm_diff = _numbers(table, "NormRelativeDiff")
    elements = _numbers(table, "Elements")
    small = elements <= c.small_size
    red = _numbers(table, "RelativeEuclideanDistance")
    flushed = _numbers(table, "FlushedToZeroRatio")
    # NpuAtFp16Max counts inf too, which the non-finite test speaks for: finite 65504s here;
    # as many as the golden has infinities the NPU does not are those infinities held
    # saturated (a mask's -inf at -65504: what inf_nan mode would hold as -inf, and pass),
    # no clip of a finite value (the compare leaves the golden's nan/inf elements out)
    held = np.maximum(np.nan_to_num(counts[3]) - np.nan_to_num(counts[1]), 0)
    at_max = np.maximum(np.nan_to_num(_numbers(table, "NpuAtFp16Max")) - np.nan_to_num(counts[1])
                        - held, 0)
    golden_abs_max = _numbers(table, "GoldenAbsMax")
    npu_dtype = _text(table, "NpuDataType")
    fp16 = npu_dtype == "float16"
    wide = np.isin(npu_dtype, WIDE_FLOATS)

    tests = {
        "cosine": ~stats & (cos < c.cosine),
        "norm": np.abs(norm_diff) > c.norm,
        # a golden that holds exactly 65504 may hold it by design (an attention mask's
        # -65504): there the cosine and the norm decide; beyond it, the NPU clipped
        "at max": fp16 & (at_max > 0) & ~(golden_abs_max == numerics.FP16_MAX),
        "flushed": _flushes(table, ~small & (flushed > c.flushed), wide),
        "relative error": small & (red > c.rel_error),
        "zero": (nx == 0) != (ny == 0),
    }
    # without any evidence column, the verdict a hand-made table gives stands
    fail = np.zeros(n, dtype=bool)
    for mask in tests.values():
        fail |= mask
    no_evidence = np.isnan(cos) & np.isnan(norm_diff) & np.isnan(red)
    fail |= no_evidence & (given == FAIL)

    # codes first, the strings by one take (filling an object array mask by mask is slower)
    code = np.zeros(n, dtype=np.int8)          # _VERDICTS[0] is PASS
    code[fail] = 1
    code[nonfinite] = 2
    code[error] = 3
    code[npu_only] = 4
    verdicts = _VERDICTS.take(code)
    shown = (fail | nonfinite) & ~(error | npu_only)
    # the non-finite counts lead the reason, then the evidence in the order above
    tests = {"nonfinite": nonfinite, **tests}
    return Judged(verdicts, tests, shown, (cos, norm_diff, at_max, flushed, red, nx, ny, counts),
                  stats)


def _flushes(table, holes: np.ndarray, wide: np.ndarray) -> np.ndarray:
    """The rows that fail as flushed: the narrow floats' rows with holes, and the wide
    floats' rows with holes that carry a flush (see the module doc), walked in execution
    order (Index: an op's inputs come before its outputs) so that a carrier carries on."""
    narrow, candidates = holes & ~wide, np.flatnonzero(holes & wide)
    if not len(candidates) or "GoldenTensor" not in table or "TensorIndex" not in table:
        return narrow
    out = narrow.copy()
    golden = column(table, "GoldenTensor", "")
    flushed = {g for g in golden[narrow].tolist() if isinstance(g, str) and g}
    names = column(table, "NPUDump", "")
    is_input = np.char.find(_text(table, "TensorIndex").astype(str), ":output:") < 0
    # each op's input tensors, for the ops of candidate output rows only
    ops = set(names[candidates].tolist())
    read: dict = {}
    for i in np.flatnonzero(is_input & np.isin(names, list(ops))).tolist():
        read.setdefault(names[i], []).append(golden[i])
    for i in candidates[np.argsort(_numbers(table, "Index")[candidates], kind="stable")].tolist():
        g = golden[i]
        if g in flushed or not is_input[i] and any(r in flushed for r in read.get(names[i], ())):
            out[i] = True
            if isinstance(g, str) and g:
                flushed.add(g)
    return out


def _joined(pieces) -> np.ndarray:
    """Elementwise concatenation of string arrays (and plain strings) as an object array."""
    out = np.asarray(pieces[0], dtype=object)
    for p in pieces[1:]:
        out = out + np.asarray(p, dtype=object)
    return out


def _g(values, digits: int) -> np.ndarray:
    """Numbers as %g text at `digits` significant digits, elementwise."""
    return np.char.mod(f"%.{digits}g", np.asarray(values, dtype=float)).astype(object)


def _nonfinite_texts(counts):
    nan, inf, gnan, ginf = (np.nan_to_num(v).astype(np.int64) for v in counts)

    def texts(idx):
        out = []
        for a, b, c, d in zip(nan[idx], inf[idx], gnan[idx], ginf[idx]):
            what = ", ".join(f"{v} {k}" for k, v in (("nan", a), ("inf", b)) if v) or "nan/inf"
            gold = ", ".join(f"{v} {k}" for k, v in (("nan", c), ("inf", d)) if v) or "none"
            out.append(f"{what} (golden: {gold})")
        return np.array(out, dtype=object)
    return texts


def _norm_texts(norm_diff, nx):
    def texts(idx):
        d = norm_diff[idx]
        finite = np.isfinite(d)
        percent = np.char.mod("%+.4g", np.where(finite, d * 100, 0.0)).astype(object)
        return np.where(finite, "norm " + percent + "%",
                        "golden all zero, NPU norm " + _g(nx[idx], 6))
    return texts


# per evidence: (the table's columns) -> (row positions -> their texts), as the panels show
# them, at full precision where it decides
_EVIDENCE = {
    "nonfinite": lambda c: _nonfinite_texts(c[7]),
    "cosine": lambda c: lambda idx: _joined(["cosine ", _g(c[0][idx], 8)]),
    "norm": lambda c: _norm_texts(c[1], c[5]),
    "at max": lambda c: lambda idx: _joined([np.char.mod("%d", c[2][idx].astype(np.int64)).astype(object),
                                             " at 65504"]),
    "flushed": lambda c: lambda idx: _joined([_g(c[3][idx] * 100, 4), "% flushed to zero"]),
    "relative error": lambda c: lambda idx: _joined(["relative error ", _g(c[4][idx], 6)]),
    "zero": lambda c: lambda idx: np.where(c[5][idx] == 0, "NPU tensor is all zero",
                                           "golden tensor is all zero").astype(object),
}


def diverging(table, criteria=None) -> np.ndarray:
    """The rows that diverge under these criteria (fail or nonfinite), as a boolean array:
    what the summary, root cause and fusion bisection all use, so that `vcs -c 0` on a table
    made at 0.98 finds what 0 finds."""
    return np.isin(judge(table, criteria)["Verdict"], list(DIVERGING))


def verdict(row: dict, criteria=None) -> str:
    """The verdict of one row (a dict of a compare row's columns)."""
    return judge(Table({k: _one(v) for k, v in row.items()}), criteria)["Verdict"][0]


def _one(value) -> np.ndarray:
    out = np.empty(1, dtype=object)
    out[0] = value
    return out


@functools.lru_cache(maxsize=4096)       # a step's tensors share a few shapes
def element_count(shape: str) -> Optional[int]:
    """The elements of a shape as the index writes it ("32 2 8 8"; "" for a scalar)."""
    try:
        return math.prod(int(d) for d in str(shape).split())
    except ValueError:
        return None
