"""Pre-training checks (`check`): the common precision problems that are not the NPU — the
data, the hyperparameters, the API, the graph, the initialisation — found from one dumped
step's replay bundle (its graph, variables, feeds and configuration) and a few golden steps
replayed from it, before any long NPU run.

Each check is a registry entry (CHECKS): a name, a category, what it looks at, and a function
of the CheckContext that returns findings, each with a severity (error, warning, info), a
message, its evidence in numbers and the fix. `run_checks` runs them all; `diff_runs` lists
the configuration differences between two runs.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Tuple, Callable, Dict, List, Optional, Sequence

import numpy as np

from ... import numerics
from ...dump import Workspace, load_bundle
from ...dump.layout import DEVICE, REFERENCE
from ...dump.workspace import Run
from ...errors import PrecisionToolError
from ...graph import dtypes, split_tensor_name
from ...ops import registry
from ...runtime import SessionConfig

ERROR, WARNING, INFO = "error", "warning", "info"
CATEGORIES = ("data", "hyperparameter", "api", "graph", "init", "config", "determinism")
LOW = ("float16", "bfloat16")
FP16_MAX = numerics.FP16_MAX
FP16_MIN_NORMAL = 2.0 ** -14
FP16_MIN_SUBNORMAL = 2.0 ** -24
# mixed-precision modes whose gradients run in fp16 and want a loss scale
SCALED_MODES = frozenset({"force_fp16", "allow_mix_precision", "O2", "O3"})


class CheckError(PrecisionToolError, ValueError):
    """Checks that cannot run (no replay bundle in the run...)."""


@dataclass
class Finding:
    check: str
    category: str
    severity: str
    message: str
    evidence: dict = field(default_factory=dict)
    fix: str = ""


@dataclass
class CheckReport:
    run: str
    step: int
    golden_steps: int
    precision_mode: str
    findings: List[Finding] = field(default_factory=list)
    checks: List[str] = field(default_factory=list)     # every check that ran
    notes: List[str] = field(default_factory=list)

    @property
    def errors(self) -> int:
        return sum(f.severity == ERROR for f in self.findings)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["errors"] = self.errors
        return out


class _Tracer:
    """An observer keeping every value of each run (a RunTrace per step)."""

    def __init__(self):
        self.traces = []

    def attach(self, session):
        return self

    def begin_run(self, session, feeds, fetch_tensors, fetch_nodes):
        return True

    def end_run(self, session, trace):
        self.traces.append(trace)

    def abort_run(self, session, error):
        pass


class CheckContext:
    """What the checks look at: the bundle's graph, variables, feeds and configuration, the
    golden steps replayed from it (every value), and where the configured precision policy
    places each op (compiled, never run)."""

    def __init__(self, bundle, config: dict, golden_steps: int, golden_dtype: str = "float32",
                 progress: Optional[Callable[[int, int], None]] = None):
        self.bundle = bundle
        self.graph = bundle.graph
        self.config = config
        self.golden_steps = golden_steps
        self.golden_dtype = golden_dtype
        self.progress = progress        # (steps replayed, of how many) as the golden replays

    @cached_property
    def mode(self) -> str:
        return SessionConfig.from_dict(self.config).effective_mode

    def replay(self, steps: int):
        """(traces, variables before each step and after the last) of `steps` golden steps
        from the bundle, its batch each step."""
        tracer = _Tracer()
        sess = self.bundle.session("cpu", SessionConfig(golden_dtype=self.golden_dtype))
        sess.add_observer(tracer)
        self.bundle.start(sess, exact=False)
        states = [sess.variables()]
        for k in range(steps):
            self.bundle.run_step(sess)
            states.append(sess.variables())
            if self.progress is not None:
                self.progress(k + 1, steps)
        return tracer.traces, states

    @cached_property
    def golden(self):
        return self.replay(self.golden_steps)

    @cached_property
    def compiled(self):
        """The graph as the configured NPU compiles it (never run)."""
        return self.bundle.session("npu", SessionConfig.from_dict(self.config)).compiled

    @cached_property
    def kernels(self) -> Dict[str, Tuple[str, object]]:
        """Original op name -> (the dtype the configured NPU policy computes it in, the
        compiled node of the kernel that runs it): ops a fusion absorbed take their fused
        kernel's."""
        compiled = self.compiled
        out = {}
        for node in self.graph.nodes:
            tensor = compiled.tensor_map.get(f"{node.name}:0")
            kernel = split_tensor_name(tensor)[0] if tensor else compiled.fused_away.get(node.name)
            if kernel is None or kernel not in compiled.graph:
                continue
            kernel = compiled.graph.node(kernel)
            out[node.name] = (kernel.attrs.get("compute_dtype") or
                              (kernel.outputs[0].dtype if kernel.outputs else ""), kernel)
        return out

    def original_input(self, kernel, k: int) -> Optional[str]:
        """The model's tensor a compiled kernel's input k holds (through the Casts and
        TransData the compiler inserted before it), or None."""
        graph = self.compiled.graph
        tensor = kernel.inputs[k] if k < len(kernel.inputs) else None
        while tensor is not None and split_tensor_name(tensor)[0] in graph:
            producer = graph.node(split_tensor_name(tensor)[0])
            if not producer.attrs.get("inserted_by"):
                break
            tensor = producer.inputs[0] if producer.inputs else None
        return tensor if tensor is not None and split_tensor_name(tensor)[0] in self.graph \
            else None

    @cached_property
    def placement(self) -> Dict[str, str]:
        """Original op name -> the dtype the configured NPU policy computes it in."""
        return {name: dtype for name, (dtype, _) in self.kernels.items()}

    @cached_property
    def ran(self) -> set:
        """The ops the step runs (an eval branch built into the same graph does not)."""
        traces, _ = self.golden
        return {n.name for n in traces[0].plan.nodes} if traces else {n.name for n in self.graph.nodes}

    def consumers(self) -> Dict[str, list]:
        users: Dict[str, list] = {}
        for node in self.graph.nodes:
            for k, t in enumerate(node.inputs):
                users.setdefault(split_tensor_name(t)[0], []).append((node, k))
        return users

    @cached_property
    def updates(self) -> list:
        """(update node, variable name, gradient tensor) of every optimizer update."""
        out = []
        for node in self.graph.nodes:
            state = registry.updated_inputs(node.type)
            if state and node.type != "UpdateLossScale" and len(node.inputs) > len(state) \
                    and node.name in self.ran:
                out.append((node, split_tensor_name(node.inputs[0])[0], node.inputs[len(state)]))
        return out

    @cached_property
    def trainable(self) -> List[str]:
        return [n.name for n in self.graph.nodes
                if n.type == "Variable" and n.attrs.get("trainable", True)]


def _const_value(node) -> Optional[np.ndarray]:
    """A Const node's value as float64 (its attrs hold {"dtype", "shape", "data"})."""
    value = node.attrs.get("value")
    try:
        data = value["data"] if isinstance(value, dict) else value
        return np.asarray(data, dtype=np.float64)
    except (TypeError, ValueError, KeyError):
        return None


def _f(x) -> float:
    return float(f"{float(x):.6g}")


# -- the checks -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Check:
    name: str
    category: str
    looks_at: str
    run: Callable[[CheckContext], List[Finding]]


CHECKS: Dict[str, Check] = {}


def check(name: str, category: str, looks_at: str):
    assert category in CATEGORIES, category

    def deco(fn):
        CHECKS[name] = Check(name, category, looks_at, fn)
        return fn
    return deco


def _finding(name: str, severity: str, message: str, evidence: dict, fix: str) -> Finding:
    return Finding(name, CHECKS[name].category, severity, message, evidence, fix)


@check("data.nonfinite", "data", "every float feed: nan and inf")
def _data_nonfinite(ctx: CheckContext) -> List[Finding]:
    return [f for name, v in ctx.bundle.feeds.items() for f in feed_nonfinite(name, v)]


@dataclass(frozen=True)
class FeedFigures:
    """What the feed checks read of a float tensor: its element count, how many are nan/inf,
    and over the finite ones the largest magnitude, the mean and the standard deviation
    (nan without finite elements). Taken from the values, or from a statistics dump's index
    row, whose max, min, mean and L2 norm are over the finite elements too."""
    elements: int
    nonfinite: int
    peak: float
    mean: float
    std: float

    @classmethod
    def of(cls, v) -> Optional["FeedFigures"]:
        """The figures of an array; None where it holds no floats."""
        v = np.asarray(v)
        if dtypes.category(v.dtype) != "float":
            return None
        x = v.astype(np.float64).ravel()
        finite = x[np.isfinite(x)]
        if not finite.size:
            return cls(int(v.size), int(x.size), math.nan, math.nan, math.nan)
        return cls(int(v.size), int(x.size - finite.size), float(np.abs(finite).max()),
                   float(finite.mean()), float(finite.std()))

    @classmethod
    def from_stats(cls, elements: int, stats) -> "FeedFigures":
        """From tensor statistics (kernels.tensor_stats' fields): the variance is the mean
        square (the L2 norm's square over the finite count) less the squared mean, clipped
        at 0 where rounding takes it below."""
        nonfinite = int(sum(stats[k] for k in ("nan_count", "pos_inf_count", "neg_inf_count")))
        finite = elements - nonfinite
        if finite <= 0 or not math.isfinite(stats["max"]):
            return cls(elements, nonfinite, math.nan, math.nan, math.nan)
        mean = float(stats["mean"])
        var = float(stats["l2norm"]) ** 2 / finite - mean * mean
        return cls(elements, nonfinite, max(abs(float(stats["max"])), abs(float(stats["min"]))),
                   mean, math.sqrt(max(var, 0.0)))


def feed_nonfinite(name: str, v) -> List[Finding]:
    """data.nonfinite of one feed (a graph's, or a script's input from outside the step): its
    values or its FeedFigures."""
    f = v if isinstance(v, FeedFigures) else FeedFigures.of(v)
    if f is None or not f.nonfinite:
        return []
    return [_finding("data.nonfinite", ERROR,
                     f"feed {name} holds {f.nonfinite} nan/inf of {f.elements}",
                     {"feed": name, "nonfinite": f.nonfinite, "elements": f.elements},
                     "clean or filter the data before it is fed (a nan input makes every "
                     "result downstream nan)")]


@check("data.label_range", "data",
       "labels fed to a softmax cross-entropy against its classes, and their spread")
def _label_range(ctx: CheckContext) -> List[Finding]:
    """From the feeds and the graph alone (a label out of range stops the step itself)."""
    out = []
    for node in ctx.graph.nodes:
        if node.type != "SparseSoftmaxCrossEntropyWithLogits" or len(node.inputs) < 2:
            continue
        labels = ctx.bundle.feeds.get(node.inputs[1])
        classes = ctx.graph.tensor(node.inputs[0]).shape[-1]
        if labels is None or not np.size(labels):
            continue
        labels = np.asarray(labels)
        lo, hi = int(labels.min()), int(labels.max())
        evidence = {"op": node.name, "label_min": lo, "label_max": hi, "classes": classes,
                    "distinct": int(np.unique(labels).size), "batch": int(labels.size)}
        if classes is not None and (lo < 0 or hi >= classes):
            out.append(_finding("data.label_range", ERROR,
                                f"{node.name}: labels span {lo}..{hi}, the logits have {classes} "
                                f"classes (0..{classes - 1})", evidence,
                                "map the labels to 0..classes-1, or give the output layer as many "
                                "units as there are classes"))
        elif labels.size >= 16 and lo == hi:
            out.append(_finding("data.label_range", WARNING,
                                f"{node.name}: all {labels.size} labels of the batch are {lo}: the "
                                f"data is sorted by class or the shuffling is broken", evidence,
                                "shuffle the training data"))
    return out


@check("data.fp16_range", "data", "float feeds' magnitude against fp16's range")
def _data_range(ctx: CheckContext) -> List[Finding]:
    return [f for name, v in ctx.bundle.feeds.items() for f in feed_range(name, v)]


def feed_range(name: str, v) -> List[Finding]:
    """data.fp16_range of one feed: its values or its FeedFigures."""
    f = v if isinstance(v, FeedFigures) else FeedFigures.of(v)
    if f is None or not f.peak == f.peak:          # no floats, or no finite element
        return []
    peak, mean, std = f.peak, f.mean, f.std
    evidence = {"feed": name, "max_abs": _f(peak), "mean": _f(mean), "std": _f(std)}
    if peak > FP16_MAX:
        return [_finding("data.fp16_range", ERROR,
                         f"feed {name} reaches {peak:.6g}, beyond fp16's 65504: an fp16 op "
                         f"reading it overflows (inf, or 65504 under saturation)",
                         evidence, "normalise or scale the input (e.g. to mean 0, std 1)")]
    if peak > 1e3 or abs(mean) > 10 * max(std, 1e-30) and abs(mean) > 10:
        return [_finding("data.fp16_range", WARNING,
                         f"feed {name} is unnormalised (mean {mean:.4g}, std {std:.4g}, "
                         f"|max| {peak:.4g}): fp16 keeps 11 significant bits, and products "
                         f"of such values leave its range",
                         evidence, "normalise the input (mean 0, std 1)")]
    return []


@check("hyperparameter.epsilon_fp16", "hyperparameter",
       "small constants and epsilons an op computes with in fp16/bf16")
def _epsilon(ctx: CheckContext) -> List[Finding]:
    out = []
    placed = ctx.placement
    users = ctx.consumers()
    for node in ctx.graph.nodes:
        if node.name not in ctx.ran:
            continue
        values = []
        if node.type == "Const":
            value = _const_value(node)
            if value is not None and value.size == 1:
                values = [(float(value.reshape(-1)[0]), False,
                           [u.name for u, _ in users.get(node.name, [])
                            if placed.get(u.name) in LOW and u.name in ctx.ran])]
        elif isinstance(node.attrs.get("epsilon"), (int, float)) and placed.get(node.name) in LOW:
            # a kernel's attribute: what matters is whether fp16 holds it at all
            values = [(float(node.attrs["epsilon"]), True, [node.name])]
        for value, attribute, low_users in values:
            flushes = abs(value) < FP16_MIN_SUBNORMAL / 2
            if not low_users or value == 0 or abs(value) >= FP16_MIN_NORMAL or \
                    attribute and not flushes:
                continue
            out.append(_finding(
                "hyperparameter.epsilon_fp16", ERROR if flushes else WARNING,
                f"{node.name} = {value:.3g} is read in fp16 by {', '.join(low_users[:3])}: "
                + ("it flushes to 0 there" if flushes else "a subnormal there, with few digits"),
                {"op": node.name, "value": value, "fp16_smallest_normal": FP16_MIN_NORMAL,
                 "read_by": low_users[:5]},
                f"use a value fp16 holds (>= {FP16_MIN_NORMAL:.3g}, e.g. 1e-5 for an epsilon), or "
                f"keep {', '.join(sorted({ctx.graph.node(u).type for u in low_users}))} in fp32"))
    return out


@check("hyperparameter.learning_rate", "hyperparameter",
       "each update's learning rate in its variable's dtype, and the first steps' update size")
def _learning_rate(ctx: CheckContext) -> List[Finding]:
    out = []
    for node, var, _ in ctx.updates:
        lr = node.attrs.get("lr")
        dtype = dtypes.canonical(ctx.graph.node(var).outputs[0].dtype)
        if isinstance(lr, (int, float)) and dtype in LOW and 0 < abs(lr) < FP16_MIN_NORMAL:
            out.append(_finding("hyperparameter.learning_rate", ERROR,
                                f"{node.name}: learning rate {lr:.3g} in {dtype} (variable {var}) "
                                f"is below its smallest normal",
                                {"op": node.name, "lr": lr, "dtype": dtype},
                                f"declare {var} float32 (master weights), or scale the rate"))
    _, states = ctx.golden
    return out + update_too_large(ctx.trainable, states, range(len(states)))


def update_too_large(trainable, states: Sequence[dict], steps: Sequence[int]) -> List[Finding]:
    """hyperparameter.learning_rate's update size: a golden step that changes a weight by more
    than its norm. states: each variable's value before each of `steps` (consecutive) and
    after the last."""
    worst = None
    for var in trainable:
        before = np.asarray(states[0][var], np.float64)
        if before.ndim < 2:
            continue
        norm = float(np.linalg.norm(before))
        for k in range(1, len(states)):
            step = float(np.linalg.norm(np.asarray(states[k][var], np.float64) -
                                        np.asarray(states[k - 1][var], np.float64)))
            ratio = step / norm if norm > 0 else (math.inf if step > 0 else 0.0)
            if ratio != ratio:      # nan in the weights: data.nonfinite's, not the rate's
                continue
            if worst is None or ratio > worst[0]:
                worst = (ratio, var, steps[k - 1])
    if worst is None or worst[0] <= 1.0:
        return []
    ratio, var, k = worst
    return [_finding("hyperparameter.learning_rate", ERROR,
                     f"the golden step {k} changes {var} by {ratio:.3g}x its norm: the "
                     f"learning rate is too high for these weights",
                     {"variable": var, "relative_update": _f(ratio), "golden_step": k},
                     "lower the learning rate (or add warm-up)")]


@check("hyperparameter.loss_scale", "hyperparameter",
       "the loss scale against the precision mode and the golden gradients' range")
def _loss_scale(ctx: CheckContext) -> List[Finding]:
    from ...train.loss_scale import loss_scale_variable
    scale_var = loss_scale_variable(ctx.graph)
    if scale_var is None:
        # a step that updates nothing (an inference graph, an imported model) has no
        # gradients to scale
        if ctx.mode in SCALED_MODES and ctx.updates:
            return [_finding("hyperparameter.loss_scale", WARNING,
                             f"{ctx.mode} computes gradients in fp16 and the graph has no loss "
                             f"scale: gradients below 6e-8 flush to zero",
                             {"precision_mode": ctx.mode},
                             "train with loss scaling (LossScaleOptimizer, or Model(..., "
                             "loss_scale_manager=DynamicLossScaleManager()))")]
        return []
    scale = float(np.asarray(ctx.bundle.variables[scale_var]))
    traces, _ = ctx.golden
    if not traces:
        return []
    peak = 0.0
    for _, _, grad in ctx.updates:
        g = np.asarray(traces[0].value(grad), np.float64)
        if g.size:
            peak = max(peak, float(np.nanmax(np.abs(g))))
    dynamic = any(n.type == "UpdateLossScale" and n.attrs.get("dynamic", True) for n in ctx.graph.nodes)
    if peak * scale > FP16_MAX:
        return [_finding("hyperparameter.loss_scale", WARNING if dynamic else ERROR,
                         f"loss scale {scale:g} times the largest golden gradient {peak:.3g} is "
                         f"{peak * scale:.3g}, beyond fp16's 65504: the first steps overflow"
                         + (" and are skipped while the dynamic scale comes down" if dynamic else
                            ", every step (a fixed scale never comes down)"),
                         {"loss_scale": scale, "max_gradient": _f(peak), "dynamic": dynamic},
                         f"start from a scale of at most {2 ** math.floor(math.log2(FP16_MAX / 2 / peak)):g}"
                         if peak > 0 else "lower the loss scale")]
    return []


@check("init.scale", "init", "trainable weights against their layer's fan-in")
def _init(ctx: CheckContext) -> List[Finding]:
    out = []
    # embedding tables are looked up, not multiplied: their scale is a choice (BERT's 0.02)
    tables = {split_tensor_name(n.inputs[0])[0] for n in ctx.graph.nodes if n.type == "Gather"}
    for var in ctx.trainable:
        w = np.asarray(ctx.bundle.variables[var], np.float64)
        if w.ndim < 2 or not w.size:
            continue
        fan_in = int(np.prod(w.shape[1:])) if w.ndim == 4 else int(w.shape[0]) if w.ndim == 2 \
            else int(np.prod(w.shape[:-1]))
        out += weight_scale(var, w, fan_in, var in tables)
    if ctx.bundle.meta.get("session_step", 0):
        for f in out:
            f.message += f" (at step {ctx.bundle.meta['session_step']}, not the initialisation)"
    return out


def weight_scale(var: str, w: np.ndarray, fan_in: int, table: bool) -> List[Finding]:
    """init.scale of one weight: all zero, constant, or (not an embedding table) a std 10x
    off 1/sqrt(fan_in)."""
    out: List[Finding] = []
    std = float(w.std())
    expected = 1.0 / math.sqrt(max(fan_in, 1))
    evidence = {"variable": var, "shape": list(w.shape), "fan_in": fan_in, "std": _f(std),
                "expected_std": _f(expected)}
    if not np.any(w):
        out.append(_finding("init.scale", ERROR, f"{var} is all zero: every unit of the layer "
                            f"gets the same gradient and stays the same", evidence,
                            "initialise it randomly (glorot_uniform, he_normal)"))
    elif std == 0:
        out.append(_finding("init.scale", ERROR, f"{var} is constant ({float(w.flat[0]):.4g}): "
                            f"its units never differ", evidence, "initialise it randomly"))
    elif not table and not expected / 10 <= std <= expected * 10:
        out.append(_finding("init.scale", WARNING,
                            f"{var} has std {std:.3g}, {std / expected:.3g}x the 1/sqrt(fan_in) "
                            f"= {expected:.3g} of its fan-in {fan_in}: activations "
                            + ("grow" if std > expected else "shrink") + " layer by layer",
                            evidence, "use glorot_uniform or he_normal (scaled by the fan-in)"))
    return out


@check("graph.never_updated", "graph", "trainable variables the golden steps leave unchanged")
def _never_updated(ctx: CheckContext) -> List[Finding]:
    _, states = ctx.golden
    updated = {var for _, var, _ in ctx.updates}
    out = []
    for var in ctx.trainable:
        if var not in updated:
            out.append(_finding("graph.never_updated", WARNING,
                                f"{var} is trainable but no optimizer update writes it",
                                {"variable": var}, "pass it to the optimizer, or make it non-trainable"))
        else:
            out += never_changed(var, states)
    return out


def never_changed(var: str, states: Sequence[dict]) -> List[Finding]:
    """graph.never_updated of a variable an update writes: unchanged over the golden steps."""
    if len(states) < 2 or not all(np.array_equal(states[k][var], states[0][var])
                                  for k in range(1, len(states))):
        return []
    return [_finding("graph.never_updated", WARNING,
                     f"{var} does not change over {len(states) - 1} golden step(s): its "
                     f"gradient is zero (not connected to the loss, or a dead ReLU)",
                     {"variable": var, "golden_steps": len(states) - 1},
                     "check that the loss depends on it")]


@check("api.inference_mode", "api", "BatchNorm in inference mode inside a training graph")
def _inference_mode(ctx: CheckContext) -> List[Finding]:
    if not ctx.updates:
        return []
    return [_finding("api.inference_mode", WARNING,
                     f"{n.name} normalises with its moving statistics (is_training=False) in a "
                     f"training step", {"op": n.name},
                     "build the training graph with training=True (its eval graph with False)")
            for n in ctx.graph.nodes if n.type == "BatchNorm" and n.name in ctx.ran
            and not n.attrs.get("is_training", True)]


@check("graph.fp16_range", "graph", "golden values of the ops the policy places in fp16/bf16")
def _fp16_range(ctx: CheckContext) -> List[Finding]:
    placed = ctx.placement
    traces, _ = ctx.golden
    if not traces:
        return []
    out = []
    trace = traces[0]
    for node, outputs in zip(trace.plan.nodes, trace.outputs):
        dtype = placed.get(node.name)
        if dtype != "float16" or node.type in ("Const", "Variable", "Placeholder"):
            continue
        kernel = ctx.kernels[node.name][1]
        if kernel.type in INNER_LIMITS:
            if kernel.name == node.name:        # once per kernel, for the op it stands for
                inner = _inner_overflow(node, kernel, ctx.original_input(kernel, 0), trace)
                if inner is not None:
                    out.append(inner)
            continue
        for k, v in enumerate(outputs):
            v = np.asarray(v)
            if dtypes.category(v.dtype) != "float" or not v.size:
                continue
            a = np.abs(v.astype(np.float64))
            a = a[np.isfinite(a)]
            if not a.size:
                continue
            peak = float(a.max())
            nonzero = a[a > 0]
            tiny = float((nonzero < FP16_MIN_NORMAL).mean()) if nonzero.size else 0.0
            evidence = {"op": node.name, "type": node.type, "output": k, "max_abs": _f(peak),
                        "below_fp16_normal": _f(tiny)}
            if peak > FP16_MAX:
                out.append(_finding("graph.fp16_range", ERROR,
                                    f"{node.name} ({node.type}) reaches {peak:.6g} in the golden run; "
                                    f"the policy computes it in fp16, whose maximum is 65504",
                                    evidence, f"keep {node.type} in fp32 (modify_mixlist black-list), "
                                              f"or scale what feeds it"))
            elif tiny > 0.5 and not node.name.startswith("gradients/"):
                out.append(_finding("graph.fp16_range", WARNING,
                                    f"{node.name} ({node.type}): {tiny:.1%} of its non-zero golden "
                                    f"values are below fp16's smallest normal (6.1e-5)",
                                    evidence, f"keep {node.type} in fp32, or rescale"))
    return out


# fused fp16 kernels whose inner step leaves fp16 on an input their output never shows: the
# kernel type, the largest input magnitude it takes, and what it does with it (ops/fused_ops)
INNER_LIMITS = {"SoftmaxV2": (math.log(FP16_MAX), "takes exp of its input without subtracting "
                                                   "the max (exp leaves fp16 past 11.09)"),
                "LayerNorm": (math.sqrt(FP16_MAX), "squares its input in its one-pass variance "
                                                   "(x*x leaves fp16 past 255.9)")}


def _inner_overflow(node, kernel, tensor: Optional[str], trace) -> Optional[Finding]:
    """An fp16 fused kernel whose golden input (`tensor`, the model's tensor it reads) goes
    beyond what its inner step takes: its output stays in range (a softmax is at most 1, a
    normalised row small), so only the input tells."""
    if tensor is None:
        return None
    bound, what = INNER_LIMITS[kernel.type]
    x = np.abs(np.asarray(trace.value(tensor), np.float64))
    x = x[np.isfinite(x)]
    peak = float(x.max()) if x.size else 0.0
    if peak <= bound:
        return None
    return _finding("graph.fp16_range", ERROR,
                    f"{node.name} ({node.type}) runs in the fused fp16 kernel {kernel.type}, which "
                    f"{what}; its input {tensor} reaches {peak:.6g} in the golden run",
                    {"op": node.name, "type": node.type, "kernel": kernel.type, "input": tensor,
                     "max_abs": _f(peak), "limit": _f(bound)},
                    f"normalise or scale what feeds {node.name}, switch the kernel's fusion pass "
                    f"off, or keep {node.type} in fp32")


@check("determinism", "determinism", "two golden replays of the step, value by value")
def _determinism(ctx: CheckContext) -> List[Finding]:
    (first, *_), _ = ctx.replay(1)
    (second, *_), _ = ctx.replay(1)
    for node, a, b in zip(first.plan.nodes, first.outputs, second.outputs):
        for k, (x, y) in enumerate(zip(a, b)):
            x, y = np.asarray(x), np.asarray(y)
            if x.shape != y.shape or not np.array_equal(x, y, equal_nan=dtypes.category(x.dtype) == "float"):
                diff = float(np.nanmax(np.abs(x.astype(np.float64) - y.astype(np.float64)))) \
                    if x.shape == y.shape else math.nan
                return [_finding("determinism", ERROR,
                                 f"two golden replays of the step differ first at {node.name}:{k} "
                                 f"({node.type}), by up to {diff:.3g}",
                                 {"op": node.name, "output": k, "max_abs_difference": _f(diff)},
                                 "seed every random op (dropout, initialisers) and the data order")]
    return []


# -- running them -----------------------------------------------------------------------------
def run_checks(ws: Workspace, run: Run, step: Optional[int] = None, golden_steps: int = 3,
               precision_mode: Optional[str] = None, only: Sequence[str] = (),
               progress: Optional[Callable[[int, int], None]] = None) -> CheckReport:
    """Every check (or those named in `only`) on the run's bundle of `step` (default: its first
    bundled step). A golden run's bundle carries no NPU configuration: precision_mode says which
    policy the fp16 checks assume (default allow_mix_precision). progress(k, n): told as the
    golden steps replay."""
    bundled = sorted(run.bundles)
    from .script_checks import is_script_run, run_script_checks
    if is_script_run(run):
        return run_script_checks(ws, run, step, precision_mode, only)
    if not bundled:
        raise CheckError(f"{run.label} has no replay bundle: dump a step with action='dump' "
                         f"(or run check -- python train.py)")
    step = bundled[0] if step is None else step
    if step not in bundled:
        raise CheckError(f"step {step} of {run.label} has no replay bundle; bundled steps: {bundled}")
    bundle = load_bundle(ws.bundle_path(run, step))
    config = dict(bundle.meta["config"]) if bundle.meta.get("target") == "npu" else {}
    if precision_mode is not None:
        config.update(precision_mode=precision_mode, amp_level=None, modify_mixlist=None)
    config.setdefault("precision_mode", "allow_mix_precision")
    unknown = [n for n in only if n not in CHECKS]
    if unknown:
        raise CheckError(f"unknown check(s) {unknown}; known: {', '.join(CHECKS)}")
    ctx = CheckContext(bundle, config, golden_steps,
                       run.info.get("golden_dtype", "float32") if run.kind == REFERENCE else "float32",
                       progress)
    report = CheckReport(run.label, step, golden_steps, ctx.mode)
    for name, c in CHECKS.items():
        if only and name not in only:
            continue
        report.checks.append(name)
        report.findings.extend(c.run(ctx))
    order = {ERROR: 0, WARNING: 1, INFO: 2}
    report.findings.sort(key=lambda f: order[f.severity])
    if run.kind == REFERENCE and precision_mode is None:
        report.notes.append("a golden run's bundle has no NPU configuration: the fp16 checks "
                            "assume allow_mix_precision (--precision-mode to choose)")
    return report


# -- config diff ------------------------------------------------------------------------------
@dataclass
class ConfigDiff:
    """What `check --diff` found between two runs (diff_runs' differences)."""
    left: str
    right: str
    differences: List[dict]

    def to_dict(self) -> dict:
        return asdict(self)


def config_diff(ws: Workspace, a: Run, b: Run) -> ConfigDiff:
    return ConfigDiff(a.label, b.label, diff_runs(ws, a, b))


def diff_runs(ws: Workspace, a: Run, b: Run) -> List[dict]:
    """Every configuration difference between two runs: precision mode, amp level, overflow
    mode, mixlists, fusion switches, loss scale, seeds, and per-op compute dtypes (NPU runs),
    each as {"what", "left", "right"}."""
    def facts(run: Run) -> dict:
        info = run.info
        out = {k: info.get(k) for k in ("target", "precision_mode", "amp_level", "overflow_mode",
                                        "mode", "golden_dtype", "seed", "graph")}
        out["fusion passes"] = info.get("fusion_passes")
        bundles = sorted(run.bundles)
        if bundles:
            meta = load_bundle(ws.bundle_path(run, bundles[0])).meta
            cfg = meta.get("config", {})
            out["modify_mixlist"] = json.dumps(cfg.get("modify_mixlist"), sort_keys=True) \
                if cfg.get("modify_mixlist") else None
            out["fusion_switch"] = json.dumps(cfg.get("fusion_switch"), sort_keys=True) \
                if cfg.get("fusion_switch") else None
        history = ws.step_history(run)
        scaled = history.dropna(subset=["loss_scale"]) if "loss_scale" in history else history.iloc[:0]
        out["loss scale (first step)"] = float(scaled.loss_scale.iloc[0]) if len(scaled) else None
        graph = ws.compiled_graph(run) if run.kind == DEVICE else None
        out["_dtypes"] = {n.name: n.attrs["compute_dtype"] for n in (graph or ())
                          if n.attrs.get("compute_dtype")}
        return out

    left, right = facts(a), facts(b)
    diffs = [{"what": k, "left": left.get(k), "right": right.get(k)}
             for k in left if k != "_dtypes" and left.get(k) != right.get(k)]
    ld, rd = left["_dtypes"], right["_dtypes"]
    for name in sorted(set(ld) | set(rd)):
        if ld.get(name) != rd.get(name):
            diffs.append({"what": f"compute dtype of {name}", "left": ld.get(name), "right": rd.get(name)})
    return diffs
