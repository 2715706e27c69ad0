"""Auto check (`ac`): one call that runs the fusion summary, the overflow analysis and, on
request, the vector compare with its summary and root cause, and says what to try next.

Without a step it looks at every dumped step in order and reports the first with findings:
the overflow records of each, and with a compare each step dumped in both runs, until one
diverges (a clean verdict needs them all). The chosen step's analysis follows divergence
that came in with the state back to the step that wrote it (analysis.diagnosis.steps), reports
underflow, replays the origin op on its own inputs, and (rank) weighs each candidate
origin by what replacing its output with the golden's does to the step (analysis.replays.impact).

The result is plain data, serialisable to JSON (`to_dict`); `verdict` is "findings", "sound"
or "incomplete" (something that should have been compared was not: never "sound").
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional

import numpy as np
import pandas as pd

from ..dump import Workspace, load_bundle
from ..dump.watch import first_hits, read_hits
from ..dump.workspace import Run, WorkspaceError
from ..errors import PrecisionToolError
from ..graph import split_tensor_name
from ..ops import registry
from .advice import AFTER_SKIPPED_UPDATE, PARTED, Options, advise
from .comparing.compare import vector_compare
from .replays.impact import rank_by_impact
from .diagnosis.scale_history import LossScaleHistory, backoff, is_backward, loss_scale_history
from .comparing.mapping import TensorMap, placed_types
from .diagnosis.overflow import overflow_report
from .replays.op_replay import ReplayOpError, replay_op
from .comparing.result import (SHAPES_DIFFER, Coverage, coverage, first_parting, write_failure,
                               write_result)
from .diagnosis.rootcause import (OpRows, RootCause, call_name, root_cause,
                                  written_variables)
from .replays.script_rerun import golden_from_npu_state, why_no_state_replay
from ..torch.state import missing_state
from .replays.step_replay import StepReplay, check_remedies, quiet_replay
from .diagnosis.drift import loss_gap, state_drift
from .diagnosis.ranks import divergence_origin, look_across_ranks, sibling_ranks
from .diagnosis.steps import StateTrace, check_steps, trace_state
from .diagnosis.updates import UpdateCheck, check_updates
from .comparing.summary import OpSummary, count_findings, summarize
from .comparing.verdicts import ERROR, Criteria

GRADIENT_PREFIX = "gradients/"
FP16_MIN_NORMAL = 2.0 ** -14      # below it fp16 holds subnormals, then zero


@dataclass
class AutoCheck:
    npu_run: str
    golden_run: Optional[str]
    step: int                                      # the step analysed
    precision_mode: str = ""
    overflow_mode: str = ""                        # the NPU run's: saturation or inf_nan
    fusion: Optional[Dict[str, int]] = None        # pass -> fused nodes (None: no record)
    overflows: List[dict] = field(default_factory=list)    # in execution order
    first_overflow: Optional[dict] = None
    # the compare shows the overflows had no effect: every overflowing kernel's outputs were
    # compared, and nothing in the step diverges with an effect (StepCompare.quiet_overflows)
    overflow_without_effect: bool = False
    # the step as a dynamic loss scale backing off (diagnosis.scale_history.backoff, with
    # the first overflow): skipped, the scale lowered, clean steps around it; no finding
    backoff: Optional[dict] = None
    # the steps whose update the golden skipped too (a golden made to follow the NPU's)
    golden_skipped: List[int] = field(default_factory=list)
    # steps after an update the NPU skipped and the golden took, judged against the golden
    # started from the NPU's state (a rerun of the script): those found to match ("steps"),
    # the replay's run label, and the step that diverges there too ("diverges", the step
    # reported, compared with that replay; "unseen_only": it failed only by tensors that
    # compare could not see), if one does
    after_skip_replayed: Optional[dict] = None
    after_skip_not_replayed: str = ""     # why such steps could not be rerun so, if they were not
    loss_scale: Optional[dict] = None              # the run's history (loss_scale_history)
    steps: List[dict] = field(default_factory=list)        # what was looked at, step by step
    # steps of either run that a compare of every step could not look at: interrupted
    # (a killed dump's .N.partial) or dumped in one run only; a clean verdict needs them
    unseen_steps: Dict[str, List[int]] = field(default_factory=dict)
    # without the compare: a golden run the compare could take is in the workspace already
    golden_dumped: bool = False
    criteria: Optional[dict] = None
    coverage: Optional[Coverage] = None            # what the compare of `step` saw
    diverging: List[OpSummary] = field(default_factory=list)   # the ops shown (summarize)
    diverging_count: int = 0                       # every op that diverges, noise aside
    origin: Optional[dict] = None
    origin_replay: Optional[str] = None            # local / inherited / exact
    cancellations: List[str] = field(default_factory=list)   # ops whose divergence is noise
    carried: Optional[dict] = None                 # state that came in diverging (StateTrace)
    # divergence that reaches no output, loss or update: how many ops, the first few with
    # the readers that absorbed it (never a finding)
    no_effect: Optional[dict] = None
    # ops that cross the threshold with what came in just under it, in the steps compared
    # (rootcause's Gradual; never a finding): the steps, the first step's count and first op
    gradual: Optional[dict] = None
    # updates that left elements unchanged where the golden's moved them (UpdateCheck)
    lost_updates: Optional[dict] = None
    # the step's update check whatever it found: how many updates it compared, how many
    # only by statistics, and which it could not read
    update_check: Optional[dict] = None
    underflow: Optional[dict] = None
    # the first tensor whose golden value holds nan/inf (the data or the model: not the NPU)
    golden_nonfinite: Optional[dict] = None
    impact: Optional[dict] = None                  # candidates ranked by what fixing them does
    result_file: Optional[str] = None              # the vector compare's CSV, if written
    unsaved: Optional[str] = None                  # why that CSV could not be written
    # the step has a replay bundle and a golden run: `fix` can search a repair for it
    repairable: bool = False
    front_end: str = ""             # "pytorch" for a script's run (its ops are API calls)
    # a script's kernels the NPU's run computed as torch does (run.json's not_simulated)
    not_simulated: List[str] = field(default_factory=list)
    # the training watchpoints' first hit per condition (dump.watch.first_hits), if watched
    watchpoints: List[dict] = field(default_factory=list)
    # the runs part through the state while the step itself computes as the golden does
    # (a replay from the NPU's own state matches), or the losses part in steps whose
    # compare finds nothing: kind "state" or "loss", the losses side by side (LossGap), the
    # variables furthest from the golden's (StateDrift), the op where it shows first
    drift: Optional[dict] = None
    # what a replay of the step said of each configuration change the advice offers
    # (step_replay.check_remedies: changes, verdict, evidence); empty when not replayed
    remedies: List[dict] = field(default_factory=list)
    advice: List[str] = field(default_factory=list)
    # the ranks of a data-parallel dump: where a nan/inf first appears across them
    # (diagnosis.ranks.RankOrigin), when the run is one rank of several
    ranks: Optional[dict] = None
    # with -c over ranks: each rank's step against its own reference, where the divergence
    # first appears (diagnosis.ranks.divergence_origin)
    ranks_divergence: Optional[dict] = None
    imported: bool = False          # another tool's dump (dump.imports): no script, no graph

    @property
    def complete(self) -> bool:
        """Whether the compare of the step reported saw all of it (unseen_steps aside: what
        another step holds does not undo a finding here; it only withholds a clean verdict)."""
        return self.coverage is None or self.coverage.complete

    @property
    def has_findings(self) -> bool:
        """An overflow, an op that diverges and is not cancellation noise, underflow, state
        that came in diverging, a training watchpoint hit, or nan/inf in the golden that
        reaches the loss, an output or an update (the training itself is broken). A dynamic
        loss scale's back-off (backoff) contains its step's overflow and what diverges
        after it: the update they would reach was skipped."""
        return self.backoff is None and (
            bool(self.overflows) and not self.overflow_without_effect or
            self.diverging_count > 0 and not self.drift_explains) or \
            self.lost_updates is not None or self.drift_matters or \
            self.underflow is not None or bool(self.watchpoints) or \
            self.golden_nonfinite is not None and bool(self.golden_nonfinite.get("reaches")) or \
            self.carried is not None and not self.carried["writers_noise"] or \
            self.ranks is not None and bool(self.ranks["origin"] or self.ranks["received"]
                                            or self.ranks["disagree"])

    @property
    def drift_explains(self) -> bool:
        """Whether what diverges in the step is the state's, proven: replayed from the NPU's
        own state, the step computes as the golden does (drift, kind "state", own [])."""
        return self.drift is not None and self.drift["kind"] == "state" and \
            self.drift["own"] == []

    @property
    def drift_matters(self) -> bool:
        """Drift is a finding by its effect: the losses part beyond rel_error at a step the
        step histories hold; or what is left is the step's own; or it was not replayed, or
        no loss was observed, and nothing shows it changes no output."""
        d = self.drift
        return d is not None and not (self.drift_explains and d["loss"]["steps"] and
                                      d["loss"]["first_off"] is None)

    @property
    def verdict(self) -> str:
        if self.has_findings:
            return "findings"
        return "sound" if self.complete and not self.unseen_steps else "incomplete"

    @property
    def origin_title(self) -> str:
        """What the op where the divergence starts (origin) is called where it is shown: the
        root cause, unless it follows from something before it (a skipped step's overflow;
        nan/inf the golden itself holds there, from the data or the model)."""
        if self.backoff is not None:
            return "Where the divergence starts (after the skipped step's overflow: no finding)"
        g = self.golden_nonfinite
        if g is not None and g.get("at_origin"):
            return ("Where the divergence starts (from the nan/inf the golden holds there: "
                    "the data or the model, not the NPU)")
        return "Root cause"

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["verdict"] = self.verdict
        out["origin_title"] = self.origin_title
        return out


PARTLY_COMPARED = "tensors missing or unreadable, listed under the steps looked at"


def auto_check(ws: Workspace, npu_run: Optional[Run] = None, golden_run: Optional[Run] = None,
               step: Optional[int] = None, compare: bool = False, threshold=None, limit: int = 3,
               write_csv: bool = False, rank: Optional[bool] = None,
               verify: bool = True, workers: int = 1, scheduler=None,
               on_progress=None) -> AutoCheck:
    """With compare=True the vector compare runs too (the chosen step's written to
    temp/vector_compare when write_csv), its summary keeps `limit` ops (all when <= 0).
    threshold: verdicts.Criteria or a cosine threshold. verify: replay the step (from its
    bundle) under each configuration change the advice offers, and say which help; and a
    script's step that starts from drifted state, on the golden from the NPU's state (a
    rerun of the script). on_progress(text): told before such long work."""
    criteria = Criteria.of(threshold)
    npu_run = npu_run or ws.run("npu")
    if compare:
        golden_run = golden_run or ws.default_reference(npu_run)
        steps = check_steps(ws, npu_run, golden_run, step)
        if step is None:
            result_unseen = _unseen_steps(npu_run, golden_run, steps)
    else:
        steps = [ws.resolve_step(npu_run, step)] if step is not None else \
            [ws.resolve_step(npu_run, None)] + npu_run.complete_steps[1:]
    result = AutoCheck(npu_run.label, golden_run.label if golden_run else None, steps[0],
                       npu_run.config.effective_mode, criteria=criteria.to_dict())
    if compare and step is None:
        result.unseen_steps = result_unseen
    if not compare:
        result.golden_dumped = any(r.complete_steps for r in ws.runs("cpu"))
    result.fusion = _fusion(ws, npu_run)
    result.not_simulated = list(npu_run.info.get("not_simulated") or ())
    result.overflow_mode = npu_run.config.overflow_mode
    history = loss_scale_history(ws, npu_run)
    if history.steps:
        result.loss_scale = dataclasses.asdict(history)
    compared: Dict[int, StepCompare] = {}
    reports = {}
    backoffs: Dict[int, dict] = {}
    after_skip: List[int] = []
    # updates the golden skipped too (torch-run --golden-skips-as-npu): no state between them
    golden_skipped = set(loss_scale_history(ws, golden_run).skipped_steps) \
        if compare and golden_run is not None else set()
    result.golden_skipped = sorted(golden_skipped)
    # a script's step whose divergence a replay from the NPU's own state shows to be the
    # state's, while the losses hold at every step: no finding, and the steps after it are
    # looked at too. Such steps are replayed together after the loop, in one rerun of the
    # script (each rerun runs the script from its start: one a step would cost the square
    # of the steps)
    losses_hold = compare and verify and \
        loss_gap(ws, npu_run, golden_run, criteria.rel_error).first_off is None
    state_replays = compare and verify and not why_no_state_replay(npu_run)
    replayable = losses_hold and state_replays
    drifted: List[int] = []                 # steps replayed after the loop, in order
    against_replay = None      # a step after a skip that diverges from the NPU's state too
    from_state: Dict[int, tuple] = {}      # step -> own_from_npu_state's answer, made once
    stop = None                             # the first step with a finding that stands
    for s in steps:
        report = reports[s] = overflow_report(ws, npu_run, s)
        look = {"step": s, "overflowing_tasks": len(report.tasks)}
        findings = bool(report.tasks)
        if compare:
            c = compared[s] = judge_step(ws, npu_run, golden_run, s, criteria, report.tasks,
                                         compared, workers, scheduler)
            look.update(compared="statistics" if c.cause.rows.by_statistics else "tensors",
                        diverging_ops=c.findings, coverage=c.coverage.text(),
                        lost_updates=len(c.updates.lost), gradual_ops=len(c.cause.gradual))
            if set(c.coverage.missing) == {SHAPES_DIFFER}:
                look["parted"] = parted = first_parting(c.table)
                if parted is not None:      # the call's module and line, where written
                    site = ws.call_sites(npu_run, s).get(parted["tensor"].split(":")[0], {})
                    parted.update(module=site.get("module", ""), source=site.get("source", ""))
            findings = c.any_findings
        contained = _backoff(history, s, report, compared.get(s))
        if contained:
            backoffs[s] = look["backoff"] = contained
        elif findings and set(backoffs) - golden_skipped and \
                _state_or_divergence(compared.get(s), report):
            # after an update the scale skipped and the golden took: what only diverges
            # here cannot be told from that difference of state
            contained = look["after_skipped_update"] = True
            if state_replays:           # from the NPU's state, after the loop, as drift is
                drifted.append(s)
            else:
                after_skip.append(s)
        elif findings and losses_hold and starts_drifted(compared[s], npu_run, s):
            if replayable:              # judged after the loop, with the others
                contained = look["drift_replayed"] = True
                drifted.append(s)
            else:                       # (says why not: the step stays a finding)
                from_state[s] = own_from_npu_state(ws, npu_run, golden_run, [s], criteria,
                                                   True, on_progress)[s]
        result.steps.append(look)
        if findings and not contained:
            stop = s
            break
    looks = {look["step"]: look for look in result.steps}
    if drifted:
        from_state.update(own_from_npu_state(ws, npu_run, golden_run, drifted, criteria, True,
                                             on_progress))
        # a step after a skipped update that could not be replayed is not judged at all
        unjudged = [x for x in drifted if from_state[x][0] is None and
                    looks[x].get("after_skipped_update")]
        after_skip += unjudged
        if unjudged:
            result.after_skip_not_replayed = from_state[unjudged[0]][2]
        drifted = [x for x in drifted if x not in unjudged]
        fails = next((x for x in drifted if from_state[x][0] != []), None)
        if fails is not None and looks[fails].get("after_skipped_update"):
            # judged against the replay, not the golden that took the skipped updates
            against_replay = fails
        if fails is not None:       # where ac stops: what it looked at after is left out
            stop, drifted = fails, [x for x in drifted if x < fails]
            result.steps = [look for look in result.steps if look["step"] <= stop]
            result.steps[-1].pop("drift_replayed", None)
            result.steps[-1].pop("after_skipped_update", None)
            for kept in (reports, compared, backoffs, from_state):
                for x in [x for x in kept if x > stop]:
                    del kept[x]
            after_skip = [x for x in after_skip if x < stop]
    # none has: the first whose overflows had no effect, if any
    s = stop if stop is not None else \
        next((x for x in steps if reports[x].tasks), drifted[-1] if drifted else steps[0])
    report = reports[s]
    result.step = s
    result.backoff = backoffs.get(s)
    if after_skip and s not in after_skip:
        result.unseen_steps[AFTER_SKIPPED_UPDATE] = after_skip
    judged = [x for x in drifted if x != s and looks[x].get("after_skipped_update")]
    if against_replay is not None:
        # what it is judged against: the golden from the NPU's state, where what still
        # diverges is the step's own (against the golden as written, the skipped update's
        # difference is in everything)
        golden_run = ws.reopened().resolve_run(from_state[s][1], "cpu")   # (a new run)
        compared[s] = from_state[s][3]
        result.golden_run = golden_run.label
    # (what crosses gradually against a golden whose state differs by a skipped update is
    # no evidence: such steps are judged from the NPU's state, or not at all)
    result.gradual = _gradual({x: c.cause for x, c in compared.items()
                               if x not in judged and x not in after_skip})
    if judged or against_replay is not None:
        by = from_state[judged[0] if judged else s][1]
        own = from_state[against_replay][3] if against_replay is not None else None
        result.after_skip_replayed = {
            "steps": judged, "replayed_by": by, "diverges": against_replay,
            # it failed the replay only by what that compare could not see
            "unseen_only": own is not None and not (own.findings or own.updates.lost)}
        for x in [*judged, *([against_replay] if against_replay is not None else [])]:
            # what the steps box says of it: against the replay, as it was judged
            c = from_state[x][3]
            looks[x].update(against=by, replayed=x in judged, diverging_ops=c.findings,
                            coverage=c.coverage.text(), lost_updates=len(c.updates.lost),
                            gradual_ops=len(c.cause.gradual))
    # a step looked at on the way whose compare left tensors out: no clean verdict over it
    # (the step reported says so through its own coverage)
    # (a step after a skipped update is not judged already: the calls it makes may differ,
    # an optimizer's state made a step later)
    partial = [x for x in compared if x != s and not compared[x].coverage.complete and
               x not in after_skip and x not in judged]
    parted = [x for x in partial if looks[x].get("parted")]
    if parted:
        result.unseen_steps[PARTED] = parted
    partial = [x for x in partial if x not in parted]
    if partial:
        result.unseen_steps[PARTLY_COMPARED] = partial
    # a graph run's step replays from its bundle; a script's run reruns its script
    result.front_end = str(npu_run.info.get("front_end") or "")
    result.imported = bool(npu_run.info.get("source"))
    result.repairable = golden_run is not None and (s in npu_run.bundles or
                                                    bool(npu_run.info.get("script")))
    result.watchpoints = first_hits(read_hits(ws.root))
    siblings = sibling_ranks(ws, npu_run)
    if len(siblings) > 1:
        found = look_across_ranks(ws, siblings)
        if found is not None:
            result.ranks = found.to_dict()
            if found.partial_steps:
                result.unseen_steps["dumped by some ranks only"] = found.partial_steps
    result.overflows = [_task(t) for t in report.tasks]
    result.first_overflow = _task(report.first) if report.first else None
    if report.first is not None:
        inputs = [t for t in result.first_overflow["tensors"] if t["io"] == "input"]
        peak = max(abs(inputs[0]["max"]), abs(inputs[0]["min"])) if inputs else None
        result.first_overflow.update(_facts(report.first.op_name, report.first.op_type,
                                            TensorMap(ws.compiled_graph(npu_run)), peak),
                                     api_call=result.front_end == "pytorch")
        _call_pass(ws, npu_run, steps[0], result.first_overflow)
    replays: Dict[int, Optional[StepReplay]] = {}

    def replay() -> Optional[StepReplay]:
        """The step's replay from its bundle, made once for drift and the advice's checks
        (its golden float32 and float64 replays are most of its cost); None without one."""
        if s not in replays:
            try:
                replays[s] = quiet_replay(load_bundle(ws.bundle_path(npu_run, s)),
                                          golden_run.info.get("golden_dtype", "float32"),
                                          criteria, compared[s].quiet_variables)
            except PrecisionToolError:
                replays[s] = None
        return replays[s]
    if compare:
        _compare_step(ws, compared[s], npu_run, golden_run, s, criteria, limit, rank, result)
        if len(siblings) > 1 and compared[s].has_findings:
            result.ranks_divergence = _ranks_divergence(ws, siblings, npu_run, golden_run, s,
                                                        criteria, compared[s], workers,
                                                        scheduler)
        if against_replay is None:
            _drift(ws, npu_run, golden_run, s, criteria, compared, result, replay,
                   verify, on_progress, from_state.get(s))
        if write_csv:
            try:
                result.result_file = write_result(ws, compared[s].table)
            except (WorkspaceError, OSError) as e:    # the verdict stands; its CSV is lost
                result.unsaved = write_failure(e)
    offered = Options(result)
    result.advice = advise(result, offered)
    if compare and verify and result.repairable and result.has_findings and offered.asked:
        # a bundle that cannot be read checks nothing: every change then says "not verified"
        result.remedies = check_remedies(replay(), offered.asked) if replay() else []
        result.advice = advise(result)
    return result


def _drift(ws, npu_run, golden_run, step, criteria, compared: Dict[int, StepCompare],
           result: AutoCheck, replay, verify: bool = True, on_progress=None,
           from_state: Optional[tuple] = None) -> None:
    """Drift (analysis.diagnosis.drift): a step after the first whose only finding is ops that diverge
    (no overflow, underflow, lost update or state carried in beyond the criteria) is
    replayed from the NPU's own state: what still fails there is the step's own ("own"),
    the rest came with the state; when nothing does, the origin was only where the state's
    difference showed, and goes. Or no finding in any dumped step while the step
    histories' losses part beyond the criteria's rel_error (kind "loss")."""
    gap = loss_gap(ws, npu_run, golden_run, criteria.rel_error)
    tables = {k: c.table for k, c in compared.items()}
    c = compared[step]
    only_diverging = c.findings > 0 and not c.tasks and c.underflow is None and \
        not c.updates.lost and result.carried is None
    if from_state is not None or starts_drifted(c, npu_run, step):
        # the step starts from state that noise or gradual rounding moved beyond the
        # criteria, and no bundle replays it from there (a script's step, another tool's
        # dump): a script's golden reruns to that step and starts it from the NPU's state
        # (torch.state); what fails against that is the step's own. Without it, no op is
        # blamed, and the drift is said as not replayed.
        shows = result.origin["op_name"] if result.origin else None
        own, by, why = (from_state or own_from_npu_state(ws, npu_run, golden_run, [step],
                                                          criteria, verify, on_progress)[step])[:3]
        if not own:
            result.origin = result.origin_replay = result.impact = None
        result.drift = {"kind": "state", "shows_first": shows, "loss": gap.to_dict(),
                        "state": dataclasses.asdict(state_drift(tables, step)), "own": own,
                        "written_at": c.trace.written_at, "replayed_by": by,
                        "not_replayed": why}
        return
    if only_diverging and step > 0 and step in npu_run.bundles:
        if replay() is None:
            return
        own = replay().run(())
        shows = result.origin["op_name"] if result.origin else None
        if own.passed:          # the origin was only where the state's difference showed
            result.origin = result.origin_replay = result.impact = None
        result.drift = {"kind": "state", "shows_first": shows, "loss": gap.to_dict(),
                        "state": dataclasses.asdict(state_drift(tables, step)),
                        "own": [] if own.passed else own.failing[:5]}
        return
    skipped = set((result.loss_scale or {}).get("skipped_steps", [])) - \
        set(result.golden_skipped)
    if not result.has_findings and gap.first_off is not None and \
            not any(x < gap.first_off for x in skipped):
        # (losses that part after an update the NPU's loss scale skipped and the golden
        # took: that update is the difference, said where the steps after it are)
        last = max(tables)
        result.drift = {"kind": "loss", "shows_first": None, "loss": gap.to_dict(),
                        "state": dataclasses.asdict(state_drift(tables, last)), "own": [],
                        "compared": sorted(tables),
                        "by_statistics": any(c.cause.rows is not None and
                                             c.cause.rows.by_statistics
                                             for c in compared.values())}


def starts_drifted(c: StepCompare, npu_run: Run, step: int) -> bool:
    """Whether a step's only findings are ops that diverge, in a step that starts from
    state beyond the criteria which its writers put there without a finding (noise,
    gradual rounding), and no bundle replays it (a script's step, another tool's dump)."""
    return c.findings > 0 and not c.tasks and c.underflow is None and not c.updates.lost \
        and c.trace is not None and c.trace.writers_noise and step not in npu_run.bundles


def own_from_npu_state(ws, npu_run, golden_run, steps, criteria, verify=True,
                       on_progress=None) -> Dict[int, tuple]:
    """Each step of `steps` -> (what of it still fails against the golden started from the
    NPU's state: [] when nothing, None when not replayed; the replay's run label; why not
    replayed; the step judged against the replay, a StepCompare, or None). One replay run
    holds them all."""
    if not verify:
        return {k: (None, None, "not asked for (--no-verify)", None) for k in steps}
    if npu_run.info.get("front_end") != "pytorch" or npu_run.info.get("source"):
        return {k: (None, None, "no replay bundle, and no script to rerun", None)
                for k in steps}
    # a step whose state cannot be read is left out of the rerun, not every step with it
    out = {k: (None, None, why, None) for k in steps
           for why in [missing_state(ws, npu_run, k)] if why}
    steps = [k for k in steps if k not in out]
    made, why = golden_from_npu_state(ws, npu_run, golden_run, steps, on_progress) \
        if steps else (None, "")
    for k in steps:
        if made is None:
            out[k] = (None, None, why, None)
        else:
            judged = judge_step(ws, npu_run, made, k, criteria)
            out[k] = (_still_failing(judged), made.label, "", judged)
    return out


def _still_failing(own: StepCompare) -> list:
    """What of a step judged against its replay from the NPU's state still fails (the first
    five, by name; [] when nothing, and everything was compared)."""
    if not (own.findings or own.updates.lost):
        # what the compare against the replay left out is not known to match
        return [] if own.coverage.complete else [f"not compared: {own.coverage.text()}"]
    cause = own.cause
    failing = [d.op_name for d in cause.origins + cause.propagators + cause.carried] + \
        [u.variable for u in own.updates.lost]
    return (failing or [f"{own.findings} diverging op(s)"])[:5]


def _backoff(history: LossScaleHistory, step: int, report, c: Optional[StepCompare]):
    """The step as a dynamic loss scale's back-off (scale_history.backoff) whose findings
    all follow from it: every kernel that overflowed is in the backward, and so is where
    the divergence starts (the forward matched). Its update was skipped, so what the
    backward's overflow changed reaches nothing; else None."""
    found = backoff(history, step)
    if found is None or not report.tasks or \
            not all(is_backward(t.op_name) for t in report.tasks):
        return None
    origin = c.cause.first_origin if c is not None else None
    if origin is not None and not is_backward(origin.op_name):
        return None
    return dict(found, first=report.tasks[0].op_name)


def _state_or_divergence(c: Optional[StepCompare], report) -> bool:
    """Whether a step's only findings are ops that diverge or state that came in diverging
    (no overflow, underflow or lost update): what a difference of state can make."""
    return c is not None and (c.findings > 0 or bool(c.cause.carried)) and \
        not report.tasks and c.underflow is None and not c.updates.lost


def _unseen_steps(npu_run: Run, golden_run: Run, compared: List[int]) -> Dict[str, List[int]]:
    """What each run dumped, or began to, that a compare of every step leaves out, by why."""
    out: Dict[str, List[int]] = {}
    for run in (npu_run, golden_run):
        if run.interrupted:
            out[f"interrupted in {run.label}"] = sorted(run.interrupted)
        only = sorted(set(run.complete_steps) - set(compared))
        if only:
            out[f"dumped in {run.label} only"] = only
    return out


def _golden_nonfinite(table: pd.DataFrame, origin: Optional[str],
                      t: OpRows) -> Optional[dict]:
    """The first row (execution order) whose golden tensor holds nan or inf, how many rows
    do, and whether the origin's own rows (its inputs or outputs) are among them: only then
    does the golden's nan/inf reach where the divergence starts."""
    bad = sum(pd.to_numeric(table.get(c, 0), errors="coerce").fillna(0)
              for c in ("GoldenNanCount", "GoldenInfCount"))
    flagged = np.flatnonzero(np.asarray(bad) > 0)
    rows = table.iloc[flagged].sort_values("Index")
    if rows.empty:
        return None
    first = rows.loc[_lead(table, rows, bad)]
    nan = pd.to_numeric(table.get("GoldenNanCount", 0), errors="coerce").fillna(0)
    return {"tensor": first.TensorIndex, "golden_tensor": first.get("GoldenTensor", ""),
            "nonfinite": int(bad[first.name]), "tensors": len(rows), "order": int(first.Index),
            "nan_tensors": int((nan > 0).sum()),
            # only infinities, each held by the NPU as well (a mask's -inf): no cause
            "matched": not _unmatched_nonfinite(rows),
            # ...or held saturated, at ±65504 (saturation mode): where nothing reading them
            # differs, no cause either
            "held": _held(rows),
            # and no row holding them diverges (a reader's input is such a row)
            "quiet": not any(t.bad[i] for i in flagged.tolist()),
            "at_origin": origin is not None and
            _unmatched_nonfinite(rows[rows.NPUDump == call_name(origin)]),
            # the first that nothing in the step reads (the loss, an output, an update): a
            # mask's -inf that reaches it is no mask (None: none does, or no input rows say)
            "reaches": _sink(t, rows)}


def _lead(table: pd.DataFrame, rows: pd.DataFrame, bad: pd.Series):
    """The row (label) to name first among these (golden nan/inf, in execution order): the
    first whose nan/inf has an effect. A tensor whose infinities the NPU holds too (as inf
    or saturated) and whose every reader comes out finite in the golden (a mask's -inf that
    the softmax turns to 0) has none: it is passed over while a later row may have one.
    Where no row's readers can be told (a dump without input rows), the first row. bad:
    each row's golden nan and inf count."""
    if "GoldenTensor" not in table:
        return rows.index[0]
    is_in = table.TensorIndex.astype(str).str.contains(":input:", regex=False)
    readers = table[is_in].groupby("GoldenTensor").NPUDump.agg(set)
    out = ~is_in & table.TensorIndex.astype(str).str.contains(":output:", regex=False)
    # ops with an output holding nan/inf in the golden
    spreading = set(table.NPUDump[out & (bad > 0)])
    for label, row in rows.iterrows():
        by = readers.get(row.GoldenTensor)
        if not by or by & spreading or not _held(rows.loc[[label]]):
            return label
    return rows.index[0]


def _sink(t: OpRows, rows: pd.DataFrame) -> Optional[str]:
    """The first of these rows (golden nan/inf) that is an output nothing in the step reads
    (OpRows.read), where the table has input rows to tell (a foreign dump's may not)."""
    if not t.has_golden or all(t.is_out):
        return None
    outs = rows[rows.TensorIndex.astype(str).str.contains(":output:", regex=False)]
    sinks = outs[~outs.GoldenTensor.isin(t.read)]
    return str(sinks.iloc[0].GoldenTensor or sinks.iloc[0].TensorIndex) if len(sinks) else None


def _held(rows: pd.DataFrame) -> bool:
    """Whether the NPU holds every golden infinity of these rows, as inf or saturated to
    ±65504, and no golden holds nan."""
    def count(c):
        return pd.to_numeric(rows.get(c, 0), errors="coerce").fillna(0)
    return bool(len(rows)) and not bool((count("GoldenNanCount") > 0).any()) and bool(
        (count("GoldenInfCount") <= count("NpuInfCount") + count("NpuAtFp16Max")).all())


def _unmatched_nonfinite(rows: pd.DataFrame) -> bool:
    """Whether these rows' golden nan/inf explain a divergence: a nan, or infinities the NPU
    side does not hold as many of (a mask's -inf that both sides hold explains nothing)."""
    def count(c):
        return pd.to_numeric(rows.get(c, 0), errors="coerce").fillna(0)
    if not len(rows):
        return False
    return bool(((count("GoldenNanCount") > 0) |
                 (count("GoldenInfCount") != count("NpuInfCount"))).any())


def _fusion(ws: Workspace, run: Run) -> Optional[Dict[str, int]]:
    fired = ws.fusion_result(run)
    return None if fired is None else {p: len(nodes) for p, nodes in fired.items()}


class StepCompare(NamedTuple):
    """A step's compare and what ac's step loop, its report and fix all read of it (made
    once): the root cause, the coverage, the update check, where carried state was written,
    and the step's overflowing tasks."""
    table: pd.DataFrame
    cause: RootCause
    coverage: Coverage
    findings: int                  # diverging ops, noise aside
    underflow: Optional[dict]
    updates: UpdateCheck           # what each update changed against the golden's change
    trace: Optional[StateTrace] = None     # where state carried in was written
    tasks: tuple = ()                      # the step's overflowing tasks

    @property
    def has_findings(self) -> bool:
        """A finding of the compare (overflows aside)."""
        return self.findings > 0 or bool(self.cause.carried) or self.underflow is not None \
            or bool(self.updates.lost)

    @property
    def quiet_overflows(self) -> bool:
        """Whether the step's overflows had no effect: the compare saw everything, every
        overflowing kernel's outputs among it, and nothing of the step diverges with an
        effect (a saturated exp whose softmax still matches the golden). With anything
        unseen, an overflow stays a finding."""
        if not self.tasks or self.has_findings or not self.coverage.complete:
            return False
        t = self.cause.rows
        compared = {call_name(t.op_name[i]) for i, out in enumerate(t.is_out)
                    if out and t.verdict[i] != ERROR}
        return all(task.op_name in compared for task in self.tasks)

    @property
    def quiet_variables(self) -> List[str]:
        """The variables written by updates whose divergence is noise or without effect:
        what a replay's goal leaves out, as ac leaves them out."""
        return sorted({split_tensor_name(v)[0]
                       for v in written_variables(self.cause.rows, self.cause.benign_ops)})

    @property
    def any_findings(self) -> bool:
        """A finding of the compare, or an overflow with (or of unknown) effect."""
        return self.has_findings or bool(self.tasks) and not self.quiet_overflows

    @classmethod
    def of(cls, table: pd.DataFrame, criteria, updates, noise_state=(),
           overflowed=()) -> "StepCompare":
        """updates(skip): the step's UpdateCheck, leaving out the ops in skip (noise);
        overflowed: the ops whose kernels overflowed in the step (root_cause's)."""
        cause = root_cause(table, criteria, noise_state=noise_state, overflowed=overflowed)
        return cls(table, cause, coverage(table), count_findings(table, criteria, cause),
                   _underflow(table, cause), updates(cause.benign_ops))


def _ranks_divergence(ws, siblings, npu_run, golden_run, step, criteria, own: StepCompare,
                      workers: int = 1, scheduler=None):
    """Every rank's step against its own reference (the same rank of the reference's dump or
    launch), and where the divergence first appears among them; the compared rank's own
    judgement is reused."""
    pairs = []
    for run in siblings:
        reference = golden_run if run is npu_run else _same_rank_reference(ws, run, golden_run)
        if reference is not None and step in run.complete_steps and \
                step in reference.complete_steps:
            pairs.append((run, reference))

    def judge(run, reference, s):
        return own.cause if run is npu_run else \
            judge_step(ws, run, reference, s, criteria, workers=workers,
                       scheduler=scheduler).cause
    return divergence_origin(ws, pairs, step, judge)


def _same_rank_reference(ws, run: Run, golden_run: Run) -> Optional[Run]:
    """run's reference: the rank of golden_run's dump with run's rank, or the same rank of
    run's launch (Workspace.reference_for)."""
    source = golden_run.info.get("source")
    among = [r for r in ws.runs(golden_run.target) if r.info.get("source") == source] \
        if source else None
    return ws.reference_for(run, among)


def judge_step(ws: Workspace, npu_run: Run, golden_run: Run, step: int, criteria=None,
               tasks=None, earlier: Optional[Dict[int, StepCompare]] = None,
               workers: int = 1, scheduler=None) -> StepCompare:
    """A step's compare, root cause and update check, judged as ac judges it. State that
    came in diverging is followed back through the steps compared so far (`earlier`, made
    where missing); where every update that wrote it was noise in its own step, the step is
    judged again with that state as noise: it carries no finding (the key bias of every
    healthy Transformer). tasks: the step's overflowing tasks (read here when None)."""
    criteria = Criteria.of(criteria)
    if tasks is None:
        tasks = overflow_report(ws, npu_run, step).tasks
    table = vector_compare(ws, npu_run, golden_run, step, threshold=criteria, workers=workers,
                           scheduler=scheduler)

    def updates(skip):
        return check_updates(ws, npu_run, golden_run, step, criteria, skip)
    overflowed = {task.op_name for task in tasks}
    c = StepCompare.of(table, criteria, updates, overflowed=overflowed)._replace(
        tasks=tuple(tasks))
    if not (c.cause.carried and c.cause.state_first):
        return c
    trace = trace_state(ws, npu_run, golden_run, step, c.cause.diverging_state, criteria,
                        {k: e.table for k, e in (earlier or {}).items()})
    if trace.writers_noise:
        c = StepCompare.of(table, criteria, updates, noise_state=trace.variables,
                           overflowed=overflowed)
    return c._replace(trace=trace, tasks=tuple(tasks))


def _compare_step(ws, c: StepCompare, npu_run, golden_run, step, criteria, limit, rank, result):
    table, cause = c.table, c.cause
    result.overflow_without_effect = c.quiet_overflows
    result.coverage = c.coverage
    result.diverging = summarize(table, criteria, limit, cause=cause, noise_last=True)
    result.diverging_count = c.findings
    result.cancellations = sorted(cause.noise_ops)
    result.no_effect = _no_effect(cause)
    result.update_check = c.updates.to_dict()
    result.lost_updates = result.update_check if c.updates.lost else None
    tmap = TensorMap(ws.compiled_graph(npu_run))
    origin = cause.first_origin
    if origin is not None:
        result.origin = dict(dataclasses.asdict(origin), **_facts(
            origin.op_name, origin.op_type, tmap, _input_peak(table, call_name(origin.op_name))))
        _call_pass(ws, npu_run, step, result.origin)
        # a front-end's call site (module path, the script's line), where it wrote one
        site = ws.call_sites(npu_run, step).get(call_name(origin.op_name), {})
        imported = bool(npu_run.info.get("source"))        # another tool's dump
        result.origin.update(module=site.get("module", ""), call_site=site.get("source", ""),
                             api_call=npu_run.info.get("front_end") == "pytorch",
                             imported=imported)
        if imported:
            result.origin_replay = (f"not replayed: {npu_run.label} is another tool's dump "
                                    f"(imported from {npu_run.info.get('format')}): no graph or "
                                    f"script to replay the call from")
        elif npu_run.info.get("front_end") == "pytorch":
            result.origin_replay = ("not replayed: a script's call has no graph node to replay "
                                    "it from (fix reruns the script instead)")
        else:
            try:
                result.origin_replay = replay_op(ws, npu_run, step, origin.op_name,
                                                 golden_run).verdict
            except (ReplayOpError, PrecisionToolError) as e:
                result.origin_replay = f"not replayed: {e}"
    if c.trace is not None:
        result.carried = dict(dataclasses.asdict(c.trace), command=c.trace.dump_command())
    result.underflow = c.underflow
    result.golden_nonfinite = _golden_nonfinite(c.table, origin.op_name if origin else None,
                                                cause.rows)
    first = result.first_overflow
    if first is not None and origin is not None and first["op_name"] != origin.op_name and \
            first["op_name"] in {d.op_name for d in cause.propagators}:
        first["carries"] = origin.op_name       # its inputs already diverge: it is no cause
    # rank=None: when the first origin is not already proven by an overflow of its own (an
    # op that overflowed is what hurts; replaying each other origin only costs time)
    proven = first is not None and cause.first_origin is not None and \
        first["op_name"] == cause.first_origin.op_name
    if (rank or rank is None and not proven) and len(cause.origins) > 1:
        result.impact = _impact(ws, npu_run, golden_run, step, cause)


def _gradual(causes: Dict[int, RootCause]) -> Optional[dict]:
    """The gradual divergence of the steps looked at, as the panel and the advice say it
    (None if none): the steps that have some, and of the first such step how many ops,
    the first to cross (with what decided it and its inputs' and outputs' furthest
    cosines) and the lowest output cosine among them."""
    steps = sorted(s for s, c in causes.items() if c.gradual)
    if not steps:
        return None
    cause = causes[steps[0]]
    t, first = cause.rows, cause.gradual[0]

    def cosines(name, out):
        pos = t.rows_by_op[name]
        rows = [i for i in pos if t.is_out[i]] if out else t.inputs(name, pos)
        found = [t.cosine[i] for i in rows if t.cosine[i] == t.cosine[i]]
        return min(found) if found else None
    lowest = [c for c in (cosines(d.op_name, True) for d in cause.gradual) if c is not None]
    return {"steps": steps, "step": steps[0], "ops": len(cause.gradual),
            "first": {"op_name": first.op_name, "op_type": first.op_type,
                      "reasons": list(first.reasons),
                      "input_cosine": cosines(first.op_name, False),
                      "output_cosine": cosines(first.op_name, True)},
            "lowest_cosine": min(lowest) if lowest else None}


def _no_effect(cause: RootCause, shown: int = 3) -> Optional[dict]:
    """The divergence without effect, as the panel and the advice say it (None if none)."""
    if not cause.no_effect:
        return None
    return {"ops": len(cause.no_effect),
            "first": [{"op_name": d.op_name, "op_type": d.op_type, "reasons": list(d.reasons),
                       "absorbed_by": d.absorbed_by[:shown]} for d in cause.no_effect[:shown]]}


def _facts(op_name: str, op_type: str, tmap: TensorMap, input_peak: Optional[float]) -> dict:
    """What the advice needs to know of an op (an origin, the first overflow): whether the
    compiler inserted it (and what it casts: data fed in, a constant, with the magnitude its
    input reaches), whether it updates state, its pass, and the op types a precision policy
    placed for it (a UB-fused elementwise kernel's are its steps': the policy placed those
    before fusion, never "FusedEltwise")."""
    node = tmap.node(op_name)
    attrs = tmap.attrs(op_name)
    producers = [tmap.node(split_tensor_name(t)[0]) for t in (node.inputs if node else [])]
    source = next(({"name": p.name, "type": p.type, "peak": input_peak}
                   for p in producers if p is not None and p.type in ("Placeholder", "Const")),
                  None)
    placed = sorted(set(placed_types(op_type, attrs)))
    # an inserted Cast is there because what reads it computes in fp16
    reading = [n for n in tmap.readers(op_name) if n.type != "Cast"] \
        if attrs.get("inserted_by") else []
    readers = sorted({t for n in reading for t in placed_types(n.type, n.attrs)} - {"Cast"})
    return {"inserted": bool(attrs.get("inserted_by")), "source": source, "readers": readers,
            "reader_ops": sorted(n.name for n in reading),
            "update": bool(registry.updated_inputs(op_type)),
            "pass_name": attrs.get("pass_name", "") or "",
            "compute_dtype": attrs.get("compute_dtype", ""), "policy_types": placed}


def _call_pass(ws: Workspace, run: Run, step: int, facts: dict) -> None:
    """A graphless run's call names its fusion pass in the index (a script's fused kernel),
    not in a compiled node."""
    if facts.get("pass_name") or ws.compiled_graph(run) is not None:
        return
    t = ws.index_table(run, step)
    if "pass_name" not in t.columns:        # a format without the column
        return
    names = [p for op, p in zip(t["op_name"].tolist(), t["pass_name"].tolist())
             if op == facts["op_name"] and isinstance(p, str) and p]
    if names:
        facts["pass_name"] = names[0]


def _input_peak(table: pd.DataFrame, op_name: str) -> Optional[float]:
    """The largest magnitude an op's first input reaches (the golden's, from the compare)."""
    row = table[(table.NPUDump == op_name) & (table.TensorIndex == f"{op_name}:input:0")]
    peak = pd.to_numeric(row.GoldenAbsMax, errors="coerce").max() if len(row) else np.nan
    return None if peak != peak else float(peak)


def _underflow(table: pd.DataFrame, cause: RootCause) -> Optional[dict]:
    """Tensors that diverge only by elements flushed to zero (beyond the golden's zeros: a
    tensor that diverges otherwise too lost its small values to that, as a softmax that
    overflowed does), made there (not by an op whose inputs diverge otherwise), noise aside: which, how many, the worst share, the first in execution
    order, and for gradients their largest golden magnitude (what a loss scale must keep
    under 65504)."""
    t = cause.rows
    noise = cause.benign_ops
    share = pd.to_numeric(table.FlushedToZeroRatio, errors="coerce").to_numpy()
    peaks = pd.to_numeric(table.GoldenAbsMax, errors="coerce").to_numpy()
    with np.errstate(invalid="ignore"):
        # flushing is all that differs; or a whole fp16 tensor below fp16's smallest normal,
        # whose norm, cosine and all-zero NPU side are what the flushing did
        whole = (np.asarray(t.dtype, dtype=object) == "float16") & (share > t.criteria.flushed) \
            & (peaks < FP16_MIN_NORMAL)
    bad, out = np.asarray(t.bad, dtype=bool), np.asarray(t.is_out, dtype=bool)
    flushed = np.asarray(t.flushed_only, dtype=bool)
    candidates = bad & out & (flushed | whole)
    # an op reading an input that diverges otherwise than by flushing carries what it
    # zeroes (a ReLU whose input crossed zero with the state's drift): no underflow of its own
    carried = {t.op_name[i] for i in np.flatnonzero(bad & ~out & ~flushed).tolist()}
    hits = [i for i in np.flatnonzero(candidates).tolist()
            if t.golden_op[i] not in noise and t.op_name[i] not in noise
            and t.op_name[i] not in carried]
    if not hits:
        return None
    order = table.Index.to_numpy()
    first = min(hits, key=lambda i: order[i])
    gradient = table.GoldenTensor.fillna("").astype(str).str.startswith(GRADIENT_PREFIX).to_numpy() \
        if "GoldenTensor" in table else np.zeros(len(table), dtype=bool)
    gradients = bool(gradient[hits].all())
    known = gradient & ~np.isnan(peaks)
    peak = float(peaks[known].max()) if known.any() else None
    return {"tensors": len({t.golden_tensor[i] for i in hits}),
            "worst": float(max(share[i] for i in hits)),
            "first": t.tensor[first], "gradients": gradients, "peak": peak,
            "examples": [t.tensor[i] for i in sorted(hits, key=lambda i: order[i])[:5]],
            "ops": sorted({t.tensor[i].split(":")[0] for i in hits})}


def _impact(ws, npu_run, golden_run, step, cause: RootCause) -> Optional[dict]:
    candidates = [d.op_name for d in cause.origins]
    try:
        ranking = rank_by_impact(ws, npu_run, golden_run, step, candidates)
    except PrecisionToolError as e:
        return {"not_ranked": str(e)}
    out = dataclasses.asdict(ranking)
    first = cause.first_origin.op_name
    mine, best = ranking.of(first), (ranking.impacts[0] if ranking.impacts else None)
    # (an origin whose golden output its dtype cannot hold was not replayed: mine is None)
    if mine is None or best is None or mine.removed >= 0.1:
        return out
    text = (f"The first divergence, at {first}, is harmless: with its output as the golden's "
            f"the step's error stays ({mine.removed * 100:.3g}% of it goes).")
    if best.op_name != first and best.removed >= 0.5:
        text += (f" {best.op_name} is what matters: with its output fixed, "
                 f"{best.removed * 100:.3g}% of the error goes.")
    else:
        text += (" No single diverging op of this step accounts for most of it (the best, "
                 f"{best.op_name}, {best.removed * 100:.3g}%): it comes from several ops "
                 "together, or from state the step started with.")
    out["harmless_first"] = text
    return out


def _task(t) -> dict:
    tensors = [{"io": r["io"], "index": int(r["index"]), "dtype": r["dtype"], "shape": r["shape"],
                "max": r["max"], "min": r["min"], "mean": r["mean"],
                "nan_count": int(r["nan_count"]),
                "inf_count": int(r["pos_inf_count"]) + int(r["neg_inf_count"])} for r in t.tensors]
    return {"op_name": t.op_name, "op_type": t.op_type, "task_id": t.task_id,
            "status": f"0x{t.status:x}", "status_bits": t.status_bits,
            "inputs_finite": t.inputs_finite, "tensors": tensors}
