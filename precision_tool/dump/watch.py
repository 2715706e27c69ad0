"""Training watchpoints: conditions tested every step on the statistics the run computes as it
makes its values (the session's STATS_ONLY trace: max, min, mean, L2 norm, nan and inf counts
of every value; no extra pass over the tensors), and on the trainable weights before and
after the step (their update's size).

Conditions (CONDITIONS, each a registry entry with its thresholds in WatchConfig):
gradient vanishing or exploding (the norm of each gradient an optimizer update reads),
weights not changing or changing too much (relative update norm), activations all zero or at
the fp16 maximum, non-finite tensors, a loss that is nan or has not improved for N steps, and
a loss scale stuck at its minimum. Hits are appended to <workspace>/watch/hits.csv (one line
each, written whole); the first hit of each condition in a session is also said in one line
on stderr.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Callable, Dict, List, Optional

import numpy as np

from .. import kernels, numerics
from ..graph import dtypes, split_tensor_name
from ..table import csv_field
from ..ops import registry
from ..runtime.plan import STATS_ONLY
from . import layout

WATCH_DIR = "watch"
HITS_FILE = "hits.csv"
HITS_HEADER = "time,session,step,condition,tensor,value,threshold,message"
# columns of a statistics row (kernels.stats_row)
MAX, MIN, MEAN, NORM, NAN, POS_INF, NEG_INF, SIZE = range(8)


@dataclass(frozen=True)
class WatchConfig:
    """Thresholds (and which conditions to test: `conditions`, default all)."""
    grad_min: float = 1e-10          # a gradient norm under this vanishes (0 included)
    grad_max: float = 1e4            # ...over this explodes
    update_min: float = 0.0          # a weight whose relative update is at most this stands still
    update_max: float = 0.5          # ...over this jumps
    loss_patience: int = 50          # steps without a new best (smoothed) loss
    # a loss that has come down to this fraction of where it started has learned: a plateau
    # there is convergence, not a stall
    loss_progress: float = 0.5
    scale_patience: int = 10         # steps at the loss scale's minimum
    conditions: Optional[frozenset] = None

    def wants(self, name: str) -> bool:
        return self.conditions is None or name in self.conditions


@dataclass
class Hit:
    step: int
    condition: str
    tensor: str
    value: float
    threshold: float
    message: str


@dataclass
class _PlanFacts:
    """What the conditions read of an execution plan, worked out once per plan."""
    gradients: List[tuple]       # (gradient tensor, the variable its update writes)
    activations: List[str]       # forward float outputs (not gradients, updates or sources)
    fp16: List[str]              # tensors an op computes in fp16 (the NPU's)
    tensors: List[str]           # every float output, for the non-finite test
    loss: Optional[str]          # the first fetched float scalar
    scale: Optional[tuple]       # (loss scale variable, its minimum) when the graph scales
    _slots: Dict[str, np.ndarray] = field(default_factory=dict)

    @cached_property
    def updated(self) -> frozenset:
        """The variables the step's optimizer updates write."""
        return frozenset(var for _, var in self.gradients)

    def names(self, kind: str) -> List[str]:
        """The tensors of a kind: gradients, activations, fp16, tensors or loss."""
        if kind == "gradients":
            return [g for g, _ in self.gradients]
        if kind == "loss":
            return [self.loss] if self.loss else []
        return getattr(self, kind)

    def slots(self, trace, kind: str) -> np.ndarray:
        """The rows of a kind's tensors in the run's statistics table, worked out once."""
        if kind not in self._slots:
            self._slots[kind] = np.array([trace.row(n) for n in self.names(kind)], dtype=np.intp)
        return self._slots[kind]


def _facts(plan, fetch_tensors) -> _PlanFacts:
    gradients, activations, fp16, tensors = [], [], [], []
    scale = None
    kinds = {node.name: node.type for node in plan.nodes}
    for node in plan.nodes:
        state = registry.updated_inputs(node.type)
        if node.type == "UpdateLossScale":
            scale = (split_tensor_name(node.inputs[0])[0], float(node.attrs.get("min_scale", 1.0)))
        elif state and len(node.inputs) > len(state):
            gradients.append((node.inputs[len(state)], split_tensor_name(node.inputs[0])[0]))
        if state or node.type in ("Const", "Variable", "Placeholder", "NoOp"):
            continue
        for k, spec in enumerate(node.outputs):
            if not dtypes.is_float(spec.dtype):
                continue
            name = f"{node.name}:{k}"
            tensors.append(name)
            if (node.attrs.get("compute_dtype") or spec.dtype) == "float16":
                fp16.append(name)
            original = (node.attrs.get("original_op_names") or [node.name])[0]
            # an activation is computed from data: not a gradient, not a Cast the compiler
            # put on a weight, not a function of variables and constants alone (a zero bias)
            from_data = any(kinds.get(split_tensor_name(t)[0]) not in ("Variable", "Const")
                            for t in node.inputs)
            if from_data and not node.attrs.get("inserted_by") and \
                    not original.startswith("gradients/") and "loss_scale" not in original:
                activations.append(name)
    loss = next((t for t in fetch_tensors if t in set(tensors)), None)
    return _PlanFacts(gradients, activations, fp16, tensors, loss, scale)


# -- the conditions ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Condition:
    name: str
    doc: str
    test: Callable[["WatchObserver", "_StepView"], List[Hit]]


CONDITIONS: Dict[str, Condition] = {}


def condition(name: str, doc: str):
    def deco(fn):
        CONDITIONS[name] = Condition(name, doc, fn)
        return fn
    return deco


class _StepView:
    """One step's statistics, a row per tensor (kernels.stats_row's 8 numbers), gathered per
    list of _PlanFacts at once; and the weights' updates."""

    def __init__(self, step: int, trace, facts: _PlanFacts, updates: Dict[str, float]):
        self.step, self.trace, self.facts, self.updates = step, trace, facts, updates

    def rows(self, kind: str) -> np.ndarray:
        """The statistics of a kind's tensors (_PlanFacts.names), a row each."""
        names = self.facts.names(kind)
        if not names:
            return np.zeros((0, 8))
        if self.trace.stats is not None:         # one gather from the run's own table
            return self.trace.stats[self.facts.slots(self.trace, kind)]
        out = np.empty((len(names), 8))          # another observer kept the values: from them
        for row, name in zip(out, names):
            kernels.stats_row(np.asarray(self.trace.value(name)), row)
        return out


def _nonfinite_counts(r: np.ndarray) -> np.ndarray:
    return r[:, NAN] + r[:, POS_INF] + r[:, NEG_INF]


# tested first: the first non-finite tensor is where an overflow starts, and the hits of
# one step are listed in this order
@condition("nonfinite", "a tensor holds nan or inf")
def _nonfinite(w, v):
    names = v.facts.tensors
    r = v.rows("tensors")
    bad = np.flatnonzero(_nonfinite_counts(r))
    if not len(bad):
        return []
    i = bad[0]                           # the first in execution order: where it starts
    return [Hit(v.step, "nonfinite", names[i], float(_nonfinite_counts(r[i:i + 1])[0]), 0.0,
                f"{names[i]} holds {int(r[i, NAN])} nan, {int(r[i, POS_INF] + r[i, NEG_INF])} "
                f"inf (the first tensor of the step that does)")]


@condition("gradient_vanishing", "a gradient an update reads has a norm under grad_min")
def _vanishing(w, v):
    grads = v.facts.gradients
    r = v.rows("gradients")
    hit = (_nonfinite_counts(r) == 0) & (r[:, NORM] < w.config.grad_min)
    return [Hit(v.step, "gradient_vanishing", grads[i][0], float(r[i, NORM]), w.config.grad_min,
                f"the gradient of {grads[i][1]} has norm {r[i, NORM]:.3g} (< {w.config.grad_min:g})")
            for i in np.flatnonzero(hit)]


@condition("gradient_exploding", "a gradient's norm over grad_max, or not finite")
def _exploding(w, v):
    grads = v.facts.gradients
    r = v.rows("gradients")
    bad = _nonfinite_counts(r) > 0
    out = []
    for i in np.flatnonzero(bad | (r[:, NORM] > w.config.grad_max)):
        value = math.inf if bad[i] else float(r[i, NORM])
        out.append(Hit(v.step, "gradient_exploding", grads[i][0], value, w.config.grad_max,
                       f"the gradient of {grads[i][1]} has norm {value:.3g} (> {w.config.grad_max:g})"))
    return out


@condition("weights_static", "a weight's relative update at most update_min (it did not move)")
def _static(w, v):
    return [Hit(v.step, "weights_static", var, ratio, w.config.update_min,
                f"{var} did not change in this step (relative update {ratio:.3g})")
            for var, ratio in v.updates.items() if ratio <= w.config.update_min]


@condition("weights_jump", "a weight's relative update over update_max")
def _jump(w, v):
    return [Hit(v.step, "weights_jump", var, ratio, w.config.update_max,
                f"{var} changed by {ratio:.3g} of its norm in one step (> {w.config.update_max:g})")
            for var, ratio in v.updates.items() if ratio > w.config.update_max]


@condition("activation_zero", "a forward activation entirely zero")
def _zero(w, v):
    names = v.facts.activations
    r = v.rows("activations")
    hit = (r[:, SIZE] > 1) & (r[:, MAX] == 0) & (r[:, MIN] == 0) & (r[:, NAN] == 0)
    return [Hit(v.step, "activation_zero", names[i], 0.0, 0.0, f"{names[i]} is all zero")
            for i in np.flatnonzero(hit)]


@condition("activation_fp16_max", "a tensor computed in fp16 reaches 65504 (saturated)")
def _at_max(w, v):
    names = v.facts.fp16
    r = v.rows("fp16")
    peak = np.maximum(np.abs(r[:, MAX]), np.abs(r[:, MIN]))
    hit = (peak >= numerics.FP16_MAX) & np.isfinite(peak)
    return [Hit(v.step, "activation_fp16_max", names[i], float(peak[i]), numerics.FP16_MAX,
                f"{names[i]} reaches {peak[i]:g}: fp16's maximum (saturated)")
            for i in np.flatnonzero(hit)]


@condition("loss_nan", "the loss is nan or inf")
def _loss_nan(w, v):
    loss = w.loss_now
    if loss is not None and not math.isfinite(loss):
        return [Hit(v.step, "loss_nan", v.facts.loss, loss, 0.0, f"the loss is {loss}")]
    return []


@condition("loss_stalled", "the loss has not improved for loss_patience steps while it is "
                           "still above loss_progress of where it started")
def _loss_stalled(w, v):
    """On the loss smoothed over a few steps (a batch's loss is noisy: the best single batch
    of a healthy run is an outlier that the next fifty rarely beat), once per loss_patience
    steps of stall, and only while the loss has not come down to loss_progress of its start
    (a trained model's plateau is convergence)."""
    patience = w.config.loss_patience
    if w.loss_now is None or w.since_best < patience or w.since_best % patience:
        return []
    if w.smooth_loss <= w.config.loss_progress * w.first_loss:
        return []
    return [Hit(v.step, "loss_stalled", v.facts.loss, float(w.since_best), patience,
                f"the loss (smoothed) has not gone below {w.best_loss:.6g} for {w.since_best} "
                f"steps, still {w.smooth_loss / w.first_loss:.3g} of where it started")]


@condition("loss_scale_min", "the loss scale stays at its minimum for scale_patience steps")
def _scale_min(w, v):
    if w.scale_at_min < w.config.scale_patience:
        return []
    var, lowest = v.facts.scale
    return [Hit(v.step, "loss_scale_min", var, lowest, float(w.config.scale_patience),
                f"the loss scale has been at its minimum {lowest:g} for {w.scale_at_min} steps: "
                f"every step overflows whatever the scale (an overflow in the forward pass?)")]


# -- the observer -----------------------------------------------------------------------------
class WatchObserver:
    """Tests the conditions after every run of the session it watches (see the module doc)."""

    def __init__(self, session, config: WatchConfig, root: str, err=None):
        self.session, self.config, self.root = session, config, root
        self.err = err if err is not None else sys.stderr
        self.label = f"{session.target}:{session.graph.name}:{os.getpid()}:{id(session) & 0xffff:x}"
        self.hits: List[Hit] = []
        self.said: set = set()
        self._facts: Dict[int, tuple] = {}
        self._before: Optional[np.ndarray] = None        # the weights before the step, flat
        self._weights: Optional[List[str]] = None
        self._starts = None
        self.best_loss, self.since_best, self.scale_at_min = math.inf, 0, 0
        self.loss_now: Optional[float] = None
        self.first_loss: Optional[float] = None      # the first loss seen (smoothing's start)
        self.smooth_loss = math.nan                   # an exponential moving average of it
        self._trainable = [n.name for n in session.graph.nodes
                           if n.type == "Variable" and n.attrs.get("trainable", True)]

    def begin_run(self, session, feeds, fetch_tensors, fetch_nodes):
        self._fetches = fetch_tensors
        self._before = None
        if any(self.config.wants(c) for c in ("weights_static", "weights_jump")):
            # weights (a matrix, a filter): a bias may start at zero, where no ratio means
            # anything. One flat copy of all of them: a step has dozens of small weights, and
            # a numpy call per weight would cost more than the copying
            current = session.variables(copy=False)
            if self._weights is None:
                self._weights = [v for v in self._trainable
                                 if v in current and np.ndim(current[v]) >= 2]
                sizes = [np.size(current[v]) for v in self._weights]
                self._starts = np.cumsum([0] + sizes[:-1]).astype(np.intp)
            if self._weights:
                self._before = np.concatenate([current[v].ravel() for v in self._weights])
        return STATS_ONLY

    def end_run(self, session, trace):
        cached = self._facts.get(id(trace.plan))
        if cached is None or cached[0] is not trace.plan:
            cached = self._facts[id(trace.plan)] = (trace.plan, _facts(trace.plan, self._fetches))
        facts = cached[1]
        updates = {}
        if self._before is not None:
            after = session.variables(copy=False)
            delta = np.concatenate([after[v].ravel() for v in self._weights])
            np.subtract(delta, self._before, out=delta)
            # in the weights' own dtype: a ratio against a threshold needs no more
            steps = np.sqrt(np.add.reduceat(delta * delta, self._starts))
            norms = np.sqrt(np.add.reduceat(self._before * self._before, self._starts))
            with np.errstate(divide="ignore", invalid="ignore"):
                ratios = np.where(norms > 0, steps / norms, np.where(steps > 0, np.inf, 0.0))
            updates = {v: float(r) for v, r in zip(self._weights, ratios.tolist()) if v in facts.updated}
        view = _StepView(session.step, trace, facts, updates)
        self._track(view, facts)
        for name, c in CONDITIONS.items():
            if self.config.wants(name):
                for hit in c.test(self, view):
                    self._record(hit)

    def abort_run(self, session, error):
        self._before = None

    def _track(self, view, facts):
        self.loss_now = None
        if facts.loss is not None:
            r = view.rows("loss")[0]
            loss = float(r[MAX]) if r[NAN] + r[POS_INF] + r[NEG_INF] == 0 else math.nan
            self.loss_now = loss
            if self.first_loss is None or not math.isfinite(self.smooth_loss):
                self.first_loss = self.smooth_loss = loss
            else:
                window = max(1, min(self.config.loss_patience // 5, 10))
                self.smooth_loss += 2.0 / (window + 1) * (loss - self.smooth_loss)
            if self.smooth_loss < self.best_loss * (1 - 1e-4) or self.best_loss == math.inf:
                self.best_loss, self.since_best = self.smooth_loss, 0
            else:
                self.since_best += 1
        if facts.scale is not None:
            var, lowest = facts.scale
            value = float(np.asarray(self.session.variables(copy=False)[var]))
            self.scale_at_min = self.scale_at_min + 1 if value <= lowest else 0

    def _record(self, hit: Hit):
        self.hits.append(hit)
        path = os.path.join(self.root, WATCH_DIR, HITS_FILE)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        line = ",".join([time.strftime("%Y-%m-%dT%H:%M:%S"), self.label, str(hit.step),
                         hit.condition, _csv(hit.tensor), repr(float(hit.value)),
                         repr(float(hit.threshold)), _csv(hit.message)]) + "\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size == 0:
                line = HITS_HEADER + "\n" + line
            os.write(fd, line.encode("utf-8"))      # one write: whole lines, never torn
        finally:
            os.close(fd)
        if hit.condition not in self.said:
            self.said.add(hit.condition)
            print(f"watchpoint {hit.condition} at step {hit.step}: {hit.message}", file=self.err)


def _csv(text: str) -> str:
    """A hit's text as a field of one line of hits.csv."""
    return csv_field(str(text).replace("\r", " ").replace("\n", " "))


@dataclass
class WatchHook:
    """A SessionConfig observer factory: `attach(session)` starts watching it."""
    config: WatchConfig = field(default_factory=WatchConfig)
    root: str = layout.DEFAULT_ROOT

    def attach(self, session):
        return WatchObserver(session, self.config, self.root)


def read_hits(root: str) -> List[dict]:
    """The hits recorded in the workspace, in the order they were written; a line cut off
    (a process killed mid-write of another file) or malformed is skipped."""
    import csv
    path = os.path.join(root, WATCH_DIR, HITS_FILE)
    if not os.path.isfile(path):
        return []
    out = []
    with open(path, encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            try:
                row["step"] = int(row["step"])
                row["value"], row["threshold"] = float(row["value"]), float(row["threshold"])
            except (TypeError, ValueError, KeyError):
                continue
            if row.get("message") is not None:
                out.append(row)
    return out


@dataclass
class WatchHits:
    """What `wp` shows: how many hits were recorded, and those shown: each condition's first
    per session (with how many followed), or every hit in order; at most `limit` (0: all)."""
    hits: int
    shown: List[dict]

    def to_dict(self) -> dict:
        return asdict(self)


def watch_hits(root: str, every: bool = False, limit: int = 0) -> WatchHits:
    hits = read_hits(root)
    shown = hits if every else first_hits(hits)
    return WatchHits(len(hits), shown[:limit] if limit else shown)


def first_hits(hits: List[dict]) -> List[dict]:
    """Per condition and session, its first hit with how many there were, the earliest step
    first."""
    firsts: Dict[tuple, dict] = {}
    for h in hits:
        key = (h["condition"], h["session"])
        if key not in firsts:
            firsts[key] = dict(h, count=0, last_step=h["step"])
        firsts[key]["count"] += 1
        firsts[key]["last_step"] = max(firsts[key]["last_step"], h["step"])
    return sorted(firsts.values(), key=lambda h: (h["step"], h["time"]))
