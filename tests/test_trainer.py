"""Model.train with callbacks and data sink mode, the AMP levels and the hand-written loss
scaling, on the same Session and dump hooks."""
import io
import os

import numpy as np
import pytest

import precision_tool as pt
from precision_tool.dump import Workspace
from precision_tool.trainer import (Callback, DatasetError, DumpCallback, EarlyStop,
                                    LossMonitor, Model, ModelError, NumpySlicesDataset,
                                    OverflowMonitor, TimeMonitor)

DIGITS = pt.data.digits()


def _small(n=40, batch=8, seed=0):
    """n digits, batched: n // batch batches per pass."""
    return NumpySlicesDataset((DIGITS.x_train[:n], DIGITS.y_train[:n])).shuffle(seed).batch(
        batch, drop_remainder=True)


def _mlp_model(target="cpu", **kw):
    return Model(pt.models.mlp_network((16,)), pt.nn.SoftmaxCrossEntropyWithLogits(),
                 pt.train.SGD(0.1), target=target, **kw)


class Recorder(Callback):
    def __init__(self):
        self.events = []

    def _log(self, event, ctx):
        p = ctx.original_args()
        self.events.append((event, p.cur_epoch_num, p.cur_step_num))

    def begin(self, ctx): self._log("begin", ctx)
    def epoch_begin(self, ctx): self._log("epoch_begin", ctx)
    def step_begin(self, ctx): self._log("step_begin", ctx)
    def step_end(self, ctx): self._log("step_end", ctx)
    def epoch_end(self, ctx): self._log("epoch_end", ctx)
    def end(self, ctx): self._log("end", ctx)


class FeedLog:
    """A session observer that records the x fed at every run (the device's view)."""

    def __init__(self):
        self.fed = []

    def begin_run(self, session, feeds, fetch_tensors, fetch_nodes):
        self.fed.append(feeds["x:0"].copy())
        return False


def _run(dataset, epochs, **kw):
    model = _mlp_model()
    rec, log = Recorder(), FeedLog()
    model._build(*next(dataset.epoch(0)))
    model._session(training=True).add_observer(log)
    model.train(epochs, dataset, callbacks=[rec], **kw)
    return model, rec, log


def test_callbacks_fire_every_step_without_sink_mode():
    ds = _small(40, 8)                   # 5 batches per pass
    model, rec, log = _run(ds, 2)
    names = [e[0] for e in rec.events]
    per_epoch = ["epoch_begin"] + ["step_begin", "step_end"] * 5 + ["epoch_end"]
    assert names == ["begin"] + per_epoch * 2 + ["end"]
    assert [e[2] for e in rec.events if e[0] == "step_end"] == list(range(1, 11))
    assert [e[1] for e in rec.events if e[0] == "epoch_end"] == [1, 2]
    assert model.transfers.to_device == model.transfers.to_host == 10
    expected = [b[0] for k in range(2) for b in ds.epoch(k)]      # each epoch a new order
    assert len(log.fed) == 10 and all(np.array_equal(a, b) for a, b in zip(log.fed, expected))


def test_sink_mode_whole_epoch_fires_step_callbacks_once_per_epoch():
    ds = _small(40, 8)
    model, rec, log = _run(ds, 3, dataset_sink_mode=True)
    names = [e[0] for e in rec.events]
    assert names == ["begin"] + ["epoch_begin", "step_begin", "step_end", "epoch_end"] * 3 + ["end"]
    assert [e[2] for e in rec.events if e[0] == "step_end"] == [5, 10, 15]
    assert len(log.fed) == 15                       # the device still runs every step
    assert model.transfers.to_device == model.transfers.to_host == 3


@pytest.mark.parametrize("sink_size, epochs", [(1, 3), (2, 4), (3, 3), (7, 2)])
def test_sink_size_makes_the_epoch_and_continues_through_the_data(sink_size, epochs):
    ds = _small(40, 8)                   # 5 batches per pass: sinks cross pass boundaries
    model, rec, log = _run(ds, epochs, dataset_sink_mode=True, sink_size=sink_size)
    ends = [e for e in rec.events if e[0] == "step_end"]
    assert [e[2] for e in ends] == [sink_size * (k + 1) for k in range(epochs)]
    assert [e[1] for e in ends] == list(range(1, epochs + 1))
    assert len(log.fed) == epochs * sink_size
    endless = ds.endless()
    expected = [next(endless)[0] for _ in range(epochs * sink_size)]
    assert all(np.array_equal(a, b) for a, b in zip(log.fed, expected))
    assert model.transfers.to_device == model.transfers.to_host == epochs


def test_sink_mode_trains_the_same_steps_as_the_plain_loop():
    """Sinking changes when the host looks, not what the device computes."""
    ds = _small(40, 8)
    plain, sunk = _mlp_model(), _mlp_model()
    plain.train(2, ds)
    sunk.train(2, ds, dataset_sink_mode=True)
    a, b = plain.train_session.variables(), sunk.train_session.variables()
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_early_stop_below_a_loss_stops_at_the_first_step_under_it():
    ds = _small(160, 16)
    reference = _mlp_model()
    losses = []

    class Losses(Callback):
        def step_end(self, ctx):
            losses.append(ctx.original_args().net_outputs)
    reference.train(3, ds, callbacks=[Losses()])
    threshold = sorted(losses)[len(losses) // 2]       # reached somewhere mid-run
    expected = next(k for k, v in enumerate(losses) if v < threshold) + 1
    model, stop = _mlp_model(), EarlyStop(loss_below=threshold)
    model.train(3, ds, callbacks=[stop])
    assert stop.stopped_step == expected and model.transfers.to_device == expected
    assert "<" in stop.reason


def test_early_stop_patience_counts_steps_without_improvement():
    ds = _small(160, 16)
    losses = []

    class Losses(Callback):
        def step_end(self, ctx):
            losses.append(ctx.original_args().net_outputs)
    _mlp_model().train(3, ds, callbacks=[Losses()])
    patience, best, wait, expected = 2, np.inf, 0, None
    for k, v in enumerate(losses):             # the rule, restated
        if v < best:
            best, wait = v, 0
        else:
            wait += 1
            if wait >= patience:
                expected = k + 1
                break
    assert expected is not None, "the run must plateau somewhere for this test to mean much"
    model, stop = _mlp_model(), EarlyStop(patience=patience)
    model.train(3, ds, callbacks=[stop])
    assert stop.stopped_step == expected and model.transfers.to_device == expected


def test_request_stop_in_sink_mode_ends_after_the_current_sink():
    class StopAtFirst(Callback):
        def step_end(self, ctx):
            ctx.request_stop()
    model = _mlp_model()
    rec = Recorder()
    model.train(3, _small(40, 8), callbacks=[StopAtFirst(), rec], dataset_sink_mode=True,
                sink_size=4)
    assert [e[0] for e in rec.events] == ["begin", "epoch_begin", "step_begin", "step_end",
                                          "epoch_end", "end"]
    assert rec.events[-1][2] == 4


def test_dump_callback_dumps_only_the_chosen_steps(tmp_path):
    root = str(tmp_path)
    ds = _small(40, 8)
    for target in ("cpu", "npu"):
        model = _mlp_model(target)
        model.train(2, ds, callbacks=[DumpCallback(action="dump", dump_step="1|3-4",
                                                   data_dir=root)])
    ws = Workspace(root)
    for target in ("cpu", "npu"):
        run = ws.run(target)
        assert [s.step for s in run.steps if s.complete] == [1, 3, 4]
        for step in (1, 3, 4):
            table = ws.index(run, step)
            assert len(table) and all(os.path.isfile(os.path.join(ws.step_path(run, step), f))
                                      for f in table.file)
    # the dumps are the model's graph: the vector compare maps them
    from precision_tool import analysis
    result = analysis.vector_compare(ws, ws.run("npu"), ws.run("cpu"), step=1)
    assert len(result) and result.CosineSimilarity.notna().any()


def test_the_step_history_covers_steps_not_dumped(tmp_path):
    """O2 training whose loss scale 2**24 does not fit fp16: every step overflows and the
    dynamic manager halves the scale. Dumping step 0 alone, the step history still holds
    every step, each row as a dump of every step writes it (the same rows from the traced
    and the untraced path), and ac counts them all."""
    d = pt.data.digits()
    data = NumpySlicesDataset((d.x_train[:192], d.y_train[:192])).batch(32, drop_remainder=True)

    def history(dump_step, root):
        model = Model(pt.models.cnn_network(), pt.nn.SoftmaxCrossEntropyWithLogits(),
                      pt.train.Momentum(0.05, 0.9), amp_level="O2", target="npu")
        model.train(1, data, callbacks=[DumpCallback(action="dump", dump_step=dump_step,
                                                     data_dir=str(root))])
        ws = Workspace(str(root))
        return ws, ws.step_history(ws.run("npu"))
    ws, one = history("0", tmp_path / "one")
    _, every = history("0-5", tmp_path / "every")
    assert list(one.step) == list(range(6))
    assert one.to_dict("list") == every.to_dict("list")
    assert list(one.loss_scale) == [2.0 ** (24 - k) for k in range(6)]
    from precision_tool import analysis
    scales = analysis.loss_scale_history(ws, ws.run("npu"))
    assert len(scales.overflow_steps) == 6 and len(scales.skipped_steps) == 6


def test_dump_callback_without_action_follows_the_environment(tmp_path, monkeypatch):
    root = str(tmp_path)
    monkeypatch.delenv("PRECISION_TOOL_NPU_ACTION", raising=False)
    _mlp_model("npu").train(1, _small(16, 8), callbacks=[DumpCallback(data_dir=root)])
    assert not os.listdir(root)                          # a plain run writes nothing
    monkeypatch.setenv("PRECISION_TOOL_NPU_ACTION", "dump")
    monkeypatch.setenv("PRECISION_TOOL_DUMP_STEP", "1")
    _mlp_model("npu").train(1, _small(16, 8), callbacks=[DumpCallback(data_dir=root)])
    assert [s.step for s in Workspace(root).run("npu").steps] == [1]


def test_overflow_monitor_reports_a_constructed_overflow_and_the_halved_scale():
    """O2 computes the backward in fp16: a loss scale of 2**17 puts the loss gradient past
    65504 (the scale enters fp16), so step 1 overflows, is skipped, and the dynamic manager
    halves the scale; from 2**15 on the steps are finite."""
    out = io.StringIO()
    monitor = OverflowMonitor(file=out)
    model = _mlp_model("npu", amp_level="O2",
                       loss_scale_manager=pt.train.DynamicLossScaleManager(2.0 ** 17, 2, 1000))
    model.train(1, _small(40, 8), callbacks=[monitor], dataset_sink_mode=True)
    scales = [s for _, s in monitor.trajectory]
    assert monitor.trajectory[0] == (0, 2.0 ** 17)
    assert monitor.overflowed_steps[:1] == [1]
    # every overflowed step halves the scale, and only those move it (window 1000)
    assert monitor.trajectory[1:] == [(s, 2.0 ** (17 - k - 1))
                                      for k, s in enumerate(monitor.overflowed_steps)]
    assert scales[-1] * 2 ** len(monitor.overflowed_steps) == 2.0 ** 17
    assert scales[-1] < 65504
    text = out.getvalue()
    assert "overflow at step 1 (epoch 1)" in text and "131072.0 -> 65536.0" in text
    assert "update skipped" in text
    # the same graph on the golden executor (fp32) never overflows
    golden, quiet = _mlp_model("cpu", amp_level="O2",
                               loss_scale_manager=pt.train.DynamicLossScaleManager(
                                   2.0 ** 17, 2, 1000)), OverflowMonitor(quiet=True)
    golden.train(1, _small(40, 8), callbacks=[quiet])
    assert quiet.overflowed_steps == [] and quiet.trajectory == [(0, 2.0 ** 17)]


def test_loss_and_time_monitors_print_per_step_or_per_epoch():
    out = io.StringIO()
    _mlp_model().train(2, _small(40, 8), callbacks=[LossMonitor(2, file=out),
                                                   TimeMonitor(file=out)])
    lines = out.getvalue().splitlines()
    loss_lines = [l for l in lines if l.startswith("epoch:")]
    assert [l.split(",")[0] for l in loss_lines] == ["epoch: 1 step: 2", "epoch: 1 step: 4",
                                                     "epoch: 2 step: 1", "epoch: 2 step: 3",
                                                     "epoch: 2 step: 5"]
    assert sum(l.startswith("epoch time:") for l in lines) == 2


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_amp_levels_train_the_cnn_on_the_simulated_npu(level):
    train = NumpySlicesDataset((DIGITS.x_train, DIGITS.y_train)).shuffle(0).batch(
        32, drop_remainder=True)
    test = NumpySlicesDataset((DIGITS.x_test, DIGITS.y_test)).batch(256)
    model = Model(pt.models.cnn_network(), pt.nn.SoftmaxCrossEntropyWithLogits(),
                  pt.train.Momentum(0.05, 0.9), amp_level=level, target="npu",
                  loss_scale_manager=pt.train.DynamicLossScaleManager(2.0 ** 10) if level == "O2"
                  else None)
    model.train(3, train, dataset_sink_mode=True)
    result = model.eval(test)
    assert result["accuracy"] > 0.9, result
    compiled = model.train_session.compiled.graph
    computes = {n.attrs.get("compute_dtype") for n in compiled.nodes
                if n.type in ("Conv2D", "Conv2DBatchNorm", "MatMul", "MatMulV2")}
    assert computes == ({"float32"} if level == "O0" else {"float16"})
    has_scale = any(n.name == "loss_scale/loss_scale" for n in compiled.nodes)
    assert has_scale == (level == "O2")


def test_o2_default_is_dynamic_loss_scaling_and_o3_none():
    o2, o3 = _mlp_model(amp_level="O2"), _mlp_model(amp_level="O3")
    assert o2.loss_scale_manager.initial_scale == 2.0 ** 24 and o3.loss_scale_manager is None


def test_pynative_runs_op_by_op_without_fusion_or_formats():
    cnn = Model(pt.models.cnn_network(), pt.nn.SoftmaxCrossEntropyWithLogits(),
                pt.train.SGD(0.05), target="npu", mode="pynative", amp_level="O3")
    cnn.train(1, _small(32, 8))
    compiled = cnn.train_session.compiled.graph
    types = {n.type for n in compiled.nodes}
    assert "TransData" not in types and not any(n.attrs.get("pass_name") for n in compiled.nodes)
    graph_mode = Model(pt.models.cnn_network(), pt.nn.SoftmaxCrossEntropyWithLogits(),
                       pt.train.SGD(0.05), target="npu", amp_level="O3")
    graph_mode.train(1, _small(32, 8))
    fused = {n.attrs.get("pass_name") for n in graph_mode.train_session.compiled.graph.nodes}
    assert "TransData" in {n.type for n in graph_mode.train_session.compiled.graph.nodes}
    assert "ConvBatchNormFusionPass" in fused


def test_misuse_gets_a_clear_error_with_the_fix():
    ds = _small(16, 8)
    with pytest.raises(ModelError, match="mode='graph'"):
        _mlp_model("npu", mode="pynative").train(1, ds, dataset_sink_mode=True)
    with pytest.raises(pt.PrecisionToolError, match="graph mode"):
        _mlp_model("npu", mode="pynative",
                   config=pt.SessionConfig(fusion_switch_file="fusion_switch.cfg"))
    with pytest.raises(ModelError, match="dataset_sink_mode=True"):
        _mlp_model().train(1, ds, sink_size=3)
    with pytest.raises(ModelError, match="batch"):
        _mlp_model().train(1, NumpySlicesDataset((DIGITS.x_train, DIGITS.y_train)))
    with pytest.raises(ModelError, match="no batch"):
        _mlp_model().train(1, NumpySlicesDataset((DIGITS.x_train[:3], DIGITS.y_train[:3])).batch(
            8, drop_remainder=True))
    with pytest.raises(ModelError, match="amp_level"):
        _mlp_model(amp_level="O4")
    with pytest.raises(ModelError, match="loss_fn and an optimizer"):
        Model(pt.models.mlp_network()).train(1, ds)
    with pytest.raises(ModelError, match="sink_size"):
        _mlp_model().train(1, ds, dataset_sink_mode=True, sink_size=0)
    with pytest.raises(ModelError, match="epoch"):
        _mlp_model().train(0, ds)


def test_eval_and_predict_use_the_trained_variables_in_inference_mode():
    ds = _small(160, 16)
    model = _mlp_model()
    before = model.predict(DIGITS.x_test[:5])
    model.train(3, ds)
    after = model.predict(DIGITS.x_test[:5])
    assert after.shape == (5, 10) and not np.array_equal(before, after)
    sess = model.train_session                 # the same numbers from the training session
    np.testing.assert_array_equal(after, sess.run(model.eval_logits, {model.x: DIGITS.x_test[:5]}))
    test = NumpySlicesDataset((DIGITS.x_test, DIGITS.y_test)).batch(100)
    logits = model.predict(DIGITS.x_test)
    result = model.eval(test)
    assert result["accuracy"] == pytest.approx(np.mean(np.argmax(logits, 1) == DIGITS.y_test))
    z = logits.astype(np.float64) - logits.max(1, keepdims=True)
    ce = np.log(np.exp(z).sum(1)) - z[np.arange(len(z)), DIGITS.y_test]
    assert result["loss"] == pytest.approx(ce.mean(), rel=1e-5, abs=0)


def test_dataset_batches_shuffles_per_pass_and_continues_endlessly():
    x = np.arange(10, dtype=np.float32).reshape(10, 1)
    y = np.arange(10, dtype=np.int32)
    ds = NumpySlicesDataset((x, y))
    assert len(ds) == 10 and [int(a[1]) for a in ds] == list(range(10))
    b = ds.batch(4)
    assert len(b) == 3 and [len(p[0]) for p in b] == [4, 4, 2]
    assert len(ds.batch(4, drop_remainder=True)) == 2
    s = ds.shuffle(3).batch(5)
    first, second = [np.concatenate([p[1] for p in s.epoch(k)]) for k in (0, 1)]
    assert sorted(first) == list(range(10)) and not np.array_equal(first, second)
    np.testing.assert_array_equal(first, np.concatenate([p[1] for p in s.epoch(0)]))
    endless = s.endless()
    got = np.concatenate([next(endless)[1] for _ in range(4)])
    np.testing.assert_array_equal(got, np.concatenate([first, second]))
    with pytest.raises(DatasetError):
        NumpySlicesDataset((x, y[:5]))
    with pytest.raises(DatasetError):
        ds.batch(0)
    with pytest.raises(DatasetError):
        NumpySlicesDataset((np.array([object()] * 3),))


def test_hand_written_loss_scaling_against_a_float64_reference():
    """loss = sum(w * c): the gradient is c. A finite step is plain SGD on c; a step whose
    scaled gradient overflows fp32 leaves w alone and halves the scale."""
    lr = 0.5
    for c_value, finite in ((0.75, True), (2.0 ** 40, False)):
        g = pt.Graph("handwritten", seed=0)
        with g.as_default():
            w = pt.variable("w", [3], init=1.0)
            c = pt.placeholder("c", [3])
            loss = pt.ops.reduce_sum(w * c)
            scaler = pt.amp.DynamicLossScaler(scale_value=2.0 ** 100, scale_factor=2,
                                              scale_window=1000)
            grads = scaler.unscale(pt.train.gradients(scaler.scale(loss), [w]))
            ok = pt.amp.all_finite(grads)
            step = pt.train.SGD(lr).apply_gradients(zip(grads, [w]), gate=ok,
                                                    extra=[scaler.adjust(ok)])
        sess = pt.Session(g)
        cv = np.full(3, c_value, np.float32)
        _, is_finite = sess.run([step, ok], {c: cv})
        state = sess.variables()
        expect_w = np.ones(3) - lr * np.float64(c_value) if finite else np.ones(3)
        assert bool(is_finite) is finite
        np.testing.assert_allclose(state["w"], expect_w, rtol=1e-7)
        assert float(state["loss_scale/loss_scale"]) == (2.0 ** 100 if finite else 2.0 ** 99)
        assert float(state["loss_scale/last_step_finite"]) == float(finite)


def test_the_readme_mindspore_script_runs_as_written_and_ac_analyses_it(tmp_path):
    import re
    import subprocess
    import sys
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8").read()
    script = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S)
                  if b.startswith("# train_ms.py"))
    (tmp_path / "train_ms.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRECISION_TOOL")}
    ran = subprocess.run([sys.executable, "train_ms.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert "overflow at step 1 (epoch 1)" in ran.stdout and "-> 16384.0" in ran.stdout
    ac = subprocess.run([sys.executable, "-m", "precision_tool", "ac", "-c"], cwd=tmp_path,
                        env=dict(env, COLUMNS="200"), capture_output=True, text=True, timeout=300)
    assert ac.returncode == 1, ac.stderr           # findings: the overflow
    assert "Traceback" not in ac.stderr
    assert "first overflow" in ac.stdout and "Loss scale" in ac.stdout
    assert "16777216.0 -> 8388608.0" in ac.stdout
    as_json = subprocess.run([sys.executable, "-m", "precision_tool", "--json", "ac"], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=300)
    import json
    result = json.loads(as_json.stdout)
    assert result["first_overflow"]["op_name"].startswith("loss_scale/")
    assert "That is the loss scale itself: 16777216.0" in result["advice"][0]
