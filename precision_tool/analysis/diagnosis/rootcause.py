"""Root cause: in execution order, the origin of a divergence is the first op whose inputs
match the golden and whose outputs do not; ops downstream whose inputs already diverged are
propagators. Two more kinds are neither:

Cancellation. An op whose exact result is zero up to rounding noise diverges without
anything being wrong: attention's key-bias gradient is zero in exact arithmetic, so both runs
hold noise and their cosine is meaningless. Only a sum can cancel: its output is bounded by
its inputs (a sum's by its largest input's norm, a contraction's, a matmul or a convolution,
by the product of its two largest inputs' norms, Cauchy-Schwarz), and when the golden output
is no larger than the op's rounding tolerance times that bound, the output is cancellation
noise. Where the inputs already differ from the golden by elements flushed to zero, or carry
gradual error (see Gradual), their error and not the dtype's rounding is the noise floor the
test uses. A product is small because a factor is, never by cancellation: elementwise products,
and fused elementwise chains with one inside, are never excused (`SumKind` of the compare row
says which outputs are sums). Ops whose only diverging inputs are such noise (Adam turning the
noisy gradient into full-size steps, or updating state that such steps left noisy) are listed
with the cancellations: neither is a lead. So is an update whose inputs all match and whose
outputs differ in direction only (norms kept): Adam's per-element normalised step turns the
rounding of near-zero gradient elements into sign flips. Computed in fp32 (the golden's own
kernel) from inputs that differ at all, such a step may differ in norm too: where the
golden's gradient element is below eps its step is partial, and rounding makes the other
run's full (a bias that starts at zero, GPT-2's fused query-key-value bias, then shows it in
its norm). A real fault in an update shows in its norms when it computes in fp16 or bf16,
in its non-finite counts or in an input; a normalised step whose inputs are the golden's,
bit for bit, stays an origin.

Absorbed. An op whose outputs differ only by elements flushed to zero, with the ops
downstream that differ only so too, started nothing when no op whose only diverging inputs
descend from it makes more of it, and something reads each flushed tensor: the flushed
values were too small to count (a pruned layer's weights of 1e-10 beside 0.5 flush in fp16,
its dead channels flush after it, and what reads them stays as close to the golden as its
inputs are). These are listed with the cancellations. An op downstream that makes more of
a flush (an inf or nan, or an output AMPLIFIES times further from the golden, relative
Euclidean distance, than its furthest input: a division by a flushed value) keeps it an
origin, as does a flushed tensor nothing reads (a fetched output, an update's result).

Carried. An op whose only diverging inputs are variables read at the start of the step (the
weights, optimizer moments, the loss scale) did not start the divergence in this step: it
entered with the state an earlier step left (see analysis.diagnosis.steps for following it back).
State that an earlier step's noise update wrote (root_cause's noise_state, from the trace)
is noise itself: what reads only it carries noise, and is no finding. A
variable's own row (a golden run dumps its Variable ops) that diverges is carried state too.

Gradual. An op whose inputs all pass but whose outputs are less than GROWS times further from
the golden (relative Euclidean distance) than its furthest input did not start anything: its
inputs carried in almost all of the difference, just under the threshold, and it crossed the
threshold adding little (the low precision's rounding growing layer by layer: a ResNet's fp16
backward loses a few percent of cosine per BatchNorm and per ReLU mask). That holds only
where no op before it made the difference (OpRows.made_by: none along the furthest inputs
came out AMPLIFIES times further than it went in, past rounding). Where one did (a saturated
fused LayerNorm whose passing output carries the error on), the reader that crosses stays
an origin, as before. What reads only gradual outputs and adds less than GROWS again is
gradual too, and so is an update that reads them and differs in direction only (Adam's
normalised step, as above). No op there is one to keep in fp32: gradual ops are listed,
not findings; their effect over steps is the loss drift's to show (analysis.diagnosis.drift),
and state their updates write is carried as noise is. An op that adds GROWS times more than
the gradual error it reads is a finding (a propagator that no origin leads). Statistics-only
rows have no distance: never gradual by it. One kind of op is gradual however far its output
moves: a kernel that rounds nothing (SumKind "exact": a ReLU and its gradient, a max pool, a
select, in its inputs' dtype), whose inputs pass but differ from the golden's at all. A
ReLU's gradient masks the incoming gradient by where the saved activation is positive, and
fp16 rounding moves activations near zero across it: a healthy fp16 ResNet's last ReLU
gradient, its saved activation at cosine 0.9942, comes out at 0.973 so. Such an op makes
nothing either (made_by passes over it), and keeping it in fp32 would change nothing. With
inputs equal to the golden's bit for bit, an exact kernel that differs is wrong, and stays
an origin.

Without effect. A finding needs an effect: a divergence that changes no output, no loss and
no update is not one. An origin, a carried op or a propagator has an effect when one of its
diverging outputs is read by nothing in the step (a fetched output, the loss, the value an
update writes), is read by an update as the step it applies where an overflow made it
diverge (an update's effect is its change: the weight it writes matches however its step
differs, a step being tiny beside the weight: AdamW's param.addcdiv_ reading a moment made
from the zeros of an overflowed RMS norm; a difference only rounding made, a ReLU's mask
flipped by fp16 activations, is left to the value, as healthy fp16 runs need), or is read
by an op
that diverges on that input and has an effect itself. A
divergence that every reader absorbs (a key bias whose shift the softmax removes: the
attention scores match) stops there, and its ops are listed as "without effect" with the
readers that absorbed it: never an origin. A call's backward reads what its forward saved
(a ReLU's mask), except a one-element output: a loss's backward needs no value of the loss
(its gradient is 1), so a script's loss, read by nothing else, is what the step puts out and
never absorbed (it was: a loss 40% off "without effect"). A table with no input rows (a
foreign dump whose file names say nothing of inputs) has every tensor a sink: every
divergence keeps its effect.
Where an origin with an effect comes later in the step, what diverged before it stays a lead:
its readers' small differences may be what that origin amplified (a weight gradient sums
over the batch what each reader absorbed), which the compare alone cannot tell apart.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable, List, Optional, Set

import numpy as np

from ...collector import collector_paused
from ..comparing.sums import sum_kind
from ...table import column, factorize, numbers, texts
from ..comparing.verdicts import ERROR, NONFINITE, PASS, Criteria, evaluate

# The per-dtype tolerances tell an op's own error from fp16 rounding: an fp16 tensor against
# an fp32 golden is expected to differ by that much. (A verdict's thresholds: Criteria.)
# ops whose output is a variable's value at the start of the step (a golden run dumps them)
STATE_OPS = frozenset({"Variable"})
# a script's loss scaler deciding (torch.amp.GradScaler's kernels): after an overflow the
# NPU's decides to skip and lower the scale where the golden's does not; that decision is
# the overflow's (the Loss scale panel shows it), never a divergence of its own
SCALER_OPS = frozenset({"Torch._amp_update_scale_",
                        "Torch._amp_foreach_non_finite_check_and_unscale_"})
TOLERANCE = {"float16": 1e-3, "bfloat16": 1e-2, "float32": 1e-5, "float64": 1e-7}

class OpRows:
    """A result table's columns as Python lists, its verdicts judged once for every row
    under the criteria, and, in execution order, each op that has a diverging output as
    (name, row positions, execution order): what root cause and the summary walk, op by op
    (per-op pandas or numpy selections cost microseconds each, and a 100,000-row table has
    thousands of such ops)."""

    def __init__(self, table, criteria=None):
        self.criteria = Criteria.of(criteria)

        def col(name, default):
            return column(table, name, default).tolist()
        self.tensor = texts(table, "TensorIndex").tolist()
        self.is_out = [":output:" in s for s in self.tensor]
        self.judged = evaluate(table, self.criteria)
        self.verdict = self.judged.verdicts.tolist()
        self._reasons = {}             # row -> reason, made when asked (reasons)
        bad = self.judged.shown          # fail or nonfinite: the verdicts that have a reason
        self.bad = bad.tolist()
        self.op_type = texts(table, "OpType").tolist()
        self.pass_name = col("PassName", "")
        self.golden_op = col("GroundTruth", "")
        # input rows holding a variable's value at the start of the step
        self.state = (texts(table, "GoldenOpType") == "Variable") & ~np.array(self.is_out, dtype=bool)
        # a list kernel's lanes are ops of their own (see _lanes); rows its lanes share
        self.op_name, self.shared = _lanes(col("NPUDump", ""), self.tensor, self.op_type)
        # rows that fail on one piece of evidence alone (root cause's and underflow's tests);
        # these stay numpy arrays: read for a few rows each, and no list of 100,000 items
        # more for the garbage collector to walk
        self.cosine_only = self.judged.only("cosine")
        self.flushed_only = self.judged.only("flushed")
        # a tensor of few elements off by its relative error alone (its cosine passes)
        self.small_only = self.judged.only("relative error")
        # rows that fail on how far they are from the golden (cosine, norms, the share of
        # zeros: a ReLU whose input crossed zero), not on elements saturated at the fp16
        # maximum or non-finite (Gradual's evidence)
        others = np.zeros(len(self.verdict), dtype=bool)
        for name, mask in self.judged.tests.items():
            if name in ("nonfinite", "at max"):
                others |= mask
        self.by_distance = bad & ~others
        self.has_golden = "GoldenTensor" in table
        self.golden_tensor = col("GoldenTensor", None)
        self.golden_norm = numbers(table, "GoldenNorm").tolist() if "GoldenNorm" in table else None
        self.sum_kind = col("SumKind", None)
        self.dtype = col("NpuDataType", "")
        self.cosine = numbers(table, "CosineSimilarity").tolist()
        self.fail_reason = col("CompareFailReason", "")
        # rows compared by their statistics only (a side dumped no tensor): no cosine
        self.stats_only = self.judged.stats.tolist()
        # compared at all, and every compared row by its statistics (a statistics-only dump);
        # a tensor dump has no such row, which settles it without looking at the verdicts
        stats = self.judged.stats
        compared = (bad | (self.judged.verdicts == PASS)) if stats.any() else None
        self.by_statistics = compared is not None and bool(compared.any() and stats[compared].all())
        self.norm_diff = col("NormRelativeDiff", float("nan"))
        self.elements = numbers(table, "Elements").tolist()
        self.red = numbers(table, "RelativeEuclideanDistance").tolist()
        self._index = column(table, "Index", 0)
        self.ops = _diverging_ops(np.asarray(self.op_name, dtype=object), self._index,
                                  bad & np.array(self.is_out, dtype=bool))
        self.order_of = {name: order for name, _, order in self.ops}
        # rows whose golden holds nan/inf: their metrics leave those elements out, so a pass
        # there is no evidence that the row matches
        with np.errstate(invalid="ignore"):
            self.golden_nonfinite = (np.nan_to_num(numbers(table, "GoldenNanCount")) +
                                     np.nan_to_num(numbers(table, "GoldenInfCount")) > 0)

    @cached_property
    def rows_by_op(self) -> dict:
        """Every op's row positions, ops in execution order (their first rows')."""
        rows: dict = {}
        for i in np.argsort(self._index, kind="stable").tolist():
            rows.setdefault(self.op_name[i], []).append(i)
        return rows

    def saved(self, op_name: str) -> list:
        """A call's backward (`X.backward`, an API-level dump's: the script's, msprobe's)
        computes from what its forward saved, which its record does not list: the rows of
        `X.forward` (its inputs and outputs), as inputs the backward reads. [] for others."""
        if not isinstance(op_name, str) or not op_name.endswith(".backward"):
            return []
        return self.rows_by_op.get(op_name[:-len("backward")] + "forward", [])

    def inputs(self, op_name: str, pos: list) -> list:
        """The rows an op reads: its input rows and, for a call's backward, what its
        forward saved; for a list kernel's lane, the rows its lanes share."""
        return [i for i in pos if not self.is_out[i]] + self.saved(op_name) + \
            self.shared.get(op_name, [])

    def furthest(self, rows: list) -> Optional[int]:
        """The row furthest from the golden (relative Euclidean distance; rows without one
        last), None for no rows."""
        red = self.red
        return max(rows, key=lambda i: red[i] if red[i] == red[i] else -1.0) if rows else None

    @cached_property
    def made_by(self) -> dict:
        """Golden tensor -> the op that made its difference from the golden (see Gradual in
        the module doc): an op whose outputs are AMPLIFIES times further from the golden than
        its furthest input (its saved rows too) and past its dtypes' rounding; a tensor an
        op did not make so inherits its furthest input's. Every op of the table, in
        execution order; state (an op without inputs) makes nothing."""
        made: dict = {}
        red, golden = self.red, self.golden_tensor
        for name, pos in self.rows_by_op.items():
            ins = self.inputs(name, pos)
            outs = [i for i in pos if self.is_out[i]]
            if not ins or not outs:
                continue
            furthest = self.furthest(ins)
            red_in = red[furthest] if red[furthest] == red[furthest] else 0.0
            red_out = max((red[i] for i in outs if red[i] == red[i]), default=0.0)
            floor = 10 * max(TOLERANCE.get(str(self.dtype[i]), 1e-3) for i in pos)
            # an exact kernel (a ReLU's gradient) makes nothing: a mask it applies flips
            # where rounding moved the saved activation across zero
            maker = name if red_out > floor and red_out > AMPLIFIES * red_in and \
                not self.exact(outs, ins) else made.get(golden[furthest])
            if maker is not None:
                for i in outs:
                    made[golden[i]] = maker
        return made

    def came_from(self, op_name: str, pos: list) -> Optional[str]:
        """The op that made the difference an op's furthest input carries (made_by), or
        None: it grew op by op from the rounding."""
        furthest = self.furthest(self.inputs(op_name, pos))
        return None if furthest is None else self.made_by.get(self.golden_tensor[furthest])

    @cached_property
    def read(self) -> Set[str]:
        """The golden tensors some op of the step reads (an input row's); what is not among
        them is read by nothing: the loss, a fetched output, an update's result."""
        return {self.golden_tensor[i] for i, out in enumerate(self.is_out) if not out}

    def exact(self, outs: list, ins: list) -> bool:
        """Whether these outputs are exact by their kernel (SumKind "exact": a ReLU's
        gradient, a max pool, a select) and in the dtype of every floating input (no cast
        down inside the kernel): they round nothing of their own."""
        floats = {str(self.dtype[i]) for i in ins if str(self.dtype[i]) in TOLERANCE}
        return bool(outs) and all(self.kind_of(i) == "exact" and
                                  not floats - {str(self.dtype[i])} for i in outs)

    def kind_of(self, i: int) -> str:
        """The row's SumKind, or (a table without the column) what its op type says."""
        kind = self.sum_kind[i]
        if isinstance(kind, str):
            return kind
        return sum_kind(str(self.op_type[i]), {}, 0)

    def reasons(self, rows) -> list:
        """The reasons of these rows (what decided each verdict), made once per row."""
        todo = [i for i in rows if i not in self._reasons]
        if todo:
            self._reasons.update(zip(todo, self.judged.reasons(todo).tolist()))
        return [self._reasons[i] for i in rows]


# a call on lists of tensors (`torch._foreach_mul_`, the scaler's unscale, a fused
# optimizer): element k of every list it takes makes element k of the list it puts out
_LIST_KERNELS = ("Torch._foreach_", "Torch._amp_foreach_", "Torch._fused_")
# the inputs past its lists, where their count is fixed (for others, what a whole number of
# lists leaves over: with as many lanes as such inputs, the count is not to be guessed)
_SHARED_INPUTS = {"Torch._amp_foreach_non_finite_check_and_unscale_": 2}   # found_inf, inv_scale


def _lanes(names: list, tensors: list, types: list) -> tuple:
    """(names, shared): each row's op as root cause walks it, and the rows each lane also
    reads. A list kernel's lanes are independent ops, named `<op>[k]` after their element:
    with n outputs (one per lane), its input j of a list belongs to lane j mod n, and the
    inputs past its lists (the scaler's found_inf and inv_scale) are read by every lane.
    As one op, the scaler's unscale read a real divergence in one gradient and noise in
    others, so the noise's effect on the updates counted for the real one, which every
    update absorbed. Other ops' names are kept."""
    kernels: dict = {}
    for i, kind in enumerate(types):
        if kind.startswith(_LIST_KERNELS):
            kernels.setdefault(names[i], []).append(i)
    shared: dict = {}
    if not kernels:
        return names, shared
    names = list(names)
    for name, rows in kernels.items():
        fixed = _SHARED_INPUTS.get(types[rows[0]])
        split = [tensors[i].rpartition(":")[::2] for i in rows]     # ("...:input", "3")
        outs = [int(k) for (side, k) in split if side.endswith("output") and k.isdigit()]
        lanes = len(outs)
        n_in = sum(1 for (side, _) in split if side.endswith("input"))
        if lanes < 2 or sorted(outs) != list(range(lanes)) or n_in < lanes:
            continue
        listed = n_in - fixed if fixed is not None else n_in // lanes * lanes
        if listed % lanes:
            continue
        common = []
        for i, (side, k) in zip(rows, split):
            j = int(k) if k.isdigit() else -1
            if side.endswith("input") and not 0 <= j < listed:
                common.append(i)
            elif j >= 0:
                names[i] = f"{name}[{j % lanes}]"
        for k in range(lanes):
            shared[f"{name}[{k}]"] = common
    return names, shared


def call_name(op_name: str) -> str:
    """The op a root cause's name stands for in the table and the dump: a list kernel's
    lane `<op>[k]` is its call `<op>`; other names are their own."""
    if isinstance(op_name, str) and op_name.endswith("]"):
        head, bracket, k = op_name[:-1].rpartition("[")
        if bracket and k.isdigit():
            return head
    return op_name


def _diverging_ops(names: np.ndarray, order: np.ndarray, bad_out: np.ndarray) -> list:
    """(name, row positions, execution order of its first row) of each op with a row in
    bad_out, sorted by that order; an op's rows in table order."""
    codes, uniques = factorize(names.tolist())                    # a nan name too
    wanted = np.zeros(len(uniques), dtype=bool)
    wanted[codes[bad_out]] = True
    rows = np.flatnonzero(wanted[codes])
    rows = rows[np.argsort(codes[rows], kind="stable")]       # grouped by op, in table order
    starts = np.flatnonzero(np.r_[True, np.diff(codes[rows]) != 0])
    if not len(rows):
        return []
    first = np.minimum.reduceat(order[rows], starts).tolist()
    names = uniques[codes[rows[starts]]].tolist()
    flat, bounds = rows.tolist(), [*starts.tolist(), len(rows)]   # one list, sliced per op
    ops = [(names[k], flat[bounds[k]:bounds[k + 1]], first[k]) for k in range(len(names))]
    ops.sort(key=lambda op: op[2])
    return ops


def is_cancellation(t: OpRows, rows: list, bad_out: list, floor: float = 0.0) -> bool:
    """See the module doc; rows are one op's positions, bad_out its diverging outputs'. Never
    for nan/inf outputs (those are real), outputs that are not sums, or without the norms.
    floor: the relative error the inputs already carry, where it exceeds the dtype's rounding
    (inputs that lost elements to flushing): the terms are known no better than that."""
    if t.golden_norm is None or any(t.verdict[i] == NONFINITE for i in bad_out):
        return False
    kinds = {t.kind_of(i) for i in bad_out}
    if kinds - {"sum", "contraction"}:
        return False
    norms = sorted((v for v in (t.golden_norm[i] for i in rows if not t.is_out[i]) if v == v),
                   reverse=True)
    if not norms:
        return False
    bound = norms[0] if kinds == {"sum"} else norms[0] * (norms[1] if len(norms) > 1 else 1.0)
    tol = max(max(TOLERANCE.get(str(t.dtype[i]), 1e-3) for i in rows), floor)
    return bound > 0 and all(t.golden_norm[i] <= tol * bound for i in bad_out)


def _cancels_carried_error(t: OpRows, rows: list, bad_in: list, bad_out: list,
                           gradual: Set[str]) -> bool:
    """A sum whose exact value is zero up to what its terms carry, when every diverging
    term carries an error that is no fault of its own: small elements flushed to zero
    (attention's key-bias gradient, zero in exact arithmetic, summed from score gradients
    that fp16 flushed in places) or gradual error (the bias gradient of a layer a BatchNorm
    follows). Its noise floor is its inputs' distance from the golden, not the dtype's
    rounding."""
    if not bad_in or not (all(t.flushed_only[i] for i in bad_in) or
                          all(t.golden_tensor[i] in gradual for i in bad_in)):
        return False
    floor = max((t.red[i] for i in bad_in if t.red[i] == t.red[i]), default=0.0)
    return is_cancellation(t, rows, bad_out, floor)


@dataclass
class Divergence:
    op_name: str
    op_type: str
    order: int
    pass_name: str
    bad_outputs: List[str]
    bad_inputs: List[str] = field(default_factory=list)
    # what decided, per diverging output (verdicts.judge's reason: "norm -94.1%; ...")
    reasons: List[str] = field(default_factory=list)
    state_inputs: List[str] = field(default_factory=list)   # the variables among bad_inputs
    # inputs that were not compared (a file missing or unreadable): an origin with such an
    # input is one as far as the compare saw; the divergence may have come in through it
    unseen_inputs: List[str] = field(default_factory=list)
    # without effect: the ops that read its diverging outputs and match the golden
    absorbed_by: List[str] = field(default_factory=list)
    # an origin judged by statistics only: the largest relative difference of its inputs'
    # norms from the golden's (within the criteria), which norms cannot tell from its own
    inputs_off: float = 0.0

    @property
    def is_origin(self) -> bool:
        return not self.bad_inputs


@dataclass
class RootCause:
    origins: List[Divergence]
    propagators: List[Divergence]
    cancellations: List[Divergence] = field(default_factory=list)   # and what only carries them
    # ops whose only diverging inputs are variables: the divergence came in with the state
    carried: List[Divergence] = field(default_factory=list)
    # ops whose divergence reaches no output, loss or update (see the module doc)
    no_effect: List[Divergence] = field(default_factory=list)
    # ops that cross the threshold with what came in just under it (see Gradual)
    gradual: List[Divergence] = field(default_factory=list)
    rows: "OpRows" = field(default=None, repr=False, compare=False)   # what it was computed from
    # per op of rows.ops, made when the summary first asks (summary._categories)
    categories: Optional[List[str]] = field(default=None, repr=False, compare=False)

    @property
    def first_origin(self) -> Optional[Divergence]:
        return self.origins[0] if self.origins else None

    @property
    def noise_ops(self) -> Set[str]:
        return {d.op_name for d in self.cancellations}

    @property
    def no_effect_ops(self) -> Set[str]:
        return {d.op_name for d in self.no_effect}

    @property
    def gradual_ops(self) -> Set[str]:
        return {d.op_name for d in self.gradual}

    @property
    def benign_ops(self) -> Set[str]:
        """The ops that diverge and are no finding: noise, gradual divergence, and divergence
        without effect."""
        return self.noise_ops | self.no_effect_ops | self.gradual_ops

    @property
    def diverging_state(self) -> List[str]:
        """The variables (golden tensor names) that already differ when the step starts."""
        return sorted({v for d in self.carried for v in d.state_inputs})

    @property
    def state_first(self) -> bool:
        """Whether state carried in from an earlier step diverges before (or without) any op
        of this step starting a divergence of its own."""
        if not self.carried:
            return False
        return self.first_origin is None or self.carried[0].order < self.first_origin.order


def _updated_positions(op_type: str) -> tuple:
    """The input positions an op type overwrites (a variable update's), empty for others.
    The op registry is loaded the first time a root cause asks, not for every summary."""
    from ...ops import registry
    return tuple(registry.updated_inputs(op_type) or ())


def _updates_inputs(op_type: str) -> bool:
    """Does the op type write its inputs (a variable update)?"""
    return bool(_updated_positions(op_type))


_WIDE = ("float32", "float64")


def _differs(t: "OpRows", i: int) -> bool:
    """Whether a row differs from the golden's at all: its cosine under 1, or, compared by
    statistics only (no cosine), its norm not the golden's (the same run dumped by tensors
    then shows the cosine under 1: a statistics dump must not call an origin what a tensor
    dump calls an Adam step's noise)."""
    if t.cosine[i] == t.cosine[i]:
        return t.cosine[i] < 1.0
    return bool(t.stats_only[i]) and t.norm_diff[i] == t.norm_diff[i] and t.norm_diff[i] != 0


def _normalised_step(op_type: str) -> bool:
    """An update that divides each element's step by a running norm of its gradient (Adam's
    m / (sqrt(v) + eps): the graph's ApplyAdam, PyTorch's addcdiv_ that ends Adam's step)."""
    return op_type == "ApplyAdam" or "addcdiv" in op_type


def root_cause(table, criteria=None, rows: "OpRows" = None,
               noise_state: Iterable[str] = (), overflowed: Iterable[str] = ()) -> RootCause:
    """Every op with a diverging output, as an origin, a propagator, cancellation noise or
    carried state (see the module doc), under the criteria (verdicts.Criteria, or a cosine
    threshold). noise_state: variables (golden names) that an earlier step's noise update
    wrote (steps.trace_state): what reads only them carries that noise, as within a step.
    overflowed: the ops whose kernels overflowed (the status word's): what descends from
    them and reaches an update's step has an effect (see Without effect)."""
    # a few objects per op and no cycles: collections walked the table's columns (lists of
    # 100,000 items) again and again, a fifth of the time on a large table
    with collector_paused():
        return _root_cause(rows if rows is not None else OpRows(table, criteria),
                           set(noise_state), set(overflowed))


# an op whose output is this many times further from the golden (relative Euclidean distance)
# than its furthest input made that difference itself
AMPLIFIES = 10.0
# one whose output is less than this many times further than its furthest input carried the
# difference in (see Gradual in the module doc)
GROWS = 2.0


def _distances(t: "OpRows", pos: list, ins: Optional[list] = None) -> tuple:
    """(furthest input, furthest output) of an op's rows by relative Euclidean distance,
    0.0 where no row has one (statistics only, not compared); ins: the rows it reads
    (OpRows.inputs), its own input rows when None."""
    ins = [i for i in pos if not t.is_out[i]] if ins is None else ins
    red_in = max((t.red[i] for i in ins if t.red[i] == t.red[i]), default=0.0)
    red_out = max((t.red[i] for i in pos if t.is_out[i] and t.red[i] == t.red[i]), default=0.0)
    return red_in, red_out


def _amplifies(t: "OpRows", pos: list) -> bool:
    """Whether an op's outputs are much further from the golden than any of its inputs."""
    red_in, red_out = _distances(t, pos)
    return red_out > AMPLIFIES * red_in


def _adds_little(t: "OpRows", pos: list, bad_out: list, ins: list) -> bool:
    """Whether an op's diverging outputs are within GROWS times its furthest input's
    distance, an input that carries one (see Gradual); only for outputs that fail on their
    distance (not on values saturated or nan/inf, nor with nan/inf in the golden), and
    never for rows without distances."""
    if any(not t.by_distance[i] or t.golden_nonfinite[i] or t.red[i] != t.red[i]
           for i in bad_out):
        return False
    red_in, red_out = _distances(t, pos, ins)
    return red_in > 0 and red_out < GROWS * red_in


def _rounds_nothing(t: "OpRows", pos: list, bad_out: list, ins: list) -> bool:
    """Whether an op whose outputs diverge while its inputs pass only selected or masked
    what its inputs carry (see Gradual): every diverging output exact (OpRows.exact) and
    finite on both sides, and some input that differs from the golden's at all (with inputs
    equal bit for bit, an exact kernel that differs is wrong)."""
    if not t.exact(bad_out, ins) or any(t.verdict[i] == NONFINITE or t.golden_nonfinite[i]
                                         for i in bad_out):
        return False
    return any(t.cosine[i] < 1.0 or t.red[i] > 0 or abs(t.norm_diff[i]) > 0 for i in ins)


def written_variables(t: "OpRows", ops: Set[str]) -> Set[str]:
    """The variables (golden tensor names) that these update ops overwrite: their inputs at
    the positions the op registry names."""
    out = set()
    for i, out_row in enumerate(t.is_out):
        if not out_row and t.op_name[i] in ops:
            updates = _updated_positions(t.op_type[i])
            if updates and int(t.tensor[i].rpartition(":input:")[2]) in updates and \
                    isinstance(t.golden_tensor[i], str):
                out.add(t.golden_tensor[i])
    return out


def _reads_as_step(t: "OpRows", i: int) -> bool:
    """Whether input row i is what an update op applies (a gradient, a learning rate), not
    the variable or slot it overwrites."""
    updates = _updated_positions(t.op_type[i])
    return bool(updates) and int(t.tensor[i].rpartition(":input:")[2]) not in updates


def _harmless_flushes(t: "OpRows") -> Set[str]:
    """The ops of flushes that start nothing (see Absorbed in the module doc): flush-only
    origins and the flush-only ops downstream of them only, unless some op whose only
    diverging inputs descend from them diverges on more than a flush, or a flushed tensor
    of theirs is read by nothing (a fetched output)."""
    flushed_from = {}            # golden tensor -> the flush origins it descends from
    members = {}                 # op -> its flush origins
    harmful = set()
    for op_name, pos, _ in t.ops:
        bad_in = [i for i in pos if t.bad[i] and not t.is_out[i]]
        bad_out = [i for i in pos if t.bad[i] and t.is_out[i]]
        flush_only = all(t.flushed_only[i] for i in bad_out)
        sources = set()
        if bad_in:
            if not all(t.golden_tensor[i] in flushed_from for i in bad_in):
                continue                  # a worse input is there too: no flush is blamed
            for i in bad_in:
                sources |= flushed_from[t.golden_tensor[i]]
            if any(t.verdict[i] == NONFINITE for i in bad_out) or _amplifies(t, pos):
                harmful |= sources        # the flush may be what this op shows
                continue
            if not flush_only:
                continue                  # it carries on what its inputs carry: no lead
        elif flush_only:
            sources = {op_name}
        else:
            continue
        members[op_name] = sources
        for i in bad_out:
            flushed_from[t.golden_tensor[i]] = sources
    if not members:
        return set()
    read = t.read
    # a gradient an update reads: its change, not the weight it lands on, is what the flush
    # loses (a weight of 0.25 hides a step of 1e-7 whether or not it was taken)
    for i, out in enumerate(t.is_out):
        if not out and t.golden_tensor[i] in flushed_from and _reads_as_step(t, i):
            harmful |= flushed_from[t.golden_tensor[i]]
    for tensor, sources in flushed_from.items():
        if tensor not in read:
            harmful |= sources
    return {op for op, sources in members.items() if not sources & harmful}


def _root_cause(t: "OpRows", noise: Set[str], overflowed: Set[str] = frozenset()) -> RootCause:
    """noise: golden tensors that hold cancellation noise (grows as the ops are walked)."""
    found = {"origin": [], "propagator": [], "cancellation": [], "carried": [], "gradual": []}
    gradual: Set[str] = set()      # golden tensors that hold gradual divergence
    harmless = _harmless_flushes(t) if t.has_golden and t.flushed_only.any() else set()
    for op_name, pos, order in t.ops:
        if overflowed and t.op_type[pos[0]] in SCALER_OPS:
            continue
        bad_out = [i for i in pos if t.bad[i] and t.is_out[i]]
        # (what its forward saved, diverging, is a diverging input of a call's backward)
        ins = t.inputs(op_name, pos)
        bad_in = [i for i in ins if t.bad[i]]
        pass_name = t.pass_name[pos[0]]
        d = Divergence(op_name, t.op_type[pos[0]], order,
                       pass_name if isinstance(pass_name, str) else "",
                       [t.tensor[i] for i in bad_out], [t.tensor[i] for i in bad_in],
                       (),                    # filled below for the ops that lead
                       tuple(str(t.golden_tensor[i]) for i in bad_in if t.state[i]),
                       [t.tensor[i] for i in pos if not t.is_out[i] and t.verdict[i] == ERROR])
        noisy = [i for i in bad_in if t.golden_tensor[i] in noise] if noise and t.has_golden else ()
        # an update from a noise gradient writes noise into its variable and its optimizer
        # slots, and in later steps reads that state back: noise carried over, no lead
        carries_noise = bool(noisy) and all(t.verdict[i] != NONFINITE for i in bad_out) and \
            all(i in noisy or (t.state[i] and _updates_inputs(d.op_type)) for i in bad_in)
        # an update whose inputs all match and whose outputs differ in direction alone:
        # a per-element normalised step (Adam's m / sqrt(v)) turns the rounding of
        # near-zero gradient elements, within tolerance, into sign flips of full-size steps;
        # and, a normalised step computed in fp32 (the golden's own kernel) from inputs that
        # differ at all, into full steps where the golden's gradient, below eps, took a
        # partial one (a bias that starts at zero then differs in norm too)
        # (a step input of few elements whose cosine passes, off by its relative error alone,
        # counts as matching here: the first Adam step of a bias of 4 zeros takes a full step
        # the other way for an element the incoming rounding moved across zero)
        amplified = _updates_inputs(d.op_type) and bool(bad_out) and \
            all(t.small_only[i] and _reads_as_step(t, i) for i in bad_in) and (
            all(t.cosine_only[i] for i in bad_out) or _normalised_step(d.op_type) and
            all(str(t.dtype[i]) in _WIDE for i in bad_out) and
            any(_differs(t, i) for i in ins))
        # a dumped variable's own row holding what a noise update wrote
        noise_state = not bad_in and d.op_type in STATE_OPS and bool(bad_out) and \
            all(t.golden_tensor[i] in noise for i in bad_out)
        if carries_noise or amplified or noise_state or op_name in harmless or \
                (d.is_origin and is_cancellation(t, pos, bad_out)) or \
                _cancels_carried_error(t, pos, bad_in, bad_out, gradual):
            kind = "cancellation"
            if t.has_golden:
                noise.update(t.golden_tensor[i] for i in bad_out)
        elif t.has_golden and d.op_type not in STATE_OPS and \
                all(t.golden_tensor[i] in gradual or t.golden_tensor[i] in noise
                    for i in bad_in) and (_adds_little(t, pos, bad_out, ins) or bool(
                    bad_in) and _updates_inputs(d.op_type) and
                    all(t.cosine_only[i] for i in bad_out)) and \
                (bad_in or t.came_from(op_name, pos) is None) or \
                t.has_golden and d.is_origin and _rounds_nothing(t, pos, bad_out, ins):
            # an origin that crosses with what came in, or what reads only such crossings
            kind = "gradual"
            gradual.update(t.golden_tensor[i] for i in bad_out)
        elif bad_in and all(t.state[i] for i in bad_in):
            kind = "carried"
        elif not bad_in and d.op_type in STATE_OPS:       # a dumped variable's own value
            kind = "carried"
            d.state_inputs = tuple(str(t.golden_tensor[i]) for i in bad_out)
        else:
            kind = "origin" if d.is_origin else "propagator"
            if d.is_origin and all(t.stats_only[i] for i in bad_out):
                d.inputs_off = max((abs(t.norm_diff[i]) for i in ins
                                    if t.norm_diff[i] == t.norm_diff[i]), default=0.0)
        found[kind].append(d)
    quiet = _without_effect(t, found, overflowed) if t.has_golden else set()
    # an origin with an effect later in the step may be what this one's small differences
    # became (a contraction over the batch amplifies what each reader absorbed): the static
    # evidence does not decide there, and the earlier divergence stays a lead
    later = [d.order for d in found["origin"] if d.op_name not in quiet]
    if later:
        quiet = {name for name in quiet if t.order_of[name] > min(later)}
    no_effect = []
    for kind in ("origin", "carried", "propagator"):
        no_effect += [d for d in found[kind] if d.op_name in quiet]
        found[kind] = [d for d in found[kind] if d.op_name not in quiet]
    no_effect.sort(key=lambda d: d.order)
    # what the report and the advice quote: the first origin, carried state, the first
    # divergence without effect and the first gradual crossing (their evidence)
    leading = [d for d in found["origin"][:1] + found["carried"] + no_effect[:1] +
               found["gradual"][:1]]
    by_op = {name: pos for name, pos, _ in t.ops}
    rows = {d.op_name: [i for i in by_op[d.op_name] if t.bad[i] and t.is_out[i]] for d in leading}
    t.reasons([i for r in rows.values() for i in r])          # in one pass
    for d in leading:
        d.reasons = t.reasons(rows[d.op_name])
    return RootCause(found["origin"], found["propagator"], found["cancellation"],
                     found["carried"], no_effect, found["gradual"], rows=t)



def _without_effect(t: "OpRows", found: dict, overflowed: Set[str] = frozenset()) -> Set[str]:
    """The ops among origins, carried ops and propagators whose divergence reaches no sink
    (see Without effect in the module doc); each such op's absorbed_by names the readers
    that matched. Ops are walked in reverse execution order, so a reader is decided before
    what it reads. A reader that could not be compared (no output row, a file missing)
    counts as an effect, as does one whose golden output holds nan/inf (its pass covers the
    finite elements only): a finding is never lost to what the compare did not see."""
    divs = {d.op_name: d for kind in ("origin", "carried", "propagator") for d in found[kind]}
    if not divs:
        return set()
    # golden tensor -> [(reader op, the row it reads it by, whether that row is its own: a
    # call's backward reads what its forward saved by the forward's rows)]
    readers: dict = {}
    matched: dict = {}                  # op -> every output row compared and passing
    for i, out in enumerate(t.is_out):
        if out:
            matched[t.op_name[i]] = matched.get(t.op_name[i], True) and \
                t.verdict[i] == PASS and not t.golden_nonfinite[i]
        else:
            readers.setdefault(t.golden_tensor[i], []).append((t.op_name[i], i, True))
    for name in t.rows_by_op:
        for j in t.saved(name):
            # (a one-element output's backward needs no value of it: a loss's gradient is 1,
            # whatever the loss; the loss, and what the script reads of a step, stay sinks)
            if t.elements[j] != 1:
                readers.setdefault(t.golden_tensor[j], []).append((name, j, False))
    if not readers:
        return set()
    # nan/inf the golden lacks is always a finding, wherever it stops
    nonfinite = {name for name, pos, _ in t.ops
                 if any(t.is_out[i] and t.verdict[i] == NONFINITE for i in pos)}
    noise = {d.op_name for d in found["cancellation"] + found["gradual"]}
    rows = {name: pos for name, pos, _ in t.ops}
    # what an overflow made diverge, and what descends from it: an update that takes it as
    # its step takes a different step (a divergence that only rounding or state made is
    # left to the value the update writes: a ReLU's mask flipped by fp16 activations steps
    # Adam a little apart in every healthy fp16 run)
    stepped, made = set(), set()
    for name in sorted(divs, key=lambda n: divs[n].order):
        pos = rows[name]
        ins = [t.golden_tensor[i] for i in t.inputs(name, pos) if t.bad[i]]
        if name in overflowed or call_name(name) in overflowed or any(g in made for g in ins):
            stepped.add(name)
            made.update(t.golden_tensor[i] for i in pos if t.is_out[i] and t.bad[i])
    effect: dict = {}
    for name in sorted(divs, key=lambda n: -divs[n].order):
        absorbed, reaches = set(), False
        for i in rows[name]:
            if reaches or not (t.is_out[i] and t.bad[i]):
                continue
            tensor = t.golden_tensor[i]
            seen = [r for r in readers.get(tensor, ()) if r[0] != name] \
                if isinstance(tensor, str) and tensor else ()
            if not seen or name in nonfinite:
                reaches = True          # read by nothing: an output, the loss, an update
            for reader, j, own in seen:
                if own and t.bad[j] and t.flushed_only[j] and _reads_as_step(t, j):
                    reaches = True                # an update takes a step with holes in it
                elif own and t.bad[j] and _reads_as_step(t, j) and reader not in noise and \
                        name in stepped:
                    # an update takes a step an overflow made differ: its change is the
                    # effect, however well the value it writes matches (a step is tiny
                    # beside the weight)
                    reaches = True
                elif reader in divs and t.bad[j]:
                    reaches = effect.get(reader, True)
                elif reader in noise:
                    pass          # it made noise of it (cancellation's own), or gradual error
                elif reader in divs or matched.get(reader, False):
                    absorbed.add(reader)          # what it read, or what it made, matches
                else:
                    reaches = True                # its outputs were not compared
                if reaches:
                    break
        effect[name] = reaches
        if not reaches:
            divs[name].absorbed_by = sorted(absorbed)
    return {name for name, reaches in effect.items() if not reaches}
