"""`onnx`: a real model in. Import an ONNX model, run it on the golden executor and on the
simulated NPU after an ATC-like compile, dump both, and leave a workspace every command reads."""
from __future__ import annotations

import os

import click

from ..runtime.config import PRECISION_MODES
from .app import EXIT_FINDINGS, EXIT_OK, App, CommandError, command, fmt


def _pairs(values, what):
    """NAME=VALUE options -> {name: value}; the name is everything before the last '='."""
    out = {}
    for item in values:
        name, sep, value = item.rpartition("=")
        if not sep or not name or not value:
            raise CommandError(f"--{what} {item!r}: expected NAME={'FILE.npy' if what == 'input' else '1,3,224,224'}")
        if name in out:
            raise CommandError(f"--{what} {name} is given twice")
        out[name] = value
    return out


def _shape(text, name):
    try:
        dims = [int(d) for d in text.split(",")]
    except ValueError:
        dims = []
    if not dims or min(dims) < 1:
        raise CommandError(f"--shape {name}={text}: expected positive sizes such as 1,3,224,224")
    return dims


def _read_inputs(files):
    from ..dump.formats import read_tensor_file
    from ..dump.workspace import WorkspaceError
    arrays = {}
    for name, path in files.items():
        try:
            arrays[name] = read_tensor_file(path)      # allow_pickle=False, sizes checked
        except WorkspaceError as e:
            raise CommandError(f"--input {name}: {e}") from None
    return arrays


@command("onnx", "onnx-model", short_help="Import an ONNX model, run and dump it on both executors.")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("-i", "--input", "inputs", multiple=True, metavar="NAME=FILE.npy",
              help="Data for a model input (repeat per input). Inputs without data get "
                   "standard-normal values (--seed).")
@click.option("--shape", "shapes", multiple=True, metavar="NAME=DIMS",
              help="Fix an input's shape, e.g. x=1,3,48,192, where the model leaves dimensions "
                   "free (an --input file fixes it too).")
@click.option("-b", "--batch", type=click.IntRange(1), default=None,
              help="The size of a free first (batch) dimension  [default: 1]")
@click.option("-p", "--precision-mode", type=click.Choice(PRECISION_MODES), default="force_fp16",
              show_default=True, help="The NPU's precision mode (ATC's default is force_fp16).")
@click.option("--overflow-mode", type=click.Choice(["saturation", "inf_nan"]),
              default="saturation", show_default=True,
              help="What an fp16 overflow makes: 65504 with the status bit set (Ascend 910's "
                   "default), or inf/nan.")
@click.option("--fusion-switch", "fusion_switch", type=click.Path(dir_okay=False), default=None,
              metavar="FILE", help="A fusion_switch.cfg for the compile.")
@click.option("--fusion-off", is_flag=True, help="Compile with every fusion pass off.")
@click.option("--modify-mixlist", "mixlist", type=click.Path(dir_okay=False), default=None,
              metavar="FILE", help="A modify_mixlist JSON for the mixed-precision modes, as "
                                   "ATC's --modify_mixlist (fix writes one).")
@click.option("--reference", type=click.Choice(["onnxruntime"]), default=None,
              help="Also dump ONNX Runtime's value of every node as a second reference run "
                   "(cpu/debug_<k>, 'values from onnxruntime'), and check the golden executor "
                   "against it node by node.")
@click.option("--seed", type=int, default=0, show_default=True, help="For generated input data.")
@click.option("--fresh/--keep", default=True, show_default=True,
              help="Move an existing workspace aside first (renamed, never deleted).")
@click.option("-c", "--check", is_flag=True, help="Then run `ac -c` on the dumps (its exit code).")
@click.pass_context
def onnx_cmd(ctx, app: App, model, inputs, shapes, batch, precision_mode, overflow_mode,
             fusion_switch, fusion_off, mixlist, reference, seed, fresh, check):
    """Import MODEL (ONNX opsets 13 to 21; others through onnx's converter) and run it once as
    msit's compare does: on the golden executor (fp32), and on the simulated NPU after an
    ATC-like compile (graph and UB fusion, 5HD formats, the precision mode). Both runs are
    dumped as step 0, op names being the model's node names, so that ac, vc, vcs, fo, ni and
    fix work on them as on a training dump.

    A model with ops the importer does not cover is refused whole, listing every such op
    type with its count (exit 2).

    Exit code 0 when every model output matches the golden's by the default criteria, 1 when
    one diverges (with --check, ac's: 1 on findings); 2 on input error."""
    from ..onnx import load
    from ..onnx.job import dump_model
    from .jobs import fresh_workspace
    from ..fileio import load_json
    from ..runtime.npu.fusion import FusionSwitchError, enabled_passes
    from ..runtime import SessionConfig
    if fusion_off and fusion_switch:
        raise CommandError("give --fusion-switch or --fusion-off, not both")
    # read now: they may live in the workspace that --fresh moves aside
    switch = "off" if fusion_off else (
        load_json(fusion_switch, FusionSwitchError, "fusion switch file") if fusion_switch else None)
    enabled_passes(switch)                       # a bad switch fails before any work
    # and so does a mixlist naming no op type, or one the mode does not read
    mixlist = SessionConfig(precision_mode=precision_mode, modify_mixlist=mixlist).check_policy()
    files = _pairs(inputs, "input")
    arrays = _read_inputs(files)
    fixed = {name: _shape(text, name) for name, text in _pairs(shapes, "shape").items()}
    for name, arr in arrays.items():
        if name in fixed and list(arr.shape) != fixed[name]:
            raise CommandError(f"--input {name} holds shape {list(arr.shape)}, --shape says {fixed[name]}")
        fixed[name] = list(arr.shape)
    app.info(f"importing {model}...")
    imported = load(model, batch=batch, shapes=fixed)
    feeds = dict(arrays)
    generated = imported.random_feeds(seed)
    for name, tensor in imported.inputs.items():
        if name not in feeds:
            feeds[name] = generated[tensor]
            app.warn(f"no --input for {name}: standard-normal data of shape "
                     f"{list(tensor.shape)} (seed {seed})")
    unknown = sorted(set(feeds) - set(imported.inputs))
    if unknown:
        raise CommandError(f"--input {unknown[0]}: the model has no such input "
                           f"(inputs: {', '.join(imported.inputs)})")
    root = app.ws_root()
    with fresh_workspace(app, root, fresh):
        os.makedirs(root, exist_ok=True)
        result = dump_model(imported, root, feeds, precision_mode=precision_mode,
                            overflow_mode=overflow_mode, fusion_switch=switch,
                            modify_mixlist=mixlist, reference=reference, progress=app.info)
    app.refresh()
    from ..analysis.model_report import model_report
    report = model_report(model, imported, result, list(arrays), precision_mode)

    def render():
        app.line(f"{model}: opset {report.opset}, {report.ops} ops ({report.folded} nodes "
                 f"folded to constants), {report.weights} weights; inputs "
                 + ", ".join(f"{k} {shape}" for k, shape in report.inputs.items()))
        app.line(f"dumped step 0: {report.golden_run} (golden), {report.npu_run} "
                 f"(NPU, {precision_mode})"
                 + (f", {report.reference_run} (values from onnxruntime)"
                    if report.reference_run else ""))
        status = report.float_status
        app.line(f"NPU status word: {status:#x}" + (" (an overflow: see ac)" if status else " (no overflow)"))
        for o in report.outputs:
            app.line(f"output {o.name} {o.shape}: cosine similarity {fmt(o.cosine)}, "
                     f"max |error| {fmt(o.max_abs_error)}"
                     + (f" ({o.note})" if o.note else "")
                     + (f": {o.verdict} ({o.reason})" if o.verdict != "pass" else ""))
        if report.reference:
            r, worst = report.reference, report.reference["worst"]
            app.line(f"golden vs onnxruntime: {r['nodes']} node values, {r['over_1e-5']} with "
                     f"relative error over 1e-5"
                     + (f"; the largest {fmt(worst['rel_l2'], 3)} at {worst['node']}"
                        if worst else ""))
        diverging = report.diverging
        if not check:
            app.line(f"{len(diverging)} output(s) diverge ({', '.join(diverging)}): "
                     f"{app.command('ac -c')} finds where it starts" if diverging else
                     f"next: {app.command('ac -c')} compares every op")
    app.emit(report, render)
    if check:
        from .analyse import auto_check_cmd
        return ctx.invoke(auto_check_cmd, compare=True, step=0)
    return EXIT_FINDINGS if report.diverging else EXIT_OK

