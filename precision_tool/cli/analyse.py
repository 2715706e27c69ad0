"""The analysis commands: ac, vc, vcs, fo. Each parses, calls precision_tool.analysis and
renders; --json prints the analysis result itself."""
from __future__ import annotations

import json
import os
import re

import click
from rich.markup import escape
from rich.table import Table

from .. import analysis
from ..analysis import Coverage, Criteria

from ..dump.layout import format_steps
from ..dump.formats.ours import check_compiled_graph
from ..dump.workspace import WorkspaceError
from .app import (EXIT_FINDINGS, EXIT_OK, EXIT_USAGE, App, CommandError, Finite, command, fmt,
                  panel, prose)
from .torch_run import NOT_SIMULATED

WORKERS = click.option("-w", "--workers", type=click.IntRange(1, 256), default=1,
                       show_default=True,
                       help="Local worker processes comparing tensor pairs in parallel.")
SCHEDULER = click.option("--scheduler", default=None, metavar="ADDRESS",
                         help="Run the comparisons on this Dask cluster (tcp://host:8786); "
                              "the workers read the dump from storage shared with this "
                              "machine. Needs pip install \"precision_tool[cluster]\".")
STEP = click.option("-s", "--step", type=click.IntRange(0), default=None,
                    help="The dumped step (default: every step dumped in both runs, the first "
                         "with findings reported).")
LEFT = click.option("-lt", "--left", default=None, metavar="RUN",
                    help="The run to check: npu/debug_0, debug_0 or its directory (default: the "
                         "newest NPU run that is not a replay).")
RIGHT = click.option("-rt", "--right", default=None, metavar="RUN",
                     help="The reference run (default: the newest golden run).")


def criteria_options(cosine_flag: str):
    """The verdict's thresholds (analysis.Criteria) as options; `cosine_flag` is the cosine
    threshold's short flag (-c in vc/vcs/fo, -t in ac, whose -c is --compare)."""
    d = Criteria()

    def wrap(fn):
        for option in reversed([
                click.option(cosine_flag, "--cosine", "cosine", type=Finite(-1.0, 1.0),
                             default=d.cosine, show_default=True,
                             help="A tensor whose cosine similarity is under this diverges."),
                click.option("--norm", type=Finite(0.0), default=d.norm,
                             show_default=True,
                             help="...or whose L2 norm is this far from the golden's, "
                                  "relatively (0.1: 10%)."),
                click.option("--flushed", type=Finite(0.0), default=d.flushed,
                             show_default=True,
                             help="...or that holds as zero more than this share of the "
                                  "golden's non-zero elements (underflow)."),
                click.option("--rel-error", type=Finite(0.0), default=d.rel_error,
                             show_default=True,
                             help=f"...or, of at most {d.small_size} elements (a loss), whose "
                                  f"relative error is over this."),
                ]):
            fn = option(fn)
        return fn
    return wrap


def _criteria(cosine, norm, flushed, rel_error) -> Criteria:
    return Criteria(cosine=cosine, norm=norm, flushed=flushed, rel_error=rel_error)


def _incomplete(what: str, cov: Coverage) -> CommandError:
    """The one line that makes an incomplete compare exit 2, after its results are shown."""
    return CommandError(f"error: {what} is incomplete: {cov.text()}", EXIT_USAGE)


def _raise_incomplete(check) -> None:
    """An auto check (analysis.AutoCheck) that did not see everything exits 2 after its
    results: its step's compare left tensors out (the origin may be among them), or, with no
    finding, steps of the runs were not compared (no clean verdict without them)."""
    if check.coverage is not None and not check.coverage.complete:
        raise _incomplete(f"the compare of step {check.step}", check.coverage)
    if check.verdict == "incomplete" and check.unseen_steps:
        raise CommandError("error: no clean verdict: step(s) left out: " + "; ".join(
            f"{format_steps(steps)} ({why})" for why, steps in check.unseen_steps.items()),
            EXIT_USAGE)


def _step_note(look: dict) -> str:
    """What a step looked at on the way was taken for, where it is not a finding."""
    if look.get("backoff"):
        kind = "settling" if look["backoff"].get("kind") == "calibration" else "backing off"
        return f"  [the loss scale {kind}: no finding]"
    if look.get("against"):     # (its counts are against that replay)
        return f"  [after a skipped update: against {look['against']}, from the NPU's " \
            f"state" + (": no finding]" if look.get("replayed") else "]")
    if look.get("after_skipped_update"):
        return "  [after a skipped update: not judged]"
    if look.get("drift_replayed"):
        return "  [drift: from the NPU's state it matches, the losses hold: no finding]"
    if look.get("parted"):
        return f"  [the runs part at {look['parted']['tensor']}: not judged after it]"
    return ""


# -- ac ---------------------------------------------------------------------------------------
@command("ac", "auto-check", short_help="Auto check: fusion, overflow, and with -c the compare.")
@click.option("-c", "--compare", is_flag=True, help="Also compare every op with the golden run "
              "and find the root cause.")
@click.option("-l", "--limit", type=click.IntRange(0), default=3, show_default=True,
              help="Overflows after the first, and diverging ops, to show.")
@criteria_options("-t")
@click.option("--rank/--no-rank", default=None,
              help="With several origins, replay the step once per origin with its output "
                   "replaced by the golden's, to say which one matters (default: unless the "
                   "first origin is the first overflow, which settles it).")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="With -c, replay the step (from its replay bundle) under each configuration "
                   "change the advice offers and mark it verified or 'does not help' (one "
                   "replay per change); otherwise each says 'not verified'. A torch-run "
                   "script's step that starts from drifted state is rerun on the golden from "
                   "the NPU's state (a replay run, kept and reused) to tell drift from the "
                   "step's own error.")
@LEFT
@RIGHT
@STEP
@click.option("--html", "html_file", default=None, metavar="FILE",
              help="Also write the HTML report to FILE (needs -c; see precision-tool report).")
@WORKERS
@SCHEDULER
def auto_check_cmd(app: App, compare, limit, cosine, norm, flushed, rel_error, rank, verify,
                   left, right, step, html_file=None, workers=1, scheduler=None):
    """Auto check: the fusion summary (passes and what they fused), the overflow analysis (the
    first overflow, then the next LIMIT, with decoded status and tensor statistics), and with
    -c the vector compare, the diverging ops and the root cause: the origin op, its fusion
    pass and its single-op replay, or the earlier step whose state carried the divergence
    in. Without -s every dumped step is looked at and the first with findings reported.
    Ends with what to try next: each configuration change it offers is replayed on the
    step and marked "verified" or "does not help" (never offered first), or "not verified"
    where no replay could try it (a data or model change, a step without a replay bundle).

    Exit code 1 when something overflowed or diverges; 2 when something that should have
    been compared could not be (the results are shown first)."""
    npu = app.run(left, "npu")
    golden = app.reference(right, npu) if compare else None
    if step is not None:            # a step that is not there is said before any work
        app.step(npu, step)
        if golden is not None:
            app.step(golden, step)
    if compare:
        app.info("comparing every op with the golden run...")
    if html_file and not compare:
        raise click.UsageError("--html needs -c: the report is drawn from the compare")
    criteria = _criteria(cosine, norm, flushed, rel_error)
    result = analysis.auto_check(app.ws, npu, golden, step=step, compare=compare,
                                 threshold=criteria, limit=limit, write_csv=compare, rank=rank,
                                 verify=verify, workers=workers, scheduler=scheduler,
                                 on_progress=app.info)
    if html_file:
        from ..report import write_report
        path, _ = write_report(app.ws, html_file, npu_run=npu, golden_run=golden,
                               criteria=criteria, check=result)
        app.info(f"report: {path}")
    app.emit(result, lambda: _render_ac(app, result, limit))
    _raise_incomplete(result)
    return EXIT_FINDINGS if result.has_findings else EXIT_OK


def _render_ranks(app: App, ranks: dict):
    """Where a nan/inf first appears across the ranks of a data-parallel dump."""
    lines = []
    for e in ranks["origin"]:
        lines.append(f"[bold]{escape(e['rank'])}[/bold] ({escape(e['run'])}): "
                     f"{escape(e['op_name'])} makes it (before collective {e['epoch']})"
                     + (f"\n  source: {escape(e['source'])}" if e["source"] else ""))
    for e in ranks["received"]:
        lines.append(f"{escape(e['rank'])} ({escape(e['run'])}): received through "
                     f"{escape(e['op_name'])}")
    for e in ranks["others"]:
        lines.append(f"{escape(e['rank'])} ({escape(e['run'])}): {escape(e['op_name'])} makes "
                     f"one later (collective {e['epoch']})")
    for d in ranks["disagree"]:
        lines.append(f"{escape(d['rank'])} ({escape(d['run'])}), step {d['step']}: its "
                     f"{d['what']} {escape(d['tensor'])} differs from "
                     f"{escape(ranks['first_rank'])}'s ({escape(d['detail'])})")
    for note in ([ranks["note"]] if ranks["note"] else []) + (
            [f"steps {ranks['partial_steps']} were dumped by some ranks only: not looked at"]
            if ranks["partial_steps"] else []):
        lines.append(escape(note))
    title = f"Ranks  {ranks['ranks']} ranks" + (
        f", nan/inf first in step {ranks['step']}" if ranks["step"] >= 0 else
        ", no nan/inf in the steps every rank dumped") + (
        ", replicas disagree" if ranks["disagree"] else "")
    app.console.print(panel("\n".join(lines) or "no nan/inf", title=title, title_align="left"))


def _render_ac(app: App, r, limit):
    out = app.console
    fusion = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    fusion.add_column("pass")
    fusion.add_column("fused nodes", justify="right")
    for name, count in sorted((r.fusion or {}).items(), key=lambda kv: -kv[1]):
        fusion.add_row(name, str(count))
    body = fusion if r.fusion else ("no fusion pass fired" if r.fusion is not None
                                    else "no fusion record (fusion_result.json) in this run")
    out.print(panel(body, title=f"Fusion  {r.npu_run}, step {r.step}", title_align="left"))
    if r.not_simulated:
        app.line(NOT_SIMULATED + ", ".join(r.not_simulated))
    if len(r.steps) > 1 or (r.steps and r.steps[0]["step"] != r.step):
        lines = [f"step {x['step']}: " + ", ".join(
            [f"{x['overflowing_tasks']} overflowing task(s)"] +
            ([f"{x['diverging_ops']} diverging op(s) by {x['compared']}", x["coverage"]] +
             ([f"{x['lost_updates']} lost update(s)"] if x.get("lost_updates") else []) +
             ([f"{x['gradual_ops']} crossing gradually"] if x.get("gradual_ops") else [])
             if "compared" in x else [])) + _step_note(x) for x in r.steps]
        out.print(panel(escape("\n".join(lines)), title="Steps looked at", title_align="left"))
    if r.ranks is not None:
        _render_ranks(app, r.ranks)
    if r.ranks_divergence is not None:
        d = r.ranks_divergence
        lines = [f"{escape(f['rank'])} ({escape(f['run'])} against {escape(f['reference'])}): "
                 f"{escape(f['op_name'])}" + (" received it" if f["received"] else " starts it")
                 + f" (before collective {f['epoch']})"
                 + ("  [bold]first[/bold]" if f in d["first"] else "") for f in d["ranks"]]
        app.console.print(panel("\n".join(lines), title=f"Ranks  where the divergence starts, "
                                f"step {d['step']}", title_align="left"))
    if r.overflows:
        lines = []
        shown = r.overflows[:limit + 1]
        for t in shown:
            mark = "first overflow" if r.first_overflow and t["op_name"] == r.first_overflow["op_name"] \
                else ("overflow" if t["inputs_finite"] else "carries an earlier overflow")
            lines.append(f"[bold]{escape(t['op_name'])}[/bold] ({t['op_type']}, task {t['task_id']}): {mark}")
            lines.append(f"  status {t['status']}: {', '.join(t['status_bits'])}")
            for x in t["tensors"]:
                bad = "".join(f" {k} {x[c]}" for k, c in (("nan", "nan_count"), ("inf", "inf_count")) if x[c])
                lines.append(f"  {x['io']} {x['index']}: {x['dtype']} \\[{x['shape']}] max {fmt(x['max'], 6)} "
                             f"min {fmt(x['min'], 6)} mean {fmt(x['mean'], 6)}{bad}")
        more = len(r.overflows) - len(shown)
        title = f"Overflow  {len(r.overflows)} overflowing task(s)" + (f", {more} more not shown" if more > 0 else "") \
            + ("  [without effect: the outputs match the golden]" if r.overflow_without_effect else "")
        out.print(panel("\n".join(lines), title=title, title_align="left"))
    else:
        out.print(panel(f"no overflow in step {r.step}", title="Overflow", title_align="left"))
    ls = r.loss_scale
    if ls and ls["first_scale"] == ls["first_scale"]:          # nan: no loss scaling
        moves = ", ".join(f"step {s}: {fmt(a)} -> {fmt(b)}" for s, a, b in ls["moves"][:max(limit, 1)]) or "none"
        out.print(panel(f"{len(ls['overflow_steps'])} of {ls['steps']} observed steps overflowed; "
                        f"{len(ls['skipped_steps'])} updates skipped.\nscale {fmt(ls['first_scale'])} "
                        f"-> {fmt(ls['last_scale'])}; moves: {moves}",
                        title="Loss scale", title_align="left"))
    if r.golden_run is not None:
        cov = r.coverage
        for s in r.diverging:
            _render_op(app, s)
        if not r.diverging:
            out.print(panel(f"no op diverges ({_criteria_text(r.criteria)})",
                            title=f"Compare  {r.npu_run} against {r.golden_run}", title_align="left"))
        if not cov.complete:
            app.warn(f"step {r.step}: {cov.text()}; the results above cover what was compared")
        if r.origin:
            o = r.origin
            fused = f"fused by {o['pass_name']}" if o["pass_name"] else "not fused"
            why = f" ({'; '.join(dict.fromkeys(o['reasons']))})" if o.get("reasons") else ""
            inputs = "its inputs match the golden" if not o.get("unseen_inputs") else \
                (f"its inputs that were compared match the golden (not compared: "
                 f"{', '.join(o['unseen_inputs'])}: the divergence may come in through it)")
            where = "".join(f"{k}: {o[key]}\n" for k, key in (("module", "module"),
                                                              ("source", "call_site"))
                            if o.get(key))
            out.print(panel(escape(f"{o['op_name']} ({o['op_type']}, {fused})\n{where}{inputs}, its outputs "
                                   f"do not: {', '.join(o['bad_outputs'])}{why}\n"
                                   f"single-op replay: {r.origin_replay}"),
                            title=r.origin_title, title_align="left"))
        if r.carried:
            c = r.carried
            where = (f"written in step {c['written_at']} by {', '.join(c['writers'][:3])}" +
                     (" from rounding noise (cancellation or gradual): noise carried, not "
                      "a finding" if c["writers_noise"] else "")
                     if c.get("written_at") is not None else
                     f"written in steps {c['missing'][0]}-{c['missing'][1]}, not dumped"
                     if c.get("missing") else "not written in any dumped step")
            out.print(panel(escape(f"{len(c['variables'])} variable(s) already differ when step "
                                   f"{c['step']} starts: {', '.join(c['variables'][:5])}\n{where}"),
                            title="Carried in with the state", title_align="left"))
        if r.lost_updates:
            lines = [f"{u['variable']} ({u['dtype']}, {u['op_name']}): " + (
                "its statistics (max, min, mean, norm) did not change, the golden's did"
                if u["by_statistics"] else
                f"{u['stalled']} of {u['moved']} elements the golden moved did not move "
                f"({u['share'] * 100:.4g}%; {u['energy'] * 100:.3g}% of the change)")
                for u in r.lost_updates["lost"][:max(limit, 1) * 2]]
            out.print(panel(escape("\n".join(lines)), title="Lost updates", title_align="left"))
        if r.no_effect:
            n = r.no_effect
            lines = [f"{n['ops']} op(s) diverge, and every op that reads what they change "
                     f"matches the golden: no output, loss or update moves (not a finding)"]
            for d in n["first"]:
                why = f" ({'; '.join(dict.fromkeys(d['reasons']))})" if d["reasons"] else ""
                by = f": absorbed by {', '.join(d['absorbed_by'])}" if d["absorbed_by"] else ""
                lines.append(f"  {d['op_name']} ({d['op_type']}){why}{by}")
            out.print(panel(escape("\n".join(lines)), title="Diverges without effect",
                            title_align="left"))
        if r.gradual:
            g, first = r.gradual, r.gradual["first"]
            known = first["input_cosine"] is not None and first["output_cosine"] is not None
            cosines = "" if not known else \
                f": input cosine {first['input_cosine']:.8g} -> output " \
                f"{first['output_cosine']:.8g}"
            lines = [f"step(s) {format_steps(g['steps'])}; {g['ops']} op(s) in step {g['step']}, "
                     f"each adding less than it received (not a finding)",
                     f"  first: {first['op_name']} ({first['op_type']}){cosines}"]
            if g["lowest_cosine"] is not None:
                lines.append(f"  lowest output cosine: {g['lowest_cosine']:.8g}")
            out.print(panel(escape("\n".join(lines)), title="Diverges gradually",
                            title_align="left"))
        if r.impact and r.impact.get("impacts"):
            lines = [f"as it ran: output error {fmt(r.impact['baseline']['output'], 6)}, update "
                     f"error {fmt(r.impact['baseline']['update'], 6)}"]
            lines.append("each origin's output replaced by the golden's, the rest of the step "
                         "replayed:")
            lines += [f"  {i['op_name']}: " + (f"{i['removed'] * 100:.3g}% of the error goes"
                                               if i["removed"] >= 0 else
                                               f"the error grows by {-i['removed'] * 100:.3g}%")
                      for i in r.impact["impacts"]]
            lines += [f"  {op}: not replayed: {why}" for op, why in r.impact.get("skipped", {}).items()]
            out.print(panel(escape("\n".join(lines)), title="What each origin does to the step",
                            title_align="left"))
        if r.result_file:
            app.info(f"compare result: {r.result_file}")
        if r.unsaved:
            app.warn(f"the compare result was not saved: {r.unsaved} (--results-dir DIR "
                     f"writes it elsewhere)")
    if r.watchpoints:
        lines = [f"step {h['step']}: {h['condition']}: {h['message']} ({h['count']} hit(s))"
                 for h in r.watchpoints[:max(limit, 1) * 3]]
        more = len(r.watchpoints) - len(lines)
        out.print(panel(escape("\n".join(lines + ([f"... {more} more: precision-tool wp"]
                                                   if more > 0 else []))),
                        title="Training watchpoints", title_align="left"))
    out.print(panel(escape(prose(r.advice)), title="Next", title_align="left"))


def _criteria_text(c: dict) -> str:
    return (f"cosine >= {fmt(c['cosine'])}, norms within {fmt(c['norm'])}, flushed <= "
            f"{fmt(c['flushed'])}, few-element relative error <= {fmt(c['rel_error'])}")


def _cosine_note(cosine: float, note: str) -> str:
    """What a shown cosine stands on, where it is not every element: undefined (why), or
    taken over the finite pairs only (how many were left out)."""
    if not note:
        return ""
    if "no finite element" in note:
        return " (no finite element to compare)"
    left_out = re.match(r"(\d+) non-finite", note)
    if left_out:
        return f" (over the finite elements: {left_out.group(1)} nan/inf left out)"
    return f" ({note})" if cosine != cosine else ""


# values an op's panel lists per side before it sums up the rest
_SHOWN = 8


def _render_op(app: App, s):
    """One op of a summary (comparing.summary.OpSummary) as a panel."""
    role = s.role or s.category
    if s.category == "nonfinite" and s.role:
        role += ", nan/inf"
    lines = [f"golden ops: {', '.join(s.golden_ops) or '-'}"]
    if s.pass_name:
        lines.append(f"pass: {s.pass_name}")
    if s.statistics_only:    # no tensors dumped: how far apart the norms are instead
        lines.append("statistics only: relative differences of the norms")
        lines.append("inputs:  " + (" ".join(fmt(c) for c in s.input_norm_diffs) or "-"))
        lines.append("outputs: " + " ".join(fmt(c) for c in s.output_norm_diffs))
    else:
        for side in ("input", "output"):
            cosines = getattr(s, f"{side}_cosines")
            notes = getattr(s, f"{side}_notes") or [""] * len(cosines)
            shown = [fmt(c) + _cosine_note(c, note) for c, note in zip(cosines, notes)]
            if len(shown) > _SHOWN:      # (a call on 142 gradients: the lowest is named)
                low = min(range(len(cosines)),
                          key=lambda k: cosines[k] if cosines[k] == cosines[k] else 2.0)
                shown = shown[:_SHOWN] + [f"... {len(shown) - _SHOWN} more, the lowest "
                                          f"{side} {low}: {shown[low]}"]
            lines.append(f"{side} cosines:{' ' if side == 'input' else ''} " +
                         (" ".join(shown) or "-"))
    reasons = [r for r in s.output_reasons if r]
    if reasons:
        more = f" | ... {len(reasons) - _SHOWN} more" if len(reasons) > _SHOWN else ""
        lines.append("diverges: " + " | ".join(reasons[:_SHOWN]) + more)
    # the role first: a narrow terminal cuts a title's end, and the role is what it says
    app.console.print(panel(escape("\n".join(lines)), title=escape(f"[{role}] {s.op_name} ({s.op_type})"),
                            title_align="left"))


# -- vc ---------------------------------------------------------------------------------------
@command("vc", "vector-compare", short_help="Compare every op of a step with the golden run.")
@LEFT
@RIGHT
@click.option("-g", "--graph", "graph_file", default=None, metavar="GRAPH",
              type=click.Path(dir_okay=False),
              help="The compiled graph JSON to map tensors with (default: the run's graph/).")
@WORKERS
@SCHEDULER
@click.option("-s", "--step", type=click.IntRange(0), default=None,
              help="The dumped step (default: the NPU run's first complete one).")
@criteria_options("-c")
def vector_compare_cmd(app: App, left, right, graph_file, workers, scheduler, step, cosine, norm,
                       flushed, rel_error):
    """Vector compare: map every dumped NPU tensor to its golden tensor (through fused ops,
    inserted Cast/TransData and 5HD), compute the metrics, judge each tensor on all of them
    (cosine, norm, values clipped at 65504, flushed to zero, nan/inf, the relative error of
    a scalar), write temp/vector_compare/<ts>/result_<ts>.csv with what it compared beside it
    (result_<ts>.json) and print the counts. A step dumped as statistics only is compared
    by its norms.

    Exit code 1 when an op diverges; 2 when a tensor could not be compared (a file missing
    or corrupt, no golden tensor): the counts are printed first."""
    npu = app.run(left, "npu")
    golden = app.reference(right, npu)
    step = app.step(npu, step)
    app.step(golden, step)
    criteria = _criteria(cosine, norm, flushed, rel_error)
    graph = None
    if graph_file is not None:
        from ..fileio import load_json
        from ..graph import GraphView
        graph = GraphView(check_compiled_graph(load_json(graph_file, WorkspaceError,
                                                         "compiled graph")), checked=True)
    with app.progress("comparing") as progress:
        table = analysis.compare_step(app.ws, npu, golden, step, threshold=criteria, graph=graph,
                                      progress=progress, workers=workers, scheduler=scheduler)
    report = analysis.CompareReport.of(table, npu.label, golden.label, step, criteria)
    try:
        report.result_file = analysis.write_result(
            app.ws, table, os.path.abspath(graph_file) if graph_file else None)
    except (WorkspaceError, OSError) as e:       # the compare is done: shown, said unsaved
        report.unsaved = analysis.write_failure(e)
    cov, diverging, path = report.coverage, report.diverging_ops, report.result_file

    def render():
        parts = ", ".join(f"{v} {k}" for k, v in sorted(report.verdicts.items()))
        app.line(f"{npu.label} against {golden.label}, step {step}: {report.rows} tensors ({parts})")
        app.line(f"{cov.text()}; {diverging} op(s) diverge")
        if path:
            app.line(f"result: {path}")
        if diverging and path:
            app.line(f"summary: {app.command('vcs')}")
        elif diverging:                    # no file for vcs to read: the first ones here
            for op in analysis.summarize(table, criteria, limit=10):
                app.line(f"  {op.op_name} ({op.op_type}): output cosine "
                         f"{', '.join(fmt(c) for c in op.output_cosines) or 'n/a'}"
                         + "".join(f"; {r}" for r in op.output_reasons if r))
    app.emit(report, render)
    if report.unsaved:
        raise CommandError(f"error: the compare's result was not saved: {report.unsaved} "
                           f"(--results-dir DIR writes it elsewhere)", EXIT_USAGE)
    if not cov.complete:
        raise _incomplete(f"the compare of step {step}", cov)
    return EXIT_FINDINGS if diverging else EXIT_OK


# -- report ------------------------------------------------------------------------------------
@command("report", "html-report", short_help="One self-contained HTML report with plots.")
@click.option("-o", "--output", default=None, metavar="FILE",
              help="Where to write it (default: <workspace>/report.html).")
@click.option("--heatmap-steps", type=click.IntRange(0), default=8, show_default=True,
              help="Dumped steps compared for the per-layer heatmap (0: none).")
@criteria_options("-c")
@LEFT
@RIGHT
@STEP
def report_cmd(app: App, output, heatmap_steps, cosine, norm, flushed, rel_error, left, right, step):
    """Write one HTML file (styles, script and plots inline: it opens from file:// or as a CI
    artifact): the verdict and what to try next, the per-op error along the step (1 - cosine
    and the relative norm difference, log scale, origin and first overflow marked, a tooltip
    per op, a filter by scope), the overflowed and skipped steps, the loss scale and the loss
    of the dumped steps, a heatmap of the worst cosine per layer over the dumped steps, the
    fusion summary, watchpoint hits and the repair's result. Drawn from ac -c's results.

    Exit codes as ac -c's: 1 with findings, 2 when the compare was incomplete or on input
    error."""
    from ..report import write_report
    npu = app.run(left, "npu")
    golden = app.reference(right, npu)
    if step is not None:
        app.step(npu, step)
        app.step(golden, step)
    app.info("comparing every op with the golden run...")
    path, data = write_report(app.ws, output, npu_run=npu, golden_run=golden, step=step,
                              criteria=_criteria(cosine, norm, flushed, rel_error),
                              heatmap_steps=heatmap_steps)
    from ..report import WrittenReport
    written = WrittenReport.of(path, data)
    check = data["auto_check"]
    app.emit(written, lambda: app.line(f"report: {path} ({check.verdict}, step {check.step})"))
    _raise_incomplete(check)
    return EXIT_FINDINGS if check.verdict == "findings" else EXIT_OK


# -- vcs --------------------------------------------------------------------------------------
@command("vcs", "vector-summary", short_help="The diverging ops of a compare, origin first.")
@click.option("-f", "--file", "files", multiple=True, metavar="CSV",
              help="Result file(s) of vc (default: the newest that compares the newest runs as "
                   "they are now; without any result, vc runs first).")
@criteria_options("-c")
@click.option("-l", "--limit", type=click.IntRange(0), default=3, show_default=True,
              help="Ops to show per file (0: all).")
@click.option("--by-cosine", is_flag=True, help="Worst cosine first instead of execution order.")
def vector_summary_cmd(app: App, files, cosine, norm, flushed, rel_error, limit, by_cosine):
    """Summary of a vector compare: the ops with a diverging output (under the cosine
    threshold, norms apart, clipped at 65504, flushed to zero, nan/inf: what decided is
    shown), in execution order (the origin of a divergence comes first) or by cosine, each
    with its golden ops, its fusion pass and its input and output cosines. Cancellation
    noise (an exact result of zero) is shown last. It says which runs and step the result
    compares; a result older than the runs it would summarise is refused unless named
    with -f.

    Exit code 1 when an op diverges; 0 when none does; 2 when the result is stale or its
    compare was incomplete."""
    criteria = _criteria(cosine, norm, flushed, rel_error)
    paths = list(files)
    if not paths:
        found = analysis.current_result(app.ws)
        if found is None:
            app.info("no compare result yet: running vc first")
            npu, golden = app.run(None, "npu"), app.run(None, "cpu")
            step = app.step(npu, None)
            app.step(golden, step)
            table = analysis.vector_compare(app.ws, npu, golden, step, threshold=criteria)
            paths = [analysis.write_result(app.ws, table)]
        else:
            paths = [found[0]]
    reports = []
    for path in paths:
        provenance = analysis.read_provenance(path)
        for label in (provenance.npu_run, provenance.golden_run) if provenance else ():
            try:                 # the runs it compares: their interrupted steps are named
                app.run(label, label.partition("/")[0])
            except WorkspaceError:
                pass             # gone: staleness says so below
        reports.append(analysis.summarize_result(app.ws, path, criteria, limit, by_cosine))

    def render():
        for rep in reports:
            app.line(rep.file)           # a line of its own: long, and copied whole
            app.line(rep.compares or "(no record of which runs and step it compares)")
            if rep.stale:
                app.warn(f"this result is out of date: {rep.stale}")
            app.line(f"{rep.diverging_ops} op(s) diverge"
                     + (" (statistics only: judged by the norms)" if rep.statistics_only else "")
                     + (f", origin {rep.origin}" if rep.origin else ""))
            if not rep.coverage.complete:
                app.warn(rep.coverage.text())
            for s in rep.ops:
                _render_op(app, s)
    app.emit(reports if len(reports) > 1 else reports[0], render)
    incomplete = next((r for r in reports if not r.coverage.complete), None)
    if incomplete is not None:
        raise _incomplete(f"the compare of {incomplete.file}", incomplete.coverage)
    stale = next((r for r in reports if r.stale), None)
    if stale is not None:
        raise CommandError(f"error: {stale.file} is out of date: {stale.stale}", EXIT_USAGE)
    return EXIT_FINDINGS if any(r.diverging_ops for r in reports) else EXIT_OK


# -- fo ---------------------------------------------------------------------------------------
@command("fo", "fusion-off", short_help="Replay a step with fusion off; bisect the passes.")
@click.option("-s", "--step", type=click.IntRange(0), default=None,
              help="The dumped step (default: the NPU run's first complete one).")
@LEFT
@RIGHT
@criteria_options("-c")
@click.option("--keep-replays", is_flag=True,
              help="Keep every replay run of the bisection (by default only the one with every "
                   "pass off stays, for vc to compare; the others take megabytes each).")
def fusion_off_cmd(app: App, step, left, right, cosine, norm, flushed, rel_error, keep_replays):
    """Replay the dumped step from its bundle with every fusion pass off (into the next
    npu/debug_<k>), compare both runs with the golden run and say whether fusion is to blame
    for a divergence or an overflow; if it is, bisect over the passes that fired to name the
    pass(es) and their fused nodes. A PyTorch script's run (torch-run) has no bundle: the
    script is rerun instead, its settings kept, its fused kernels (layer norm, softmax, GELU,
    matmul with bias) run as the ops they fuse, a few seconds per rerun.

    Exit code 1 when fusion is to blame."""
    npu = app.run(left, "npu")
    golden = app.reference(right, npu)
    step = app.step(npu, step)
    app.step(golden, step)
    script = npu.info.get("front_end") == "pytorch"
    app.info(f"{'rerunning the script of' if script else 'replaying'} step {step} of "
             f"{npu.label} with fusion off, then bisecting...")
    verdict = analysis.bisect_fusion(app.ws, npu, golden, step,
                                     _criteria(cosine, norm, flushed, rel_error), keep_replays)
    app.refresh()

    def render():
        if verdict.fusion_to_blame:
            lines = [f"Fusion is to blame: {len(verdict.new_failures)} failure(s) only with "
                     f"fusion on ({', '.join(verdict.new_failures[:3])}"
                     f"{', ...' if len(verdict.new_failures) > 3 else ''})."]
            lines += [f"{p}: {', '.join(verdict.fused_nodes.get(p, []))}" for p in verdict.culprits]
            if script:
                lines.append("Run the script with these passes off: torch-run --fusion-switch "
                             "FILE, FILE a fusion_switch.cfg: " + json.dumps(
                                 {"Switch": {"GraphFusion": {p: "off" for p in verdict.culprits}}}))
        elif verdict.unfused_failures:
            lines = [f"Fusion is not to blame: with every pass off the same "
                     f"{len(verdict.unfused_failures)} failure(s) remain.",
                     f"passes that fired: {', '.join(verdict.fired) or 'none'}"]
        else:
            lines = ["Fusion is not to blame: nothing diverges or overflows in this step with "
                     "an effect (as ac -c judges it), with fusion or without.",
                     f"passes that fired: {', '.join(verdict.fired) or 'none'}"]
        dropped = len(verdict.runs) - len(verdict.kept)
        lines.append(f"replays: {verdict.replays}; kept npu/{verdict.kept[0]} (every pass off: "
                     f"{app.command('vc -lt npu/' + verdict.kept[0])} compares it)"
                     + (f" and {', '.join(verdict.kept[1:])}" if len(verdict.kept) > 1 else "")
                     + (f"; the other {dropped} deleted (--keep-replays keeps them)"
                        if dropped else ""))
        app.console.print(panel(escape("\n".join(lines)), title="Fusion-off replay",
                                title_align="left"))
    app.emit(verdict, render)
    return EXIT_FINDINGS if verdict.fusion_to_blame else EXIT_OK
