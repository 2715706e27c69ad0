"""Overflow analysis (groundwork): the first overflow is the producer, in both modes."""
import numpy as np
import pytest

import precision_tool as pt
from precision_tool import hooks
from precision_tool.analysis import overflow_report
from precision_tool.dump import Workspace


@pytest.mark.parametrize("overflow_mode", ["saturation", "inf_nan"])
def test_the_first_overflow_is_the_producer_in_both_modes(tmp_path, overflow_mode):
    g = pt.Graph("chain")
    with g.as_default():
        x = pt.placeholder("x", [4])
        a = pt.ops.mul(x, 2.0, name="scale")
        b = pt.ops.exp(a, name="blowup")              # exp(24) overflows fp16
        c = pt.ops.mul(b, 3.0, name="after")          # carries (inf_nan) or re-overflows (sat.)
        y = pt.ops.add(c, 1.0, name="tail")
    cfg = hooks.session_dump_config(pt.SessionConfig(precision_mode="force_fp16",
                                                     overflow_mode=overflow_mode,
                                                     fusion_switch="off"),
                                    action="overflow", dump_step="0", data_dir=str(tmp_path))
    sess = pt.Session(g, target="npu", config=cfg)
    sess.run(y, {x: np.array([1.0, 2.0, 12.0, 0.5], np.float32)})
    ws = Workspace(str(tmp_path))
    report = overflow_report(ws, ws.run("npu"), 0)
    assert report.first is not None and report.first.op_name == "blowup"
    assert report.first.status_bits == ["floating-point overflow"]
    names = [t.op_name for t in report.tasks]
    assert names[0] == "blowup" and names == sorted(names, key=names.index)
    if overflow_mode == "inf_nan":
        # downstream tasks read inf: they are propagators, not origins
        assert {t.op_name for t in report.propagators} == set(names[1:])
        assert report.first.outputs_nonfinite > 0
    else:
        # saturated values look finite: only the status words show the overflow
        assert report.first.outputs_nonfinite == 0
        assert all(t.inputs_finite for t in report.tasks)


def test_a_clean_run_has_no_overflow(tmp_path):
    m = pt.models.mlp()
    d = pt.data.digits()
    cfg = hooks.session_dump_config(action="dump|overflow", data_dir=str(tmp_path))
    sess = pt.Session(m.graph, target="npu", config=cfg)
    sess.run([m.loss, m.train_op], {m.x: d.x_train[:8], m.y: d.y_train[:8]})
    ws = Workspace(str(tmp_path))
    report = overflow_report(ws, ws.run("npu"), 0)
    assert report.tasks == [] and report.first is None


def test_auto_check_leads_with_the_first_overflow(tmp_path):
    from precision_tool.analysis import auto_check
    g = pt.Graph("ovf")
    with g.as_default():
        x = pt.placeholder("x", [2])
        y = pt.ops.add(pt.ops.exp(x, name="blowup"), 1.0, name="after")
    cfg = hooks.session_dump_config(pt.SessionConfig(precision_mode="force_fp16", fusion_switch="off"),
                                    action="dump", data_dir=str(tmp_path))
    pt.Session(g, target="npu", config=cfg).run(y, {x: np.array([1.0, 30.0], np.float32)})
    result = auto_check(Workspace(str(tmp_path)))
    assert result.first_overflow["op_name"] == "blowup"
    assert result.first_overflow["status"] == "0x20"
    assert result.advice[0].startswith("The first overflow is blowup (Exp")


def _loss_scaled_mlp(tmp_path):
    """An MLP under force_fp16 with dynamic loss scaling from 2^20, overflow check on."""
    opt = pt.train.LossScaleOptimizer(pt.train.SGD(0.1),
                                      pt.train.DynamicLossScaleManager(2.0 ** 20, 2, 1))
    m = pt.models.mlp(optimizer=opt)
    cfg = hooks.session_dump_config(pt.SessionConfig(precision_mode="force_fp16"),
                                    action="overflow", data_dir=str(tmp_path))
    return m, pt.data.digits(), pt.Session(m.graph, target="npu", config=cfg)


def test_loss_scale_history_counts_overflowed_steps_and_the_scale_moves(tmp_path):
    """Dynamic loss scaling from 2^20 under force_fp16: early steps overflow and halve the
    scale. The history the dump wrote (every observed step, dumped or not) must agree with
    the session's own status words and scale variable, read step by step."""
    from precision_tool.analysis import loss_scale_history
    m, d, sess = _loss_scaled_mlp(tmp_path)
    statuses, scales = [], [float(sess.variables()["loss_scale/loss_scale"])]
    for step in range(8):
        sess.run(m.train_op, {m.x: d.x_train[:32], m.y: d.y_train[:32]})
        statuses.append(sess.float_status())
        scales.append(float(sess.variables()["loss_scale/loss_scale"]))
    sess.close()
    ws = Workspace(str(tmp_path))
    run = ws.run("npu")
    history = loss_scale_history(ws, run)
    overflowed = [k for k, s in enumerate(statuses) if s]
    assert overflowed and len(overflowed) < 8          # the scale came down far enough
    assert history.steps == 8 and history.overflow_steps == overflowed
    assert history.skipped_steps == overflowed
    assert history.first_scale == 2.0 ** 20 and history.last_scale == scales[-1]
    assert history.moves == [(k, scales[k], scales[k + 1]) for k in range(8) if scales[k] != scales[k + 1]]
    # only the overflowed steps were dumped (the overflow check), yet every step is in the history
    assert [s.step for s in run.steps] == overflowed
    assert history.status_bits


def _history(rows):
    """A LossScaleHistory from (step, scale, next scale, finite) rows, as the dump's."""
    from precision_tool.analysis.diagnosis.scale_history import LossScaleHistory
    return LossScaleHistory(
        len(rows), [r[0] for r in rows if not r[3]], [r[0] for r in rows if not r[3]],
        [(r[0], r[1], r[2]) for r in rows if r[1] != r[2]], rows[0][1], rows[-1][2],
        scaled_steps=[r[0] for r in rows])


@pytest.mark.parametrize("rows,step,expected", [
    # a skip between clean steps, the scale halved: backing off
    ([(0, 8, 8, 1), (1, 8, 8, 1), (2, 8, 4, 0), (3, 4, 4, 1)], 2, (1, 3)),
    # the last observed step: nothing after it to ask
    ([(0, 8, 8, 1), (1, 8, 8, 1), (2, 8, 8, 1), (3, 8, 4, 0)], 3, (2, None)),
    # steps numbered from 10 (a resumed run)
    ([(10, 8, 8, 1), (11, 8, 8, 1), (12, 8, 4, 0), (13, 4, 4, 1)], 12, (11, 13)),
    # skips from the first step on, then a step without overflow: the scale settling
    ([(0, 8, 4, 0), (1, 4, 4, 1), (2, 4, 4, 1), (3, 4, 4, 1)], 0, (None, 1, 4)),
    ([(0, 16, 8, 0), (1, 8, 4, 0)] + [(k, 4, 4, 1) for k in range(2, 8)], 1, (None, 2, 4)),
    # ... that never settles, or settles after more than a quarter of the steps
    ([(0, 8, 4, 0), (1, 4, 2, 0)], 0, None),
    ([(0, 8, 4, 0)], 0, None),
    ([(0, 16, 8, 0), (1, 8, 4, 0), (2, 4, 4, 1), (3, 4, 4, 1)], 0, None),
    # consecutive skips mid-run
    ([(0, 8, 8, 1), (1, 8, 4, 0), (2, 4, 2, 0), (3, 2, 2, 1)], 1, None),
    ([(0, 8, 8, 1), (1, 8, 4, 0), (2, 4, 2, 0), (3, 2, 2, 1)], 2, None),
    # skipped every other step: a scale that grows too fast
    ([(0, 8, 8, 1), (1, 8, 4, 0), (2, 4, 8, 1), (3, 8, 4, 0), (4, 4, 4, 1)], 3, None),
    # skipped with the scale held (a static scale): no back-off
    ([(0, 8, 8, 1), (1, 8, 8, 1), (2, 8, 8, 0), (3, 8, 8, 1)], 2, None),
    # a step that was not skipped
    ([(0, 8, 8, 1), (1, 8, 8, 1), (2, 8, 4, 0), (3, 4, 4, 1)], 1, None),
])
def test_a_loss_scale_backing_off_or_settling_is_told_from_one_that_keeps_skipping(
        rows, step, expected):
    """(before, after) of a back-off; (None, the step it settled at, that scale) of a scale
    settling from where it started."""
    from precision_tool.analysis.diagnosis.scale_history import backoff
    found = backoff(_history(rows), step)
    if expected is None:
        assert found is None
    elif expected[0] is None:
        assert found["kind"] == "calibration"
        assert (found["before"], found["after"], found["settled"]) == expected
    else:
        assert found["kind"] == "back-off"
        assert (found["before"], found["after"]) == expected
    if found:
        assert found["scale"] == 2 * found["next_scale"] and found["step"] == step


def test_a_torn_step_history_loses_only_its_last_line(tmp_path):
    from precision_tool.analysis import loss_scale_history
    from precision_tool.dump.workspace import WorkspaceError
    m = pt.models.mlp()
    d = pt.data.digits()
    cfg = hooks.session_dump_config(action="overflow", data_dir=str(tmp_path))
    sess = pt.Session(m.graph, target="npu", config=cfg)
    for _ in range(3):
        sess.run(m.train_op, {m.x: d.x_train[:8], m.y: d.y_train[:8]})
    sess.close()
    ws = Workspace(str(tmp_path))
    path = ws.run("npu").path + "/step_history.csv"
    text = open(path).read()
    assert text.count("\n") == 4
    open(path, "w").write(text[:-3])                    # torn in the middle of the last row
    history = loss_scale_history(Workspace(str(tmp_path)), ws.run("npu"))
    assert history.steps in (2, 3) and history.overflow_steps == [] and not history.scaled
    open(path, "w").write("garbage\x00\n1,2\n")
    with pytest.raises(WorkspaceError, match="step history"):
        loss_scale_history(Workspace(str(tmp_path)), ws.run("npu"))


def test_the_step_history_grows_by_appending_and_a_named_run_starts_it_afresh(tmp_path):
    m = pt.models.mlp()
    d = pt.data.digits()
    feed = {m.x: d.x_train[:8], m.y: d.y_train[:8]}

    def history(runs, debug_dir=None):
        cfg = hooks.session_dump_config(action="overflow", data_dir=str(tmp_path),
                                        debug_dir=debug_dir)
        sess = pt.Session(m.graph, target="npu", config=cfg)
        for n in runs:
            for _ in range(n):
                sess.run(m.train_op, feed)
            sess.close()                      # each close appends the rows since the last
        ws = Workspace(str(tmp_path))
        run = ws.run("npu", "debug_0")
        return ws.step_history(run), open(run.path + "/step_history.csv").read()

    table, text = history([3, 2])
    assert table["step"].tolist() == [0, 1, 2, 3, 4] and text.count("step,") == 1
    table, text = history([1], debug_dir="debug_0")     # the same run directory, dumped again
    assert table["step"].tolist() == [0] and text.count("step,") == 1


def test_auto_check_reports_the_loss_scale_history(tmp_path):
    from precision_tool.analysis import auto_check
    m, d, sess = _loss_scaled_mlp(tmp_path)
    for _ in range(4):
        sess.run(m.train_op, {m.x: d.x_train[:32], m.y: d.y_train[:32]})
    sess.close()
    result = auto_check(Workspace(str(tmp_path)))
    ls = result.to_dict()["loss_scale"]
    assert ls["steps"] == 4 and ls["overflow_steps"][0] == 0 and ls["first_scale"] == 2.0 ** 20
    assert result.first_overflow is not None and result.step == 0


# -- an overflow inside a kernel whose output comes out finite ------------------------------------
def _softmax_of(logit_scale: float, mode: str, overflow_mode: str):
    """A softmax (fused by SoftmaxFusionPass) of logits x @ w * scale: its largest logit, and
    the status word the simulated NPU reports for the step."""
    g = pt.Graph("sm", seed=0)
    with g.as_default():
        x = pt.placeholder("x", [4, 8])
        w = pt.variable("w", [8, 8], init="glorot_uniform")
        logits = pt.ops.matmul(x, w) * pt.constant(logit_scale, name="scale")
        y = pt.ops.softmax(logits)
    xv = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    npu = pt.Session(g, target="npu", config=pt.SessionConfig(precision_mode=mode,
                                                              overflow_mode=overflow_mode))
    npu.run(y, {x: xv})
    peak = float(np.abs(pt.Session(g).run(logits, {x: xv})).max())
    return peak, npu.float_status()


@pytest.mark.parametrize("overflow_mode", ["saturation", "inf_nan"])
@pytest.mark.parametrize("mode", ["allow_mix_precision", "force_fp16"])
def test_a_fused_fp16_softmax_sets_the_status_word_whatever_its_exp_reaches(mode, overflow_mode):
    """The fused fp16 softmax skips the max subtraction: exp(x) leaves fp16 once a logit
    passes ln 65504 = 11.09, and leaves float32 itself past 88.72. Saturation clips what the
    exp made and the output is a finite (wrong) softmax, so only the status word can tell;
    it read 0x0 once the fp32 exp had already gone to inf. The bit follows the logits alone."""
    for scale, overflows in ((1.0, False), (20.0, True), (60.0, True), (200.0, True)):
        peak, status = _softmax_of(scale, mode, overflow_mode)
        assert (peak > np.log(65504.0)) == overflows, (scale, peak)
        assert bool(status & 0x20) == overflows, (scale, peak, hex(status))


def _fused_chain(x_value: float, overflow_mode: str):
    """1 / (1 + exp(-x)) under force_fp32, UB-fused into one elementwise kernel that runs its
    steps in fp32: exp(-x) leaves float32 for x < -88.72, and the kernel's output is 0 or a
    subnormal either way."""
    g = pt.Graph("chain", seed=0)
    with g.as_default():
        x = pt.placeholder("x", [2, 4])
        y = pt.ops.div(pt.constant(1.0, name="one"),
                       pt.constant(1.0, name="one_") + pt.ops.exp(x * pt.constant(-1.0, name="neg")))
    npu = pt.Session(g, target="npu", config=pt.SessionConfig(precision_mode="force_fp32",
                                                              overflow_mode=overflow_mode))
    out = npu.run(y, {x: np.full((2, 4), x_value, np.float32)})
    assert "RealDiv" in npu.fusion_result()["chain"]["ub_fusion"]["TbeEltwiseFusionPass"]["fused_nodes"]
    return out, npu.float_status()


@pytest.mark.parametrize("overflow_mode", ["saturation", "inf_nan"])
def test_an_fp32_step_inside_a_fused_kernel_overflows_into_the_status_word(overflow_mode):
    out, status = _fused_chain(-80.0, overflow_mode)          # exp(80) fits float32
    assert status == 0 and np.all(out < 1e-30)
    out, status = _fused_chain(-100.0, overflow_mode)         # exp(100) does not
    assert status & 0x20 and np.all(np.isfinite(out)) and np.all(out < 1e-30)
    if overflow_mode == "saturation":       # the step saturated at the fp32 maximum
        assert np.allclose(out, 1.0 / (1.0 + float(np.finfo(np.float32).max)), rtol=1e-6)
