"""The script runner: run an unchanged training script with the dump hooks switched on
through the environment, as Ascend's npu_dump / npu_overflow / tf_dump do."""
from __future__ import annotations

import os
import sys

import click

from ..dump import layout
from ..dump.scriptrun import run_dumping
from .app import EXIT_USAGE, CommandError, echo

EXIT_FINDINGS = 1

RUNNERS = {
    # name: (environment variable, action, help)
    "npu-dump": (layout.ENV_NPU_ACTION, "dump",
                 "Dump the NPU run's kernels (inputs, outputs, statistics) and replay bundles."),
    "npu-overflow": (layout.ENV_NPU_ACTION, "overflow",
                     "Check every step for overflow; dump only the overflowing kernels."),
    "cpu-dump": (layout.ENV_CPU_ACTION, "dump",
                 "Dump the golden (CPU) run of a session wrapped by hooks.sess_dump."),
}
SHORT = {"npu-dump": "Run a training script dumping the NPU run.",
         "npu-overflow": "Run a training script checking every step for overflow.",
         "cpu-dump": "Run a training script dumping the golden run."}
ALIASES = {"npu_dump": "npu-dump", "npu_overflow": "npu-overflow", "tf_dump": "cpu-dump"}


def _command(script) -> list:
    """The command to run: a .py file named first runs with this Python (users type
    `npu-dump train.py` as often as `npu-dump python train.py`)."""
    script = list(script)
    if script[0].endswith(".py") and os.path.isfile(script[0]):
        return [sys.executable] + script
    return script


def script_runs(app, root: str, settings: dict, command: list) -> tuple:
    """Run the command with `settings` (variable -> value, None left unset) in its
    environment and the workspace at root: (its exit code, the run directories its dumps
    named in the runner's file, in order). With --json its output goes to stderr."""
    try:             # with --json, stdout is the summary's: the script's output goes to stderr
        return run_dumping(root, settings, command,
                           stdout=sys.stderr.fileno() if app.as_json else None)
    except OSError as e:
        raise click.UsageError(f"cannot run {command[0]!r}: {e.strerror}") from None


def run_script(app, root: str, settings: dict, script) -> list:
    """Run the script with the hooks' environment (`settings`: variable -> value, None left
    unset) and the workspace at root; the run directories its dumps wrote, in order. A
    script that fails, or dumps nothing, is a one-line error."""
    command = _command(script)
    shown = " ".join(f"{k}={v}" for k, v in settings.items() if v is not None and "ACTION" in k)
    click.echo(f"running {' '.join(command)} with {shown}", err=True)
    rc, new = script_runs(app, root, settings, command)
    if rc != 0:
        raise CommandError(f"error: the script exited with status {rc}")
    if not new:
        raise CommandError(f"error: the script wrote no dump into {root}: does it use "
                           f"precision_tool.hooks (session_dump_config / sess_dump)?")
    return new


def make_runner(name: str):
    env_var, action, help_text = RUNNERS[name]

    @click.command(name=name, short_help=SHORT[name], help=f"{help_text}\n\nRuns SCRIPT... (e.g. python train.py, or "
                                   f"train.py, which runs with this Python) with the hooks of "
                                   f"precision_tool.hooks switched on.",
                   context_settings={"ignore_unknown_options": True})
    @click.option("--dump-step", default=None, help='Steps to dump: "0|5|10" or "0|3-5|10" '
                                                     '(default: 0; every step for npu-overflow).')
    @click.option("--dump-mode", type=click.Choice(layout.DUMP_MODES), default=None,
                  help="Which tensors of each op (default: all).")
    @click.option("--dump-data", type=click.Choice(layout.DUMP_DATA), default=None,
                  help="tensor files, or stats (index rows only). Default: tensor.")
    @click.option("--fusion-off", is_flag=True, hidden=env_var != layout.ENV_NPU_ACTION,
                  help="Also switch every fusion pass off.")
    @click.argument("script", nargs=-1, required=True, type=click.UNPROCESSED)
    @click.pass_context
    def runner(ctx, dump_step, dump_mode, dump_data, fusion_off, script):
        root = ctx.obj.ws_root()
        if dump_step is not None:
            layout.parse_steps(dump_step)        # refuse a bad value before running anything
        app = ctx.obj
        env = {env_var: action + ("|fusion_off" if fusion_off and env_var == layout.ENV_NPU_ACTION
                                  else ""),
               layout.ENV_DUMP_STEP: dump_step, layout.ENV_DUMP_MODE: dump_mode,
               layout.ENV_DUMP_DATA: dump_data}
        new = run_script(app, root, env, script)
        from ..analysis.diagnosis.overflow import script_dumps
        summary = script_dumps(action, new)
        overflowing = summary.overflowing_kernels

        def render():
            for r in summary.runs:
                echo(f"{r.run}: steps {r.steps} dumped"
                     + (f", {r.overflowing_kernels} overflowing kernel(s)"
                        if action == "overflow" else "")
                     + (f"; step(s) {r.interrupted} interrupted" if r.interrupted else "")
                     + (f"; the dump stopped at step {r.dump_stopped['step']}: "
                        f"{r.dump_stopped['error']}" if r.dump_stopped else ""))
            if action == "overflow":
                echo(f"overflow found: {overflowing} kernel(s); their records and tensors "
                           f"are in {root}" if overflowing else "no overflow")
        app.emit(summary, render)
        stopped = summary.stopped
        if stopped:          # the script ran to its end; its dump did not: not a whole job
            raise CommandError(f"error: the dump of {', '.join(stopped)} stopped before the "
                               f"script's last step (see above); what is on disk reads",
                               EXIT_USAGE)
        if action == "overflow" and overflowing:
            ctx.exit(EXIT_FINDINGS)
    return runner
