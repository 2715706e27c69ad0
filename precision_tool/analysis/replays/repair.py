"""Precision repair (`fix`): the smallest configuration change that makes a dumped step match
its golden, found by replaying the step from its bundle, proven over several steps, written
in Ascend's formats.

Candidates, cheapest first: a fusion pass switched off (each pass that fired), the loss scale
(where the graph has one: the largest power of two whose step does not overflow, halved for
room), an op type kept in fp32 (every type the precision policy placed in fp16/bf16, the ones
the root cause names first), and last the precision mode that keeps everything in fp32. An op
type goes to fp32 through a modify_mixlist black-list where the precision mode reads one;
under a mode that reads none, the change carries the mode that does (force_fp16 ->
allow_mix_precision, O2/O3 -> O1), which the fix then reports. Optimizer state is not a
candidate: updates compute in their variables' dtype (fp32) under every mode here.

The goal is checked on a replay of the step from its bundle (no dump): the step's fetched
outputs and each variable's update (new value less old) against the golden replay of the
same bundle, judged by vc's criteria, and no overflow (the status word) — or, with a loss
tolerance, the fetched loss within it and no overflow. The search takes the shortest passing
prefix of the cheapest-first list (bisection over its length), minimises it by delta
debugging (QuickXplain's halving: O(k log(n/k)) replays for k culprits among n candidates)
and checks that dropping any one change breaks the fix (1-minimal); then every single
candidate cheaper than that fix (fix_cost) is replayed alone, and the cheapest that passes is
the fix. Those last replays are independent and run together on a process pool.

The proof reruns N steps from the bundle (its batch every step: the bundle holds one) on the
simulated NPU with the fix and on the golden executor, both from the bundle's variables, and
compares the loss step by step: a fix that holds at the dumped step and drifts later is not a
fix.
"""
from __future__ import annotations

import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import multiprocessing
import numpy as np

from ...dump import Workspace, load_bundle
from ...dump.workspace import Run, WorkspaceError
from ...errors import PrecisionToolError
from ...fileio import jsonable, write_text_atomic
from ...graph import dtypes, split_tensor_name
from ...ops import registry
from ...runtime import Session, SessionConfig
from ...runtime.npu import cost
from ..comparing.engine import ignore_interrupts
from ..comparing.mapping import placed_types
# Change, StepReplay and configure are this module's vocabulary too (fix's callers use them)
from ...runtime.npu.policy import all_fp32_mode
from .step_replay import LOW, Change, Outcome, StepReplay, configure, first_scalar  # noqa: F401
from ..comparing.verdicts import Criteria

CONFIG_DIR = "config"


class RepairError(PrecisionToolError, ValueError):
    """A repair that cannot start (no replay bundle for the step, no golden run...)."""


@dataclass
class Proof:
    """The loss curves of N steps from the bundle: golden, with the fix, without it."""
    steps: int
    rtol: float
    golden: List[float]
    fixed: List[float]
    unfixed: List[float]
    fixed_overflow_steps: List[int]
    drift_step: Optional[int]        # the first step the fixed loss leaves the tolerance
    # the first step whose golden loss is not finite: the training itself diverges there
    # (a learning rate too high...), and nothing after it can be judged
    golden_nonfinite_step: Optional[int] = None
    # the step updates no variable (an imported inference model): no later step differs from
    # it, so the replays of the step are the whole proof
    stateless: bool = False

    @property
    def holds(self) -> bool:
        return self.drift_step is None and self.golden_nonfinite_step is None


@dataclass
class Repair:
    npu_run: str
    golden_run: str
    step: int
    goal: str
    candidates: List[Change]
    before: Outcome
    fix: Optional[List[Change]] = None        # None: none found within the budget
    after: Optional[Outcome] = None
    minimal: bool = False                     # 1-minimal: dropping any element breaks it
    replays: int = 0
    budget: int = 0
    proof: Optional[Proof] = None
    config: dict = field(default_factory=dict)        # what to train with (SessionConfig fields)
    moved_to_fp32: List[str] = field(default_factory=list)   # kernels the fix moves to fp32
    kernels: Tuple[int, int] = (0, 0)                 # compiled kernels before, after
    # modelled step time before and after, seconds (runtime.npu.cost: a model, for the ratio)
    step_time: Tuple[float, float] = (0.0, 0.0)
    files: List[str] = field(default_factory=list)    # what was written
    # why the fix's files could not be written (a read-only results directory, a full
    # disk), None when they were or none was to be: the fix is then only in this result
    unsaved: Optional[str] = None
    contents: Dict[str, str] = field(default_factory=dict)   # file name -> its text
    notes: List[str] = field(default_factory=list)
    # the dumped step's compare, judged as ac -c judges it, finds nothing: no search, no proof
    healthy: bool = False

    @property
    def mode(self) -> str:
        """The precision mode (or amp level) the fix trains with."""
        return SessionConfig.from_dict(self.config).effective_mode

    @property
    def needed(self) -> bool:
        return not self.healthy and not self.before.passed

    @property
    def verified(self) -> bool:
        """A fix (or none needed) that the proof over steps confirms, or a step whose dump the
        compare finds healthy (the dump itself is the evidence)."""
        return self.fix is not None and (self.healthy or
                                         self.proof is not None and self.proof.holds)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(needed=self.needed, verified=self.verified,
                   fix=None if self.fix is None else [c.describe() for c in self.fix],
                   candidates=[c.describe() for c in self.candidates])
        return out


# -- candidates -------------------------------------------------------------------------------
def low_precision_types(sess: Session) -> List[str]:
    """The op types the precision policy placed in fp16/bf16 in this compiled step, in
    execution order: never a Cast the compiler inserted or an update."""
    seen: Dict[str, None] = {}
    for node in sess.compiled.graph.topological_order():
        a = node.attrs
        if a.get("compute_dtype") not in LOW or a.get("inserted_by") or \
                registry.updated_inputs(node.type):
            continue
        for t in placed_types(node.type, a):
            if t not in ("Cast", "Const", "Variable", "Placeholder"):
                seen.setdefault(t, None)
    return list(seen)


@dataclass
class DumpedStep:
    """What the compare of the dumped step tells the search, judged as ac -c judges it:
    whether it has a finding at all; the op types a policy placed for the ops the root cause
    names (origins, then the ops they propagate to, in execution order), tried first among
    the fp32 candidates; the variables whose update is no finding there (written by an
    update that is noise or without effect: left out of the goal, as ac leaves them out);
    and what the compare could not read, if anything."""
    findings: bool
    overflowed: bool               # the step overflowed (with or without effect)
    leads: List[str]
    quiet: List[str]
    missed: Optional[str]


def dumped_step(ws: Workspace, npu_run: Run, golden_run: Run, step: int,
                criteria: Criteria) -> DumpedStep:
    from ..autocheck import judge_step
    from ..comparing.mapping import TensorMap
    c = judge_step(ws, npu_run, golden_run, step, criteria)
    tmap = TensorMap(ws.compiled_graph(npu_run))
    types: Dict[str, None] = {}
    for d in c.cause.origins + c.cause.propagators:
        for t in placed_types(d.op_type, tmap.attrs(d.op_name)):
            types.setdefault(t, None)
    return DumpedStep(c.any_findings, bool(c.tasks), list(types), c.quiet_variables,
                      None if c.coverage.complete else c.coverage.text())


def candidate_changes(replay: StepReplay, leads: Sequence[str] = (),
                      scale_search: Callable[[], Optional[float]] = None) -> List[Change]:
    """Every candidate, cheapest first (see the module doc); `leads`: op types the root cause
    names, tried before the other fp32 candidates."""
    base_sess = replay.session(configure(replay.base, ()))
    out = [Change("fusion", p) for p, counts in sorted(base_sess.compiled.fusion.items())
           if counts.effect_times]
    scale = scale_search() if scale_search else None
    if scale is not None:
        out.append(Change("loss_scale", "loss_scale", scale))
    types = low_precision_types(base_sess)
    ordered = [t for t in leads if t in types] + [t for t in types if t not in leads]
    out += [Change("fp32", t) for t in ordered]
    mode = SessionConfig.from_dict(replay.base).effective_mode
    everything = all_fp32_mode(mode)
    if types and mode != everything:
        out.append(Change("mode", everything))
    return out


def search_loss_scale(replay: StepReplay, highest: int = 32) -> Optional[float]:
    """The largest power of two 2**e (e in 0..highest) under which the step does not
    overflow, found by bisection (overflow grows with the scale), halved for room; None when
    the graph has no loss scale, when every scale overflows, or when it is the scale in use."""
    if replay.scale_variable is None:
        return None
    current = float(np.asarray(replay.bundle.variables[replay.scale_variable]))

    def clean(e: int) -> bool:
        return not replay.run([Change("loss_scale", "loss_scale", 2.0 ** e)]).overflow

    if not clean(0):
        return None
    lo, hi = 0, highest + 1           # clean(lo); hi is past the range or overflows
    if clean(highest):
        lo = highest
    else:
        hi = highest
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if clean(mid) else (lo, mid)
    scale = 2.0 ** max(lo - 1, 0)
    return None if scale == current else scale


# -- delta debugging ---------------------------------------------------------------------------
def shortest_prefix(items: List[Change], test: Callable[[List[List[Change]]], List[bool]]) -> List[Change]:
    """The shortest prefix of `items` (which pass as a whole) that passes, by bisection over
    its length: adding changes rarely breaks a fix, and where it does the longer prefix
    found still passes."""
    lo, hi = 0, len(items)                 # items[:lo] fails (the step as it ran), items[:hi] passes
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if test([items[:mid]])[0] else (mid, hi)
    return items[:hi]


# -- minimising ---------------------------------------------------------------------------------
class BudgetSpent(Exception):
    """No replay left."""


def minimize(items: List[Change], test: Callable[[List[List[Change]]], List[bool]]) -> List[Change]:
    """A minimal passing subset of `items` (which pass as a whole; the empty set fails), by
    delta debugging in QuickXplain's form: halve the set, keep one half whole while the other
    is minimised, then minimise the first against what the second needs. For k culprits
    among n candidates it takes O(k log(n/k)) replays when adding a change never breaks a
    fix; `one_minimal` checks the result either way."""
    def one(subset):
        return test([subset])[0]

    def qx(background: List[Change], added: bool, rest: List[Change]) -> List[Change]:
        if added and one(background):
            return []
        if len(rest) == 1:
            return rest
        half = len(rest) // 2
        first, second = rest[:half], rest[half:]
        need_second = qx(background + first, bool(first), second)
        need_first = qx(background + need_second, bool(need_second), first)
        return need_first + need_second

    return qx([], False, list(items))


def cheaper_singles(fix: List[Change], cands: Sequence[Change], cost: Callable[[List[Change]], tuple],
                    test: Callable[[List[List[Change]]], List[bool]]) -> List[Change]:
    """The candidates that pass on their own and cost less than `fix`, cheapest first: the
    search's order (the root cause's types first) decides which passing set it meets first,
    so a fix 1-minimal in itself (every MatMul in fp32) can still cost more than one other
    change that alone suffices (the activation that overflows). Only candidates cheaper than
    the fix are replayed, together."""
    if not fix:
        return []
    budget = cost(fix)
    priced = sorted(((cost([c]), i) for i, c in enumerate(cands) if c not in fix),
                    key=lambda t: t[0])
    cheaper = [cands[i] for price, i in priced if price < budget]
    if not cheaper:
        return []
    return [c for c, ok in zip(cheaper, test([[c] for c in cheaper])) if ok]


def step_cost(replay: "StepReplay", changes: Sequence[Change]) -> float:
    """The modelled step time (runtime.npu.cost) of the step's graph compiled with `changes`."""
    sess = replay.session(configure(replay.base, changes))
    return cost.step_seconds(sess.compiled.graph, _open_dim(replay))


# what a kind of change gives up, in the candidates' order: a pass or a loss scale costs no
# precision, an op type some, the mode that keeps everything in fp32 the most
KIND_COST = {"fusion": 0, "loss_scale": 0, "fp32": 1, "mode": 2}


def fix_cost(replay: "StepReplay", changes: Sequence[Change]) -> Tuple[int, int, float]:
    """What a set of changes costs, to choose between fixes: its dearest kind of change
    (KIND_COST), then the fp16/bf16 kernels it gives up (counted, not named: a pass switched
    off renames what it fused; casts aside), then the modelled step time (last: on a small
    graph all-fp32 can model faster, its casts gone)."""
    def low(cfg):
        return sum(1 for n in replay.session(cfg).compiled.graph.nodes
                   if n.attrs.get("compute_dtype") in LOW and n.type != "Cast")
    lost = low(configure(replay.base, ())) - low(configure(replay.base, changes))
    kind = max((KIND_COST[c.kind] for c in changes), default=0)
    return kind, max(lost, 0), step_cost(replay, changes)


def _moved_to_fp32(replay: "StepReplay", changes: Sequence[Change]) -> List[str]:
    before = replay.session(configure(replay.base, ()))
    after = replay.session(configure(replay.base, changes))
    was = {n.name: n.attrs.get("compute_dtype") for n in before.compiled.graph.nodes}
    return sorted(n.name for n in after.compiled.graph.nodes
                  if n.attrs.get("compute_dtype") == "float32" and was.get(n.name) in LOW)


def _open_dim(replay: "StepReplay") -> Optional[int]:
    """The dimension a graph leaves open (the batch), as the bundle's feeds fix it."""
    feeds = [v for v in replay.bundle.feeds.values() if np.ndim(v)]
    return feeds[0].shape[0] if feeds else None


def one_minimal(fix: List[Change], test: Callable[[List[List[Change]]], List[bool]]) -> bool:
    """Whether dropping any single change breaks the fix: one independent replay per change,
    run together."""
    if len(fix) <= 1:
        return True                    # the empty set fails: the step as it ran does
    return not any(test([[c for c in fix if c != drop] for drop in fix]))


# -- the proof --------------------------------------------------------------------------------
def loss_curve(replay: StepReplay, target: str, changes: Sequence[Change], steps: int):
    """(losses, steps that overflowed, the dtype the loss was computed in) of `steps`
    training steps from the bundle, its batch every step."""
    meta = replay.bundle.meta
    sess = replay.bundle.session(target, replay.golden_config if target == "cpu"
                                 else SessionConfig.from_dict(configure(replay.base, changes)))
    replay.bundle.start(sess, replay._variables(changes))
    losses, overflows, loss_dtype = [], [], "float64"
    try:
        for k in range(steps):
            loss = first_scalar(replay.bundle.run_step(sess))
            losses.append(math.nan if loss is None else float(loss.reshape(-1)[0]))
            if loss is not None and target == "npu":
                loss_dtype = _computed_dtype(sess, meta["fetch_tensors"], loss.dtype)
            if sess.float_status():
                overflows.append(k)
    finally:
        sess.close()
    return losses, overflows, loss_dtype


class Prover:
    """The proof (module doc) for any set of changes: the golden's and the unfixed run's
    loss curves computed once."""

    def __init__(self, replay: StepReplay, steps: int, rtol: float):
        self.replay, self.steps, self.rtol = replay, steps, rtol
        if not replay.updates_state:
            self.steps, self.golden, self.unfixed = 0, [], []
            return
        self.golden = loss_curve(replay, "cpu", (), steps)[0]
        self.unfixed = loss_curve(replay, "npu", (), steps)[0]

    def announce(self) -> str:
        return (f"proving the fix over {self.steps} steps" if self.replay.updates_state
                else "the step updates no variable: its replays are the proof")

    def __call__(self, fix: Sequence[Change]) -> Proof:
        """The fixed loss drifts at step i when |fixed - golden| > rtol * max(|golden_i|,
        |golden_0| / 100) + the spacing of the loss's dtype there: the floor keeps a loss
        trained near zero from being judged on its last digits."""
        if not self.replay.updates_state:
            return Proof(0, self.rtol, [], [], [], [], None, stateless=True)
        golden = self.golden
        fixed, overflow, loss_dtype = loss_curve(self.replay, "npu", fix, self.steps)
        broken = next((k for k, y in enumerate(golden) if not math.isfinite(y)), None)
        floor = abs(golden[0]) / 100 if golden and math.isfinite(golden[0]) else 0.0
        drift = next((k for k, (x, y) in enumerate(zip(fixed[:broken], golden[:broken]))
                      if not (math.isfinite(x) and abs(x - y) <= self.rtol * max(abs(y), floor)
                              + ulp(y, loss_dtype))), None)
        return Proof(self.steps, self.rtol, golden, fixed, self.unfixed, overflow, drift, broken)


def prove(replay: StepReplay, fix: Sequence[Change], steps: int, rtol: float) -> Proof:
    """N steps from the bundle, golden and NPU with and without the fix (module doc)."""
    return Prover(replay, steps, rtol)(fix)


def _computed_dtype(sess: Session, fetches: Sequence[str], fetched: np.dtype) -> str:
    """The dtype the NPU computed the first fetched float scalar (the loss) in: a fetch is
    handed back in its declared dtype, an fp16 value held in float32."""
    compiled = sess.compiled
    for name in fetches:
        tensor = compiled.tensor_map.get(name)
        if tensor is None:
            continue
        node, k = split_tensor_name(tensor)
        spec = compiled.graph.node(node).outputs[k]
        if math.prod(d or 1 for d in spec.shape) == 1 and dtypes.is_float(spec.dtype):
            return dtypes.canonical(spec.dtype)
    return dtypes.canonical(fetched)


# significand bits and smallest subnormal of the float types a loss may be fetched in
_GRID = {"float16": (10, 2.0 ** -24), "bfloat16": (7, 2.0 ** -133), "float32": (23, 2.0 ** -149)}


def ulp(value: float, dtype: str) -> float:
    """The spacing of `dtype`'s numbers at `value` (0 for float64 and other types): a loss
    fetched in fp16 cannot be nearer the golden's than that (a loss of 2e-6 is subnormal in
    fp16, its spacing 6e-8: 3% of it)."""
    if dtype not in _GRID or not math.isfinite(value):
        return 0.0
    bits, tiny = _GRID[dtype]
    if value == 0:
        return tiny
    return max(2.0 ** (math.floor(math.log2(abs(value))) - bits), tiny)


# -- the whole repair -------------------------------------------------------------------------
# a pool worker's replay and prover: handed over by fork (sessions do not pickle), one per
# process
_WORKER: Dict[str, object] = {}


def _worker_init(replay: StepReplay, prover: "Prover") -> None:
    _WORKER.update(replay=replay, prover=prover)      # inherited by fork: nothing is pickled
    ignore_interrupts()


def _worker_test(task) -> bool:
    proving, changes = task
    return _passes(_WORKER["replay"], _WORKER["prover"], proving, changes)


def repair(ws: Workspace, npu_run: Run, golden_run: Run, step: int, criteria=None,
           loss_rtol: Optional[float] = None, budget: int = 128, proof_steps: int = 20,
           proof_rtol: float = 0.02, workers: int = 1, leads: Optional[Sequence[str]] = None,
           write: bool = True, progress: Callable[[str], None] = lambda _: None) -> Repair:
    """Find, verify and (write=True) write the smallest fix for the step (module doc).
    `leads`: the op types to try in fp32 first (default: those the root cause names)."""
    if step not in npu_run.bundles:
        raise RepairError(f"step {step} of {npu_run.label} has no replay bundle: dump the step "
                          f"with action='dump' to repair it")
    bundle = load_bundle(ws.bundle_path(npu_run, step))
    criteria = Criteria.of(criteria)
    progress("comparing the dumped step with the golden")
    dumped = dumped_step(ws, npu_run, golden_run, step, criteria)
    if not dumped.findings and dumped.missed is None and loss_rtol is None:
        # nothing to repair, as ac -c says: no replay, no search, no proof
        return Repair(npu_run.label, golden_run.label, step,
                      "the dumped step's compare finds nothing with an effect (as ac -c)",
                      [], Outcome(True, dumped.overflowed, float("nan"), []), fix=[], minimal=True, budget=budget,
                      healthy=True, notes=["the dumped step matches its golden: what "
                                           "diverges or overflows in it is noise or without "
                                           "effect (precision-tool ac -c -s %d shows it)" % step])
    progress("replaying the step on the golden executor in float32 and float64")
    replay = StepReplay(bundle, golden_run.info.get("golden_dtype", "float32"), criteria, loss_rtol)
    noise = sorted(replay.noise)
    quiet = sorted(set(dumped.quiet) - replay.noise)
    replay.noise.update(quiet)
    goal = (f"the loss within {loss_rtol:g} (relative) and no overflow" if loss_rtol is not None
            else "every fetched output and variable update within the vc criteria, and no overflow")
    progress("replaying the step as it ran")
    before = replay.run(())
    result = Repair(npu_run.label, golden_run.label, step, goal, [], before, budget=budget)
    if quiet:
        result.notes.append(f"left out of the goal: the updates of {len(quiet)} variable(s) whose "
                            f"divergence in the dumped step is noise or without effect, as ac -c "
                            f"judges it ({', '.join(quiet[:3])}{', ...' if len(quiet) > 3 else ''})")
    if noise:
        result.notes.append(f"left out of the goal: the updates of {len(noise)} variable(s) that "
                            f"the golden cannot pin down: its float32 and float64 replays "
                            f"disagree on them ({', '.join(noise[:3])}"
                            f"{', ...' if len(noise) > 3 else ''})")
    if before.passed:
        result.fix, result.after, result.minimal = [], before, True
    else:
        if leads is None:
            leads = dumped.leads
            if dumped.missed:
                result.notes.append(f"the compare that orders the fp32 candidates is incomplete "
                                    f"({dumped.missed}): their order may be worse; the fix itself "
                                    f"is judged on replays of the bundle, which read no dump file")
        progress("searching the loss scale")
        cands = candidate_changes(replay, leads, lambda: search_loss_scale(replay))
        result.candidates = cands
        if replay.scale_variable is None and any("flushed to zero" in f for f in before.failing):
            result.notes.append("loss scaling is not a candidate: the step's graph has no loss "
                                "scale (build it with LossScaleOptimizer, or Model(..., "
                                "loss_scale_manager=...))")
        progress(f"trying all {len(cands)} candidates together")
        everything = replay.run(cands) if cands else before
        if everything.passed:
            _search(result, replay, cands, budget, workers, progress,
                    Prover(replay, proof_steps, proof_rtol))
        else:
            result.after = everything
            result.notes.append("no fix among the candidates: even all of them together leave "
                                + ("; ".join(everything.failing[:3]) or "an overflow"))
    if result.fix is not None:
        if result.proof is None:
            prover = Prover(replay, proof_steps, proof_rtol)
            progress(prover.announce())
            result.proof = prover(result.fix)
        result.config = _public_config(configure(replay.base, result.fix))
        _cost(result, replay)
    result.replays = replay.replays           # before the report is written with it
    if result.fix is not None and write and result.fix and result.proof.holds:
        try:
            result.files = write_fix(ws, result)
        except (WorkspaceError, OSError) as e:      # the work is done: keep it in the result
            result.unsaved = str(e) if isinstance(e, WorkspaceError) else \
                f"cannot write {e.filename or 'the fix'}: {e.strerror or e}"
    return result


def _search(result: Repair, replay: StepReplay, cands: List[Change], budget: int, workers: int,
            progress: Callable[[str], None], prover: "Prover") -> None:
    """The search (module doc), its test the step alone; when the fix it finds drifts over
    the proof's steps, again with the proof as part of the test (each such test is a replay
    of every step of the proof)."""
    pool = ProcessPoolExecutor(workers, multiprocessing.get_context("fork"),
                               initializer=_worker_init, initargs=(replay, prover)) \
        if workers > 1 else None

    def tester(proving: bool):
        def test(subsets):
            if replay.replays + len(subsets) > budget:
                raise BudgetSpent()
            span = f"-{replay.replays + len(subsets)}" if len(subsets) > 1 else ""
            over = " (each with the proof's steps)" if proving else ""
            progress(f"replay {replay.replays + 1}{span} of at most {budget}{over}: "
                     + "; ".join(_brief(s) for s in subsets))
            tasks = [(proving, s) for s in subsets]
            passed = list(pool.map(_worker_test, tasks)) if pool else \
                [_passes(replay, prover, proving, s) for s in subsets]
            replay.replays += len(subsets) if pool else 0
            return passed
        return test

    fix, singles = None, []
    try:
        for proving in (False, True):
            test = tester(proving)
            if proving:
                if fix is None or result.proof.holds or result.proof.drift_step is None:
                    break
                drift = (f"{'; '.join(c.describe() for c in fix)} makes the step match but "
                         f"drifts at step {result.proof.drift_step} of the proof")
                progress(f"the fix drifts at step {result.proof.drift_step} of the proof: "
                         f"searching again with the proof as the test")
                result.notes.append(f"searched twice: {drift}; the second search tested every "
                                    f"candidate set over the proof's steps")
                if not test([cands])[0]:
                    result.notes.append("no fix among the candidates holds over the proof's "
                                        "steps, not even all of them together")
                    break
            # the shortest passing prefix of the cheapest-first list, then minimised: a fix
            # of cheap changes is found before an expensive one that also works
            fix = minimize(shortest_prefix(cands, test), test)
            result.minimal = one_minimal(fix, test)
            # every single change cheaper than the fix, replayed on its own; the proving
            # round only tries again those that made the step match
            try:
                singles = cheaper_singles(fix, singles if proving else cands,
                                          lambda c: fix_cost(replay, c), test)
            except BudgetSpent:
                singles = []
                result.notes.append(f"the budget of {budget} replays ran out before every "
                                    f"single change cheaper than the fix was tried (-b to "
                                    f"raise it): one of them alone may also suffice")
            if singles:
                result.notes.append(f"{singles[0].describe()} alone also passes and costs "
                                    f"less than {_brief(fix)}, which the search found "
                                    f"first: the fix is that single change")
                fix, result.minimal, singles = singles[:1], True, singles[1:]
            result.fix, result.after = fix, replay.run(fix)
            progress(prover.announce())
            result.proof = prover(fix)
    except BudgetSpent:
        result.notes.append(f"the budget of {budget} replays ran out before a minimal "
                            + ("fix that holds over the proof's steps" if fix else "fix")
                            + " was found (-b to raise it)")
    finally:
        if pool:                  # on Ctrl-C too: replays not started are dropped
            pool.shutdown(cancel_futures=True)


def _passes(replay: StepReplay, prover: "Prover", proving: bool, changes) -> bool:
    """Whether the changes meet the goal at the step (and, proving, over the proof's steps)."""
    if not replay.run(changes).passed:
        return False
    return not proving or prover(changes).holds


def _brief(changes: Sequence[Change]) -> str:
    """A set of changes in a progress line: the first two, and how many more."""
    if not changes:
        return "nothing changed"
    shown = ", ".join(c.describe() for c in changes[:2])
    return shown + (f" and {len(changes) - 2} more" if len(changes) > 2 else "")


def _public_config(cfg: dict) -> dict:
    """The SessionConfig fields a user sets (not the device memory)."""
    keep = ("precision_mode", "amp_level", "modify_mixlist", "fusion_switch", "overflow_mode", "mode")
    return {k: cfg.get(k) for k in keep}


def _cost(result: Repair, replay: StepReplay) -> None:
    """What the fix costs: the kernels it moves to fp32, the compiled kernels and the
    modelled step time before and after."""
    before = replay.session(configure(replay.base, ()))
    after = replay.session(configure(replay.base, result.fix))
    result.moved_to_fp32 = _moved_to_fp32(replay, result.fix)
    count = lambda s: sum(1 for n in s.compiled.graph.nodes   # noqa: E731
                          if n.type not in cost.NOT_KERNELS)
    result.kernels = (count(before), count(after))
    result.step_time = (step_cost(replay, ()), step_cost(replay, result.fix))


def write_fix(ws: Workspace, result: Repair) -> List[str]:
    """config/modify_mixlist.json and config/fusion_switch.cfg (those the fix needs) and
    config/fix.json (the whole fix: mode, loss scale, the report), each written atomically
    where results go. result.contents holds the first two's text before anything is
    written: a fix that cannot be saved is still shown whole."""
    cfg = result.config
    contents = {}
    if any(c.kind == "fp32" for c in result.fix) and cfg.get("modify_mixlist"):
        contents["modify_mixlist.json"] = json.dumps(cfg["modify_mixlist"], indent=2) + "\n"
    if any(c.kind == "fusion" for c in result.fix):
        contents["fusion_switch.cfg"] = json.dumps(cfg["fusion_switch"], indent=2) + "\n"
    result.contents = dict(contents)
    directory = ws.results_dir(CONFIG_DIR)
    files = [os.path.join(directory, name) for name in [*contents, "fix.json"]]
    report = dict(result.to_dict(), files=files)      # the report names every file it wrote
    report["written"] = time.strftime("%Y-%m-%d %H:%M:%S")
    contents["fix.json"] = json.dumps(jsonable(report), indent=1) + "\n"
    for path, text in zip(files, contents.values()):
        write_text_atomic(path, text)
    return files
