"""The commands that run something: `train` replays a dumped step on a chosen target and
action, `demo` is the main job (train, dump both runs, auto check), `clean` deletes what
replays and compares left behind."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Optional

import click

from ..dump import hooks
from ..dump import housekeeping
from ..runtime.config import SessionConfig
from .app import EXIT_FINDINGS, EXIT_OK, App, command


@command("train", "replay", short_help="Replay a dumped step on the NPU, the golden, or both.")
@click.option("-d", "--device", type=click.Choice(["all", "npu", "cpu"]), default="all", show_default=True,
              help="Where to rerun the step.")
@click.option("-a", "--action", type=click.Choice(["dump", "overflow", "fusion_off"]), default="dump",
              show_default=True, help="dump: dump it again; overflow: the overflow check (exit 1 "
                                      "when a kernel overflows); fusion_off: dump it with every "
                                      "fusion pass off (NPU).")
@click.option("-s", "--step", type=click.IntRange(0), default=None,
              help="The dumped step (default: the first with a replay bundle).")
def replay_cmd(app: App, device, action, step):
    """Rerun a dumped step from its replay bundle (graph, variables and feeds as they were),
    without the training script, into new npu/ and cpu/ debug_<k> runs."""
    from ..analysis.replays.rerun import rerun_step
    npu = app.run(None, "npu")
    result = rerun_step(app.ws, npu, step, ["npu", "cpu"] if device == "all" else [device],
                        action, app.info)
    app.refresh()
    app.emit(result, lambda: app.line(f"step {result.step} replayed into {', '.join(result.runs)}"
                                      + _overflow_text(result.overflow)))
    return EXIT_FINDINGS if (result.overflow or {}).get("kernels") else EXIT_OK


def _overflow_text(found) -> str:
    if found is None:
        return ""
    if not found["kernels"]:
        return ": no overflow"
    return (f": {found['kernels']} overflowing kernel(s)"
            + (f", the first {found['first']}" if found["first"] else ""))


def _move_aside(root: str) -> Optional[str]:
    """Move what a workspace holds into root.<timestamp> (renamed, never deleted) and say
    where; None when it holds nothing. Its README, which the project ships, stays."""
    entries = [e for e in os.listdir(root) if e != "README.md"] if os.path.isdir(root) else []
    if not entries:
        return None
    aside = stamp = f"{root}.{time.strftime('%Y%m%d%H%M%S')}"
    k = 0
    while os.path.lexists(aside):          # two demos in the same second
        k += 1
        aside = f"{stamp}-{k}"
    os.makedirs(aside)
    for e in entries:
        os.rename(os.path.join(root, e), os.path.join(aside, e))
    return aside


@contextmanager
def fresh_workspace(app: App, root: str, fresh: bool = True):
    """For a command that writes a new workspace at root: what root holds is moved aside
    first (fresh; renamed, never deleted), and if the command then fails or is interrupted,
    put back, with what the failed run wrote moved aside in turn: nothing lost, nothing
    half-written left in its place."""
    aside = _move_aside(root) if fresh else None
    if aside:
        app.info(f"the existing workspace was moved to {aside}")
    try:
        yield
    except BaseException:
        if aside:
            failed = _move_aside(root)
            for entry in os.listdir(aside):
                os.rename(os.path.join(aside, entry), os.path.join(root, entry))
            os.rmdir(aside)
            app.warn(f"the run failed: the workspace is back in {root}"
                     + (f"; what the failed run wrote is in {failed}" if failed else ""))
        raise


@command("demo", "demo", short_help="The main job: train, dump both runs, auto check.")
@click.option("--steps", type=click.IntRange(1, 500), default=100, show_default=True,
              help="Training steps on each executor.")
@click.option("--fresh/--keep", default=True, show_default=True,
              help="Move an existing workspace aside first (it is renamed, never deleted).")
@click.option("--exit-zero", is_flag=True,
              help="Exit 0 after the report even though it has findings (for && chains).")
@click.pass_context
def demo_cmd(ctx, app: App, steps, fresh, exit_zero):
    """Train the Transformer on the UCI digits twice — on the CPU golden executor and on the
    simulated NPU under allow_mix_precision with fusion on — feeding raw, unnormalised pixels
    (0..16). Dump step 0 of both into the workspace, then run `ac -c`: the fused fp16
    softmax overflows (saturation hides it: only the status word shows it), and the check
    names the first overflow, the origin op and its pass, and what to try next.

    Exit code 1, as ac's: the planted problem is a finding (--exit-zero for 0)."""
    import numpy as np

    from .. import data, models
    from ..runtime import Session
    root = app.ws_root()
    digits = data.digits(scale=1.0)                      # raw pixels: the planted problem
    model = models.transformer()
    cfg = SessionConfig(precision_mode="allow_mix_precision")
    with fresh_workspace(app, root, fresh):
        app.refresh()
        npu = Session(model.graph, target="npu", config=hooks.session_dump_config(
            cfg, action="dump|overflow", dump_step="0", data_dir=root))
        cpu = hooks.sess_dump(Session(model.graph), action="dump", dump_step="0", data_dir=root)
        app.info(f"training the Transformer on raw digits for {steps} steps on the golden "
                 f"executor and the simulated NPU (allow_mix_precision, fusion on)...")
        losses = {"npu": [], "cpu": []}
        batches = list(digits.batches(32, seed=0, epoch=0))
        for k in range(steps):
            xb, yb = batches[k % len(batches)]
            for name, sess in (("npu", npu), ("cpu", cpu)):
                loss, _ = sess.run([model.loss, model.train_op], {model.x: xb, model.y: yb})
                losses[name].append(float(loss))
        npu.close()
        cpu.close()
    acc = {name: float(np.mean(np.argmax(sess.run(model.eval_logits, {model.x: digits.x_test}), 1)
                               == digits.y_test)) for name, sess in (("npu", npu), ("cpu", cpu))}
    app.refresh()
    if not app.as_json:
        app.console.print(f"after {steps} steps  loss: golden {losses['cpu'][-1]:.6f}, NPU "
                          f"{losses['npu'][-1]:.6f}\n{'':{len(str(steps)) + 14}}held-out accuracy: "
                          f"golden {acc['cpu']:.4f}, NPU {acc['npu']:.4f}")
        app.line(f"dumps: {root}\n")
    from .analyse import auto_check_cmd
    code = ctx.invoke(auto_check_cmd, compare=True, step=0)
    return EXIT_OK if exit_zero and code == EXIT_FINDINGS else code


@command("clean", "clean", short_help="Delete replay runs, partial steps, old compare results.")
@click.option("--replays/--no-replays", default=True, show_default=True,
              help="The runs fo and train wrote (npu/debug_<k> replaying another run).")
@click.option("--results/--no-results", default=True, show_default=True,
              help="Compare results (temp/vector_compare/<ts>) but the newest --keep.")
@click.option("--partial/--no-partial", default=True, show_default=True,
              help="Partial steps a killed or stopped dump left (never read; one written in "
                   "the last minute is left alone: a dump may be writing it).")
@click.option("-k", "--keep", type=click.IntRange(0), default=1, show_default=True,
              help="Compare results to keep, the newest.")
@click.option("-n", "--dry-run", is_flag=True, help="Say what would be deleted; delete nothing.")
def clean_cmd(app: App, replays, results, partial, keep, dry_run):
    """Delete what analysis commands leave behind: the replay runs (every fo adds several),
    all compare results but the newest, and the partial steps of dumps that were killed or
    stopped by a write failure (a full disk). The whole steps of original runs, the dumps of
    your training, are never deleted. Beside a read-only workspace, only its results
    directory is cleaned.

    Exit code 0 (2 on input error)."""
    done = housekeeping.clean(app.ws, replays, results, keep, partial, dry_run)
    doomed, total = done.deleted, done.bytes
    if not dry_run:
        app.refresh()

    def render():
        verb = "would delete" if dry_run else "deleted"
        for d in doomed:
            app.line(f"{verb} {d.path} ({_mib(d.bytes)}; {d.why})")
        app.line(f"{verb} {len(doomed)} item(s), {_mib(total)}" if doomed else "nothing to delete")
    app.emit(done, render)
    return EXIT_OK


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.1f} MiB"
