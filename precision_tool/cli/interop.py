"""Dumps in and out: `import` (`import-dump`) makes another tool's dump (msprobe's) runs of
the workspace, one per rank, by reference (dump.imports); `export` (`export-dump`) writes a
run's steps in msprobe's layout (dump.export)."""
from __future__ import annotations

from dataclasses import dataclass

import click

from ..dump import layout
from ..dump.export import export_msprobe
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


@dataclass
class Exported:
    run: str
    path: str
    steps: list
    calls: int
    tensors: int
    bytes: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@command("export", "export-dump", short_help="Write a run's steps as an msprobe dump.")
@click.option("-o", "--output", required=True, metavar="DIR",
              help="The msprobe dump to make (step<N>/rank<R>/...); it must not exist yet.")
@click.option("-r", "--run", "run_spec", default=None, metavar="RUN",
              help="npu/debug_0, cpu/debug_0, debug_0 or a run directory (default: the newest "
                   "NPU run).")
@click.option("-s", "--step", "steps", default="all", show_default=True, metavar="STEPS",
              help='The dumped steps to write: "all", "0", "0|3-5".')
@click.option("--rank", type=click.IntRange(0), default=0, show_default=True,
              help="The rank directory it goes to (rank<R>).")
def export_cmd(app: App, output, run_spec, steps, rank):
    """Write a run's dumped steps in msprobe's layout (dump.json, stack.json, construct.json,
    dump_tensor_data/*.pt as torch.save writes them), so that msprobe's compare and other
    tools read them: `msprobe compare -tp OUT/step0 -gp GOLDEN_OUT/step0`. A graph's op
    becomes the call <OpType>.<op name>.0.forward, a script's keeps its name; NPU tensors in
    NC1HWC0 are written in NCHW. Written beside DIR and renamed when whole."""
    run = app.run(run_spec, "npu")
    try:
        wanted = layout.parse_steps(steps)
    except layout.DumpConfigError as e:
        raise click.BadParameter(str(e), param_hint="--step") from None
    chosen = None if wanted is None else sorted(wanted)
    with app.progress(f"exporting {run.label}") as progress:
        done = export_msprobe(app.ws, run, output, chosen, rank, progress)
    result = Exported(run.label, done["path"], done["steps"], done["calls"], done["tensors"],
                      done["bytes"])

    def render():
        app.line(f"{result.path}: {run.label}, steps {layout.format_steps(result.steps)}, "
                 f"{result.calls} calls, {result.tensors} tensor files "
                 f"({result.bytes / 2 ** 20:.1f} MiB)")
    app.emit(result, render)
    return EXIT_OK
