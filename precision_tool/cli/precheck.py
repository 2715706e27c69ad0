"""`check` (pre-training checks on a workspace or a script) and `wp` (the watchpoint hits a
training run recorded)."""
from __future__ import annotations

import os

import click
from rich.markup import escape
from rich.table import Table

from ..analysis.replays import checks as checking
from ..analysis.replays.script_checks import is_script_run
from ..dump import layout, watch
from ..runtime.config import AMP_LEVELS, PRECISION_MODES
from .app import EXIT_FINDINGS, EXIT_OK, App, command
from .runner import run_script

SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "dim"}


@command("check", "pre-check", short_help="Pre-training checks: data, hyperparameters, graph, init.",
         context_settings={"ignore_unknown_options": True})
@click.option("-r", "--run", "run_label", default=None, metavar="RUN",
              help="The run whose replay bundle is checked (default: the newest NPU run with "
                   "one, else the newest golden run).")
@click.option("-s", "--step", type=click.IntRange(0), default=None,
              help="The bundled step (default: the run's first).")
@click.option("-g", "--golden-steps", type=click.IntRange(1), default=3, show_default=True,
              help="Golden steps replayed from the bundle for the checks that train.")
@click.option("--precision-mode", type=click.Choice(PRECISION_MODES + AMP_LEVELS), default=None,
              help="The policy the fp16 checks assume (default: the NPU run's own; "
                   "allow_mix_precision for a golden run).")
@click.option("--only", multiple=True, type=click.Choice(sorted(checking.CHECKS)),
              help="Run only these checks (repeatable).")
@click.option("--diff", nargs=2, default=None, metavar="RUN RUN",
              help="List every configuration difference between two runs instead.")
@click.argument("script", nargs=-1, type=click.UNPROCESSED)
def check_cmd(app: App, run_label, step, golden_steps, precision_mode, only, diff, script):
    """Check what is not the NPU before (or instead of) a long training run: the data (nan/inf,
    labels against the classes, magnitudes against fp16), the hyperparameters (epsilons and
    learning rates fp16 cannot hold, the loss scale against the mode and the gradients, an
    update larger than its weights), the API (BatchNorm in inference mode while training),
    the graph (variables never updated, golden values beyond fp16 in ops the policy puts in
    fp16), the initialisation (all zero, constant, a scale off the fan-in) and determinism
    (two golden replays bit for bit). Each finding has its evidence and its fix.

    On a workspace, the checks read a run's replay bundle; a PyTorch script's run (torch-run)
    has none, and the checks its dumped steps answer read them instead (its golden run's
    inputs and weights over its consecutive dumped steps, the NPU run's fp16 calls). With a script
    (check -- python train.py), the script runs with step 0 dumped and stops once it is
    written, then its run is checked. With --diff RUN RUN, the configuration differences of
    two runs are listed.

    Exit code 1 when a finding has error severity (or, with --diff, the runs differ); 0
    otherwise; 2 on input error."""
    if diff:
        return _diff(app, *diff)
    if script:
        new = run_script(app, app.ws_root(), {
            layout.ENV_NPU_ACTION: "dump", layout.ENV_CPU_ACTION: "dump",
            layout.ENV_DUMP_STEP: "0", layout.ENV_DUMP_DATA: "stats",
            layout.ENV_STOP_AFTER_DUMP: "1"}, script)
        app.refresh()
        parent, name = os.path.split(new[0])
        run = app.ws.run(os.path.basename(parent), name)
    elif run_label is not None:
        run = app.run(run_label, "npu")
    else:
        ws = app.ws
        # a run with a replay bundle, else a PyTorch script's run (its dumped steps)
        newest = [[r for r in ws.runs(target) if (r.bundles or is_script_run(r))
                   and not r.info.get("replay_of") and r.complete_steps]
                  for target in ("npu", "cpu")]
        checkable = newest[0] or newest[1]
        if not checkable:
            raise checking.CheckError(f"no run in {ws.root} has a replay bundle or is a "
                                      f"PyTorch script's: dump a step (npu-dump or cpu-dump, "
                                      f"or torch-run), or give a script: check -- python "
                                      f"train.py")
        run = app.noting(checkable[-1])
    app.info(f"checking {run.label}...")
    with app.progress("golden steps") as progress:
        report = checking.run_checks(app.ws, run, step, golden_steps, precision_mode, only,
                                     progress)

    def render():
        how = "dumped" if is_script_run(run) else "replayed"
        app.line(f"{report.run} step {report.step}, {report.golden_steps} golden step(s) "
                 f"{how}, precision mode {report.precision_mode}: {len(report.checks)} checks")
        for note in report.notes:
            app.line(note)
        if not report.findings:
            app.line("no finding")
            return
        table = Table(show_lines=True)
        for col in ("severity", "check", "finding", "fix"):
            table.add_column(col, overflow="fold")
        for f in report.findings:
            table.add_row(f"[{SEVERITY_STYLE[f.severity]}]{f.severity}[/]", f.check,
                          escape(f.message), escape(f.fix))
        app.console.print(table)
    app.emit(report, render)
    return EXIT_FINDINGS if report.errors else EXIT_OK


def _diff(app: App, left: str, right: str) -> int:
    a, b = app.run(left, "npu"), app.run(right, "npu")
    found = checking.config_diff(app.ws, a, b)
    diffs = found.differences

    def render():
        if not diffs:
            app.line(f"{a.label} and {b.label}: no configuration difference")
            return
        table = Table(title=f"{a.label} against {b.label}")
        for col in ("what", a.label, b.label):
            table.add_column(col, overflow="fold")
        for d in diffs:
            table.add_row(escape(d["what"]), escape(str(d["left"])), escape(str(d["right"])))
        app.console.print(table)
    app.emit(found, render)
    return EXIT_FINDINGS if diffs else EXIT_OK


@command("wp", "watchpoints", short_help="The watchpoint hits of training runs, first hit first.")
@click.option("-a", "--all", "every", is_flag=True, help="Every hit, not only each condition's first.")
@click.option("-l", "--limit", type=click.IntRange(0), default=0, show_default=True,
              help="Hits to show (0: all).")
def watchpoints_cmd(app: App, every, limit):
    """The hits the training watchpoints recorded (hooks.watch, WatchpointCallback) in
    <workspace>/watch/hits.csv: per condition and session its first hit, with how many
    followed, the earliest first; with -a every hit in order.

    Exit code 1 when there is a hit; 0 when none was recorded."""
    root = app.ws_root()
    found = watch.watch_hits(root, every, limit)
    hits, shown = found.hits, found.shown

    def render():
        if not hits:
            app.line(f"no watchpoint hit in {root} (watch a run with hooks.watch(config) or "
                     f"trainer.WatchpointCallback())")
            return
        table = Table(title=f"{hits} hit(s) in {os.path.join(root, watch.WATCH_DIR, watch.HITS_FILE)}")
        for col in ("step", "condition", "what", "session") + (() if every else ("hits",)):
            table.add_column(col, overflow="fold")
        for h in shown:
            row = [str(h["step"]), h["condition"], escape(h["message"]), escape(h["session"])]
            if not every:
                row.append(f"{h['count']} (to step {h['last_step']})")
            table.add_row(*row)
        app.console.print(table)
    app.emit(found, render)
    return EXIT_FINDINGS if hits else EXIT_OK
