"""`import` (`import-dump`): another tool's dump (msprobe's) made runs of the workspace, one
per rank, by reference (dump.imports does the work)."""
from __future__ import annotations

from dataclasses import dataclass

import click

from ..dump import layout
from ..dump.imports import summary
from .app import EXIT_OK, App, command


@dataclass
class Imported:
    runs: list

    def to_dict(self) -> dict:
        return {"runs": self.runs}


@command("import", "import-dump", short_help="Make an msprobe dump runs of the workspace.")
@click.argument("dump_dir", metavar="DUMP")
@click.option("--as", "target", default="npu", show_default=True, metavar="TARGET",
              help="The target its runs go to: npu (the run under test), cpu (the reference), "
                   "or a name of your own (gpu, a baseline: a reference).")
def import_cmd(app: App, dump_dir, target):
    """Make the msprobe dump DUMP (its root, a step<N> directory or one rank's directory)
    runs of the workspace: one per rank, each <TARGET>/debug_<k>, its run.json naming where
    the dump is (nothing is copied: keep the dump where it is). Importing it again names the
    runs made the first time. The commands then take the runs as they take their own
    (vc -lt npu/debug_0 -rt cpu/debug_0); vc, ac and the others also take a dump's directory
    directly and import it so."""
    try:
        layout.Target(target, layout.DEVICE)
    except layout.DumpConfigError as e:
        raise click.BadParameter(str(e), param_hint="--as") from None
    runs = app.imported(dump_dir, target)
    result = Imported([summary(r) for r in runs])

    def render():
        for r in result.runs:
            partial = f"; partial: {layout.format_steps(r['partial_steps'])}" \
                if r["partial_steps"] else ""
            app.line(f"{r['run']}  {r['rank']}  {r['task']} {r['level']} "
                     f"{r['framework']}  steps {layout.format_steps(r['steps']) or 'none'}"
                     f"{partial}")
    app.emit(result, render)
    return EXIT_OK
