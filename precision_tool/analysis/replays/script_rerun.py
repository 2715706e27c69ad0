"""A PyTorch script's run made again: the script torch-run ran, rerun by the same runner in a
child process, on the simulated NPU with the run's own settings but for what a caller
changes (fix: the calls kept in fp32; fo: the fusion passes), its analysed step dumped. A
script's step is the script's own loop body, which nothing here can call on its own, so a
rerun of the script is the one way to run it again. Needs no torch."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from ...dump import Workspace
from ...dump.run import Run
from ...dump.scriptrun import run_dumping
from ...errors import PrecisionToolError
from ...fileio import write_text_atomic
from ...runtime.npu.fusion import switch_for
from ...torch.run import ENV, ENV_SEED


class ScriptRerunError(PrecisionToolError, ValueError):
    """A script's run that cannot be rerun (not made by torch-run)."""


def rerun_script(ws: Workspace, npu: Run, step: int, **changes) -> tuple:
    """One rerun of the script `npu` was made by (torch-run's runner, the NPU target, with
    npu's seed, overflow mode, precision mode, calls kept in fp32 and fusion passes unless
    `changes` say otherwise: precision_mode, keep_fp32 (a list), fusion_passes (a set)),
    dumping `step` into the next npu/debug_<k>. Returns (the run, or None; why not; every
    run directory it wrote)."""
    info = npu.info
    if not info.get("script"):
        raise ScriptRerunError(f"{npu.label} was not made by torch-run (its run.json names no "
                                f"script): this reruns the script; run it with "
                                f"precision-tool torch-run")
    keep = changes.get("keep_fp32", info.get("keep_fp32") or [])
    passes = changes.get("fusion_passes", info.get("fusion_passes"))
    settings = {ENV["target"]: "npu", ENV["overflow_mode"]: info.get("overflow_mode"),
                ENV["dump_step"]: str(step), ENV["dump_mode"]: "tensor",
                ENV_SEED: str(info.get("seed", 0)),
                ENV["precision_mode"]: changes.get("precision_mode",
                                                   info.get("precision_mode")),
                ENV["keep_fp32"]: ",".join(keep) or None, ENV["replay_of"]: npu.label}
    # (passes None: a run from before fused kernels, every pass on)
    switch = switch_for(set(passes)) if passes is not None else None
    return _run_script(ws, npu, "npu", [step], settings, switch)


def _run_script(ws: Workspace, npu: Run, target: str, steps, settings: dict,
                switch=None) -> tuple:
    """The script `npu` was made by, run again by the runner in a child process with
    `settings` (and `switch` as its fusion_switch.cfg), `steps` dumped into a run of
    `target`: (the run, or None; why not; every run directory it wrote)."""
    info = npu.info
    cwd = info.get("cwd") if os.path.isdir(str(info.get("cwd"))) else None
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile() as err:
        if switch is not None:
            path = os.path.join(tmp, "fusion_switch.cfg")
            write_text_atomic(path, json.dumps(switch))
            settings = dict(settings, **{ENV["fusion_switch"]: path})
        rc, runs = run_dumping(ws.results_dir(), settings,
                               [sys.executable, "-m", "precision_tool.torch.run",
                                *info["script"]], stdout=subprocess.DEVNULL, stderr=err,
                               cwd=cwd)
        if rc != 0 or not runs:
            err.seek(0)
            tail = [line for line in err.read().decode("utf-8", "replace").splitlines()
                    if line.strip()][-1:]
            why = f"the script exited with status {rc}" + \
                (f": {tail[0]}" if tail else "") if rc else "the script dumped nothing"
            return None, why, runs
    ws = ws.reopened()
    run = ws.run(target, os.path.basename(os.path.normpath(runs[-1])))
    missing = [k for k in steps if k not in run.complete_steps]
    if missing:
        return None, _stopped_early(ws, npu, run, missing[0]), runs
    return run, "", runs


def why_no_state_replay(npu: Run) -> str:
    """Why no step of `npu` can be replayed on the golden from its state ("" when one can):
    it needs the script (a run torch-run made) and the state's values (a tensor dump)."""
    info = npu.info
    if not info.get("script"):
        return f"{npu.label} was not made by torch-run: no script to rerun"
    if info.get("dump_data") != "tensor":
        return (f"{npu.label} is a statistics dump: its state has no values to start the "
                f"golden from")
    return ""


def golden_from_npu_state(ws: Workspace, npu: Run, golden: Run, steps,
                          on_progress=None) -> tuple:
    """The golden run of `steps` (a list) each started from the NPU run's state
    (torch.state): one made before that holds them all, or one rerun of the script on the
    golden (golden's dtype and skipped steps, npu's seed) that sets the NPU's values where
    each of them begins and ends after the last. Returns (the run, or None; why not).
    on_progress(text): told before a rerun."""
    steps = sorted(set(steps))
    where = os.path.realpath(npu.path)
    for r in ws.runs("cpu"):
        made = r.info.get("state_from") or {}
        had = made.get("steps") or [made.get("step")]      # (a run of one step said "step")
        if os.path.realpath(str(made.get("run"))) == where and \
                set(steps) <= set(had) & set(r.complete_steps):
            return r, ""
    why = why_no_state_replay(npu)
    if why:
        return None, why
    skips = golden.info.get("skips_as_npu") or []
    listed = ",".join(map(str, steps))
    settings = {ENV["target"]: "golden", ENV["dump_step"]: listed.replace(",", "|"),
                ENV["dump_mode"]: "tensor", ENV_SEED: str(npu.info.get("seed", 0)),
                ENV["golden_dtype"]: golden.info.get("golden_dtype") or None,
                ENV["skip_steps"]: ",".join(str(k) for k in skips) or None,
                ENV["state_from"]: f"{npu.path}:{listed}", ENV["replay_of"]: npu.label}
    if on_progress is not None:
        on_progress(f"step {steps[0]} starts from drifted state: rerunning the script on the "
                    f"golden from the NPU's state at step {steps[0]}..." if len(steps) == 1 else
                    f"steps {', '.join(map(str, steps))} start from drifted state: rerunning "
                    f"the script once on the golden, each of them from the NPU's state...")
    run, why, runs = _run_script(ws, npu, "cpu", steps, settings)
    if run is None:
        for made in runs:
            shutil.rmtree(made, ignore_errors=True)
        return None, f"its rerun failed: {why}"
    return run, ""


def _stopped_early(ws: Workspace, npu: Run, rerun: Run, step: int) -> str:
    """Why a rerun that exited 0 holds no dump of `step`: how far it got beside the run it
    reran (their step histories), or, failing those, what it dumped."""
    def last(run):
        try:
            history = ws.step_history(run)
        except (PrecisionToolError, OSError, ValueError):
            return None
        return int(history.step.max()) if len(history) else None
    got, had = last(rerun), last(npu)
    if got is not None and got < step:
        return (f"the rerun ended after step {got}, before step {step}" +
                (f" (the run it reran went to step {had})" if had is not None else "") +
                ": the script ran fewer steps this time; if it reads its step count or data "
                "from the environment or a file, run this where those are as they were")
    return f"the rerun dumped no step {step}"
