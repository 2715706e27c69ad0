"""`torch-run`: a PyTorch training script run unchanged on the golden, the simulated NPU or
both (precision_tool.torch.run in a child process each), into one workspace."""
from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import asdict, dataclass
from typing import List

import click

from ..analysis.diagnosis.scale_history import loss_scale_history
from ..dump import layout
from ..errors import PrecisionToolError
from ..runtime.config import OVERFLOW_MODES, PRECISION_MODES
from ..runtime.npu.fusion import enabled_passes, switch_for
from .app import EXIT_OK, App, CommandError, command
from ..torch.fixfile import read_fix
from ..torch.run import ENV, ENV_SEED
from .runner import script_runs

TARGETS = {"golden": ["golden"], "npu": ["npu"], "both": ["golden", "npu"]}


# how torch-run and ac name the kernels the NPU's run computed as torch does, in the
# script's dtype (an op the precision policy does not classify)
NOT_SIMULATED = "not simulated on the NPU (computed as on the CPU, in the script's dtype): "


@dataclass
class TorchRuns:
    """What torch-run wrote: the script, each target's run (label) in the order run, and
    the kernels the NPU's run did not simulate (run.json's not_simulated)."""
    script: List[str]
    runs: List[str]
    not_simulated: List[str]

    def to_dict(self) -> dict:
        return asdict(self)


@command("torch-run", "torch-run", short_help="Run a PyTorch training script on the golden, "
                                               "the simulated NPU, or both.",
         context_settings={"ignore_unknown_options": True})
@click.option("--target", type=click.Choice(sorted(TARGETS)), default="both", show_default=True,
              help="golden: the script as written (fp32 on CPU); npu: every kernel through "
                   "the simulated NPU's precision policy; both: golden, then npu, same seed.")
@click.option("--precision-mode", type=click.Choice(PRECISION_MODES),
              default="allow_mix_precision", show_default=True)
@click.option("--overflow-mode", type=click.Choice(OVERFLOW_MODES), default="saturation",
              show_default=True)
@click.option("--dump-step", default="0", show_default=True,
              help='Optimizer steps to dump: "0|5|10", "0|3-5" or "all".')
@click.option("--dump-mode", type=click.Choice(["tensor", "statistics"]), default="tensor",
              show_default=True, help="Tensor files, or the index's statistics only.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seeds random, numpy and torch before the script runs.")
@click.option("--keep-fp32", "keep_fp32", default=None, metavar="NAMES",
              help="NPU only: APIs (Torch.matmul, Functional.softmax) or module paths "
                   "(encoder.layer.0.attention) whose calls, forward and backward, compute "
                   "in fp32; comma-separated.")
@click.option("--golden-dtype", type=click.Choice(["float32", "float64"]), default="float32",
              show_default=True,
              help="float64: the golden computes every call in float64 (what the script "
                   "creates, and its parameters, keep their dtype): what float32 itself "
                   "loses is then seen too.")
@click.option("--fusion-switch", "fusion_switch", type=click.Path(dir_okay=False), default=None,
              help="NPU only: a fusion_switch.cfg saying which fusion passes are on; a fused "
                   "kernel (layer norm, softmax, GELU, matmul with bias) whose pass is off "
                   "runs as the ops it fuses.")
@click.option("--fusion-off", is_flag=True,
              help="NPU only: every fusion pass off (what fo reruns the script with).")
@click.option("--fix", "fix_file", type=click.Path(dir_okay=False), default=None,
              help="Apply what fix wrote (config/fix.json): its precision mode, the calls "
                   "it keeps in fp32 and the fusion passes it switches off.")
@click.option("--golden-skips-as-npu", "skips_as_npu", is_flag=True,
              help="With --target both: the NPU runs first, and the golden skips the updates "
                   "the NPU's loss scale skipped (GradScaler finds an overflow there), so that "
                   "the steps after a skip start from the same state in both runs and can be "
                   "judged (run.json says which steps the golden skipped).")
@click.argument("script", nargs=-1, required=True, type=click.UNPROCESSED)
def torch_run_cmd(app: App, target, precision_mode, overflow_mode, dump_step, dump_mode, seed,
                  keep_fp32, golden_dtype, fusion_switch, fusion_off, fix_file, skips_as_npu,
                  script):
    """Run SCRIPT (python train.py ARGS, or train.py ARGS) with no change to it: every API
    call of its training steps (an optimizer step ends a step, or GradScaler's update; in a
    script that neither steps nor calls backward, each forward of its model is a step)
    dumped under msprobe's names
    (Functional.linear.0.forward, ...backward), into npu/ and cpu/ runs every command reads
    (ac -c, vc, vcs, ni, pt...). The script's output, traceback and exit code pass through;
    what it dumped before it failed is kept, the step it was in is not.

    Exit code: the script's when it fails (128 + the signal's number when a signal killed
    it, as a shell reports it); 2 for a setting or fix file that cannot be used; 0
    otherwise."""
    layout.parse_steps(dump_step)            # a bad value before anything runs
    if fusion_off and fusion_switch:
        raise click.UsageError("give --fusion-switch or --fusion-off, not both")
    if skips_as_npu and target != "both":
        raise click.UsageError("--golden-skips-as-npu needs --target both: the golden follows "
                               "the NPU run it is made with")
    if fusion_switch is not None:
        enabled_passes(fusion_switch)        # a file that cannot be used, before any run
        fusion_switch = os.path.abspath(fusion_switch)
    if fix_file is not None:
        fixed = read_fix(fix_file)
        precision_mode = fixed.get("precision_mode", precision_mode)
        keep_fp32 = ",".join([*(keep_fp32.split(",") if keep_fp32 else []),
                              *fixed.get("keep_fp32", [])]) or None
        fix_off = fixed.get("fusion_off", [])
        app.info(f"applying {fix_file}: precision mode {precision_mode}"
                 + (f", kept in fp32: {keep_fp32}" if keep_fp32 else "")
                 + (f", fusion passes off: {', '.join(fix_off)}" if fix_off else ""))
    else:
        fix_off = []
    fusion = "off" if fusion_off else fusion_switch
    if fix_off and not fusion_off:      # the fix's passes off, on top of any switch given
        fusion = json.dumps(switch_for(set(enabled_passes(fusion_switch)) - set(fix_off)))
    args = list(script)
    if args and os.path.basename(args[0]).startswith("python"):
        args = args[1:]
    if not args:
        raise click.UsageError("give the script to run: torch-run -- python train.py")
    root = app.ws_root()
    runs = []
    distributed = bool(os.environ.get("RANK"))
    skips = None
    order = ["npu", "golden"] if skips_as_npu else TARGETS[target]
    for k, which in enumerate(order):
        settings = {ENV["target"]: which, ENV["precision_mode"]: precision_mode,
                    ENV["overflow_mode"]: overflow_mode, ENV["dump_step"]: dump_step,
                    ENV["dump_mode"]: dump_mode, ENV_SEED: str(seed),
                    ENV["keep_fp32"]: keep_fp32 if which == "npu" else None,
                    ENV["golden_dtype"]: golden_dtype if which == "golden" else None,
                    ENV["fusion_switch"]: fusion if which == "npu" else None,
                    ENV["skip_steps"]: skips if which == "golden" else None,
                    # under torchrun: the script's process is this one's child, so the
                    # ranks' shared launch is this process's
                    layout.ENV_RANK_GROUP: layout.launch_group() if distributed else None}
        if distributed and k:
            # under torchrun, each target's pass is a process group of its own: a second
            # rendezvous in the agent's store would find the first pass's keys, so the
            # second meets on a store of its own, on the next port
            settings.update(MASTER_PORT=str(int(os.environ.get("MASTER_PORT", "29500")) + k),
                            TORCHELASTIC_USE_AGENT_STORE="False")
        app.info(f"running {' '.join(args)} on the {which} (seed {seed})...")
        rc, made = script_runs(app, root, settings,
                               [sys.executable, "-m", "precision_tool.torch.run", *args])
        runs += ["/".join(os.path.normpath(p).split(os.sep)[-2:]) for p in made]
        if rc != 0:
            # a signal's death is -N here; exit statuses are 8 bits: the shell's 128 + N
            how, code = (f"was killed by {_signal_name(-rc)} (status {rc})", 128 - rc) \
                if rc < 0 else (f"exited with status {rc}", rc)
            raise CommandError(f"error: the script {how} on the {which}"
                               + (f"; kept: {_kept(app, runs)}" if runs else "")
                               + (f"; not run on the {' or '.join(order[k + 1:])}"
                                  if order[k + 1:] else ""), code)
        if skips_as_npu and which == "npu":
            skipped = _skipped(app, made)
            skips = ",".join(map(str, skipped)) or None
            app.info(f"the golden skips the updates of step(s) {layout.format_steps(skipped)}, "
                     f"as the NPU's loss scale did" if skipped else
                     "the NPU's loss scale skipped no update: the golden runs as written")
    app.refresh()
    unsimulated = sorted({k for label in runs if label.startswith("npu/")
                          for k in app.ws.run(*label.split("/", 1)).info.get("not_simulated")
                          or ()})
    result = TorchRuns(args, runs, unsimulated)

    def show():
        if unsimulated:
            app.line(NOT_SIMULATED + ", ".join(unsimulated))
        app.line(f"dumped: {', '.join(runs)}; next: {app.command('ac -c')} compares them")
    app.emit(result, show)
    return EXIT_OK


def _skipped(app: App, made: List[str]) -> List[int]:
    """The steps whose update the loss scale of the runs just made skipped."""
    app.refresh()                    # the run was just written
    ws = app.ws
    out = set()
    for path in made:
        run = ws.run(*os.path.normpath(path).split(os.sep)[-2:])
        out.update(loss_scale_history(ws, run).skipped_steps)
    return sorted(out)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:              # a real-time signal has no name of its own
        return f"signal {number}"


def _kept(app: App, runs: List[str]) -> str:
    """The runs a failed script left, each with its steps complete and left partial."""
    ws = app.ws.reopened()
    out = []
    for label in runs:
        target, name = label.split("/", 1)
        try:
            run = ws.run(target, name)
        except PrecisionToolError:        # unreadable: named as it is
            out.append(label)
            continue
        said = []
        if run.complete_steps:
            said.append(f"step(s) {', '.join(map(str, run.complete_steps))} complete")
        if run.interrupted:
            said.append(f"step(s) {', '.join(map(str, run.interrupted))} partial")
        failed = run.info.get("script_failed")
        if isinstance(failed, dict) and failed.get("step") is not None:
            step = failed["step"]
            said.append(f"it ended in step {step}" + (
                "" if step in run.interrupted or step in run.complete_steps else ", not dumped"))
        out.append(f"{label} ({'; '.join(said) or 'no step complete'})")
    return ", ".join(out)
