"""`fix` (`repair`): the smallest configuration change that makes a dumped step match its
golden, verified over steps and written as config/modify_mixlist.json and
config/fusion_switch.cfg (analysis.replays.repair does the work)."""
from __future__ import annotations

import math

import click
from rich.markup import escape

from ..analysis.replays import repair as repairing
from .analyse import LEFT, RIGHT, _criteria, criteria_options
from .app import EXIT_FINDINGS, EXIT_OK, EXIT_USAGE, App, Finite, command, fmt, panel, prose


@command("fix", "repair", short_help="Find, verify and write the smallest precision fix.")
@click.option("-s", "--step", type=click.IntRange(0), default=None,
              help="The dumped step to repair (default: the NPU run's first complete one).")
@LEFT
@RIGHT
@criteria_options("-c")
@click.option("--loss-rtol", type=Finite(0.0, min_open=True), default=None,
              help="Goal: the loss within this relative error (and no overflow), instead of "
                   "every fetched output and variable update within the criteria.")
@click.option("-b", "--budget", type=click.IntRange(1), default=None,
              help="Replays the search may use (default: 128 replays of a graph's step; 12 "
                   "reruns of a PyTorch script).")
@click.option("-n", "--proof-steps", type=click.IntRange(1), default=20, show_default=True,
              help="Training steps the proof reruns from the bundle.")
@click.option("--proof-rtol", type=Finite(0.0, min_open=True), default=0.02,
              show_default=True, help="How far the fixed loss may be from the golden's at any "
                                      "step of the proof (relative).")
@click.option("-j", "--workers", type=click.IntRange(1), default=2, show_default=True,
              help="Processes for the independent replays.")
@click.option("--dry-run", is_flag=True, help="Find and verify the fix; write no file.")
def fix_cmd(app: App, step, left, right, cosine, norm, flushed, rel_error, loss_rtol, budget,
            proof_steps, proof_rtol, workers, dry_run):
    """Replay the dumped step from its replay bundle under candidate changes (a fusion pass
    off, the loss scale, an op type kept in fp32 through modify_mixlist, and last a precision
    mode that keeps everything in fp32), cheapest first, until the smallest set that makes
    the step match the golden is found (dropping any one change breaks it). The fix is then
    proven over -n training steps from the bundle against the golden's loss curve, and
    written to config/modify_mixlist.json, config/fusion_switch.cfg and config/fix.json in
    the workspace (what it needs of them).

    Exit code 0 when a verified fix was found, or none was needed; 1 when none was found
    within the budget, or the fix does not hold over the proof's steps; 2 on input error."""
    npu = app.run(left, "npu")
    golden = app.reference(right, npu)
    if npu.info.get("front_end") == "pytorch":       # without -s: the first step with a finding
        app.info(f"repairing {npu.label} against {golden.label}...")
        return _fix_script(app, npu, golden, step, _criteria(cosine, norm, flushed, rel_error),
                           budget or 12, proof_rtol, dry_run)
    step = app.step(npu, step)
    app.info(f"repairing step {step} of {npu.label} against {golden.label}...")
    budget = budget or 128
    result = repairing.repair(app.ws, npu, golden, step, _criteria(cosine, norm, flushed, rel_error),
                              loss_rtol=loss_rtol, budget=budget, proof_steps=proof_steps,
                              proof_rtol=proof_rtol, workers=workers, write=not dry_run,
                              progress=app.info)

    def render():
        app.console.print(panel(escape("\n".join(_lines(result))), title="Precision fix",
                                title_align="left"))
        for path in result.files:
            app.line(f"wrote {path}")
        for name, text in result.contents.items() if result.unsaved else ():  # to copy
            app.line(f"--- {name} ---\n{text.rstrip()}")
    app.emit(result, render)
    if result.unsaved:
        app.err.print(f"error: the fix was found but not saved: {result.unsaved}; it is "
                      f"printed above: {app.command('fix --results-dir DIR')} writes it "
                      f"elsewhere", markup=False)
        return EXIT_USAGE
    return EXIT_OK if result.verified else EXIT_FINDINGS


def _fix_script(app: App, npu, golden, step, criteria, budget, rtol, dry_run) -> int:
    """A PyTorch script's run: the fix is found by rerunning the script (analysis.replays.script_repair)."""
    from ..analysis.replays.script_repair import repair_script
    r = repair_script(app.ws, npu, golden, step, criteria, rtol=rtol, budget=budget,
                      write=not dry_run, progress=app.info)

    def render():
        lines = [f"{r.npu_run} step {r.step} against {r.golden_run}; goal: the step as ac -c "
                 f"judges it, and the loss within {fmt(r.rtol)} of the golden's at every step"]
        if r.healthy:
            lines.append("No fix needed: the step already meets the goal.")
        else:
            lines.append("before: fails: " + "; ".join(r.before[:3])
                         + (f"; ... {len(r.before) - 3} more" if len(r.before) > 3 else ""))
            for t in r.trials:
                how = "passes" if t.passed else ("does not run: " + t.error if t.error else
                                                 "fails: " + "; ".join(
                                                     (t.failing[:2] or []) +
                                                     ([f"loss off at step {t.drift_step}"]
                                                      if t.drift_step is not None else [])))
                lines.append(f"  rerun, {t.describe()}: {how}")
            if r.fix is None:
                lines.append("No fix found.")
            else:
                f = r.fix
                lines.append(f"Fix: {f.describe()}" + ("" if r.minimal else
                                                       " (not proven minimal)"))
                keep = ",".join(f.keep_fp32)
                by_hand = ([f"--keep-fp32 {keep} (PrecisionDebugger(keep_fp32="
                            f"{f.keep_fp32!r}))"] if keep else []) + \
                    ([f"--fusion-switch with {', '.join(f.fusion_off)} off"]
                     if f.fusion_off else [])
                lines.append("train with: torch-run --fix config/fix.json, or "
                             + (" and ".join(by_hand) or f"--precision-mode {f.precision_mode}"))
                steps = len([x for x in r.golden_losses if x == x])
                if steps:
                    lines.append(f"proof: the rerun's {steps} step(s), the loss within "
                                 f"{fmt(r.rtol)} of the golden's at each (largest relative "
                                 f"error {fmt(f.loss_error)}; last {fmt(r.fixed_losses[-1])} vs "
                                 f"{fmt(r.golden_losses[-1])}); the fixed run is {f.run}")
        lines += r.notes
        app.console.print(panel(escape(prose(lines)), title="Precision fix",
                                title_align="left"))
        for path in r.files:
            app.line(f"wrote {path}")
        for name, text in r.contents.items() if r.unsaved else ():
            app.line(f"--- {name} ---\n{text.rstrip()}")
    app.emit(r, render)
    if r.unsaved:
        app.err.print(f"error: the fix was found but not saved: {r.unsaved}", markup=False)
        return EXIT_USAGE
    return EXIT_OK if r.verified else EXIT_FINDINGS


def _lines(r: repairing.Repair) -> list:
    lines = [f"{r.npu_run} step {r.step} against {r.golden_run}; goal: {r.goal}"]
    if not r.needed:
        lines.append("No fix needed: the step already meets the goal.")
    elif r.fix is None:
        lines.append("No fix found.")
    else:
        lines.append("Fix: " + "; ".join(c.describe() for c in r.fix)
                     + ("" if r.minimal else " (not proven minimal)"))
        mode = r.mode
        verb = "compile with" if r.proof is not None and r.proof.stateless else "train with"
        lines.append(f"{verb}: precision mode {mode}"
                     + (f", modify_mixlist {r.config['modify_mixlist']}"
                        if r.config.get("modify_mixlist") else "")
                     + "".join(f", loss scale {c.value:g} (FixedLossScaleManager)"
                               for c in r.fix if c.kind == "loss_scale"))
        if r.fix:
            before, after = r.step_time
            lines.append(f"cost: {len(r.moved_to_fp32)} kernel(s) moved to fp32; kernels "
                         f"{r.kernels[0]} -> {r.kernels[1]}; modelled step time "
                         f"x{after / before:.3f} ({before * 1e6:.1f} -> {after * 1e6:.1f} us)"
                         if before else "")
    lines.append(f"before: {_outcome(r.before)}")
    if r.after is not None and r.needed:
        lines.append(f"after:  {_outcome(r.after)}")
    lines.append(f"replays: {r.replays} of {r.budget}, over {len(r.candidates)} candidate(s)")
    p = r.proof
    if p is not None:
        if p.stateless:
            lines.append("proof: the step updates no variable (an inference graph), so no later "
                         "step differs from it: the replays of the step are the proof")
        elif p.holds:
            lines.append(f"proof: {p.steps} steps from the bundle, the loss within "
                         f"{fmt(p.rtol)} of the golden's at every step (last: {fmt(p.fixed[-1])} "
                         f"vs {fmt(p.golden[-1])}; without the fix {fmt(p.unfixed[-1])})")
        elif p.drift_step is None:
            lines.append(f"proof UNDECIDED: the golden's own loss is not finite at step "
                         f"{p.golden_nonfinite_step} of {p.steps}: the training diverges without "
                         f"any NPU (precision-tool check names why: nan/inf in the data, a "
                         f"learning rate too high); -n {p.golden_nonfinite_step} proves what can be")
        else:
            k = p.drift_step
            lines.append(f"proof FAILED: at step {k} of {p.steps} the loss is {fmt(p.fixed[k])} "
                         f"against the golden's {fmt(p.golden[k])}: the fix holds at the dumped "
                         f"step and drifts later")
    lines += r.notes
    return lines


def _outcome(o: repairing.Outcome) -> str:
    # a step that fetches no loss (nan) says nothing of one
    loss = "" if math.isnan(o.loss_error) else f" (loss error {fmt(o.loss_error)})"
    if o.passed:
        return f"meets the goal{loss}"
    what = ["overflow"] if o.overflow else []
    what += o.failing[:3] + ([f"... {len(o.failing) - 3} more"] if len(o.failing) > 3 else [])
    return f"fails{loss}: " + "; ".join(what)
