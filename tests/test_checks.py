"""Pre-training checks (`check`): each check with its problem planted finds it, with its
evidence; the shipped models' default training trips none; `check -- SCRIPT` stops the
script after the step it needs; `check --diff` lists what differs between two runs."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from click.testing import CliRunner

import precision_tool as pt
from precision_tool import hooks
from precision_tool.analysis.replays import checks as ck
from precision_tool.cli import cli
from precision_tool.dump import Workspace
from test_repair import Net, dense_net, dump_step


def findings(ws, name, **kw):
    report = ck.run_checks(ws, ws.run("npu"), **kw)
    return [f for f in report.findings if f.check == name]


def custom_net(build, batches, name="net"):
    """A classifier whose body `build(x)` returns logits, trained by SGD(0.05)."""
    g = pt.Graph(name, seed=0)
    with g.as_default():
        x = pt.placeholder("x", [None, batches[0][0][0].shape[1]])
        y = pt.placeholder("y", [None], "int32")
        loss = pt.ops.reduce_mean(pt.ops.sparse_softmax_cross_entropy_with_logits(build(x), y))
        train_op = pt.train.SGD(0.05).minimize(loss)
    return Net(g, [x], y, loss, train_op, batches)


def batch(x, y=None, n=32, seed=1):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 10, n).astype(np.int32) if y is None else y
    return [([x.astype(np.float32)], y)]


MIXED = pt.SessionConfig(precision_mode="allow_mix_precision")
FP16 = pt.SessionConfig(precision_mode="force_fp16")


# -- data -------------------------------------------------------------------------------------
def test_nonfinite_inputs(tmp_path):
    x = np.random.default_rng(0).normal(size=(32, 64))
    x[3, 5] = np.nan
    x[7, 1] = np.inf
    net = dense_net()
    net.batches = batch(x)
    (f,) = findings(dump_step(tmp_path, net, MIXED), "data.nonfinite")
    assert f.severity == "error" and f.evidence["nonfinite"] == 2


def test_labels_beyond_the_classes(tmp_path):
    """The step itself refuses such labels, so they are planted in the bundle's feeds (as a
    dump by another tool may hold them): the check reads the feeds and the graph only."""
    ws = dump_step(tmp_path, dense_net(), MIXED)
    bundle = ck.load_bundle(ws.bundle_path(ws.run("npu"), 0))
    bundle.feeds["y:0"] = np.arange(32, dtype=np.int32) % 13
    (f,) = ck.CHECKS["data.label_range"].run(ck.CheckContext(bundle, bundle.meta["config"], 1))
    assert f.severity == "error" and f.evidence["label_max"] == 12 and f.evidence["classes"] == 10


def test_one_class_per_batch_is_broken_shuffling(tmp_path):
    net = dense_net()
    net.batches = batch(np.random.default_rng(0).normal(size=(32, 64)), y=np.full(32, 3, np.int32))
    (f,) = findings(dump_step(tmp_path, net, MIXED), "data.label_range")
    assert f.severity == "warning" and f.evidence["distinct"] == 1


@pytest.mark.parametrize("scale, shift, severity", [(1e5, 0.0, "error"), (1.0, 100.0, "warning")])
def test_inputs_against_fp16(tmp_path, scale, shift, severity):
    net = dense_net()
    net.batches = batch(np.random.default_rng(0).normal(size=(32, 64)) * scale + shift)
    (f,) = findings(dump_step(tmp_path, net, MIXED), "data.fp16_range")
    assert f.severity == severity


# -- hyperparameters --------------------------------------------------------------------------
def test_an_epsilon_fp16_flushes(tmp_path):
    def body(x):
        h = pt.nn.dense(x, 32, name="fc1")
        var = pt.ops.reduce_mean(h * h, axis=-1, keep_dims=True)
        return pt.nn.dense(h * pt.ops.rsqrt(var + pt.constant(1e-12, name="eps")), 10, name="out")
    net = custom_net(body, batch(np.random.default_rng(0).normal(size=(32, 64))))
    (f,) = findings(dump_step(tmp_path, net, FP16), "hyperparameter.epsilon_fp16")
    assert f.severity == "error" and f.evidence["op"] == "eps" and "flushes to 0" in f.message


def test_a_learning_rate_too_high(tmp_path):
    net = dense_net(optimizer=pt.train.SGD(300.0))
    found = findings(dump_step(tmp_path, net, MIXED), "hyperparameter.learning_rate")
    assert found and found[0].severity == "error" and found[0].evidence["relative_update"] > 1


def test_a_learning_rate_an_fp16_variable_cannot_hold(tmp_path):
    g = pt.Graph("fp16_weights", seed=0)
    with g.as_default():
        x = pt.placeholder("x", [None, 8], "float16")
        y = pt.placeholder("y", [None], "int32")
        w = pt.variable("w", [8, 10], init="glorot_uniform", dtype="float16")
        loss = pt.ops.reduce_mean(pt.ops.sparse_softmax_cross_entropy_with_logits(
            pt.ops.cast(pt.ops.matmul(x, w), "float32"), y))
        train_op = pt.train.SGD(1e-6).minimize(loss)
    rng = np.random.default_rng(0)
    net = Net(g, [x], y, loss, train_op, [([rng.normal(size=(32, 8)).astype(np.float16)],
                                          rng.integers(0, 10, 32).astype(np.int32))])
    found = findings(dump_step(tmp_path, net, MIXED), "hyperparameter.learning_rate")
    assert [f.evidence.get("dtype") for f in found] == ["float16"]


def test_no_loss_scale_under_fp16_gradients(tmp_path):
    (f,) = findings(dump_step(tmp_path, dense_net(), FP16), "hyperparameter.loss_scale")
    assert f.severity == "warning" and f.evidence["precision_mode"] == "force_fp16"


def test_a_fixed_loss_scale_too_large(tmp_path):
    (f,) = findings(dump_step(tmp_path, dense_net(loss_scale=2.0 ** 20), FP16),
                    "hyperparameter.loss_scale")
    assert f.severity == "error" and f.evidence["loss_scale"] == 2.0 ** 20
    assert f.evidence["max_gradient"] * 2.0 ** 20 > 65504


# -- init -------------------------------------------------------------------------------------
@pytest.mark.parametrize("init, severity, phrase", [("zeros", "error", "all zero"),
                                                    (0.5, "error", "constant"),
                                                    ({"kind": "normal", "stddev": 10.0}, "warning", "fan-in")])
def test_initialisation(tmp_path, init, severity, phrase):
    def body(x):
        w = pt.variable("w", [64, 10], init=init)
        return pt.ops.matmul(x, w)
    net = custom_net(body, batch(np.random.default_rng(0).normal(size=(32, 64))))
    (f,) = findings(dump_step(tmp_path, net, MIXED), "init.scale")
    assert f.severity == severity and phrase in f.message and f.evidence["fan_in"] == 64


# -- graph and API ----------------------------------------------------------------------------
def test_a_variable_never_updated(tmp_path):
    def body(x):
        dead = pt.variable("dead", [64, 10], init="glorot_uniform")
        return pt.nn.dense(x, 10, name="out") + pt.ops.matmul(x, dead) * pt.constant(0.0, name="zero")
    net = custom_net(body, batch(np.random.default_rng(0).normal(size=(32, 64))))
    (f,) = findings(dump_step(tmp_path, net, MIXED), "graph.never_updated")
    assert f.evidence["variable"] == "dead" and "does not change" in f.message


def test_batch_norm_in_inference_mode_while_training(tmp_path):
    def body(x):
        h = pt.ops.reshape(x, [-1, 1, 8, 8])
        h = pt.nn.batch_norm(pt.nn.conv2d(h, 4, 3, name="conv"), training=False, name="bn")
        return pt.nn.dense(pt.ops.reshape(h, [-1, 256]), 10, name="out")
    net = custom_net(body, batch(np.random.default_rng(0).normal(size=(32, 64))))
    (f,) = findings(dump_step(tmp_path, net, MIXED), "api.inference_mode")
    assert f.evidence["op"].startswith("bn")


def test_golden_values_beyond_fp16_in_an_fp16_op(tmp_path):
    """Inputs of 6e4 (fp16 holds them) summed four at a time by a MatMul: 2.4e5 in the golden
    run, and the policy puts MatMul in fp16."""
    def body(x):
        return pt.ops.matmul(x, pt.variable("w", [4, 10], init=1.0))
    net = custom_net(body, batch(np.full((32, 4), 6e4)))
    ws = dump_step(tmp_path, net, MIXED)
    assert [f.severity for f in findings(ws, "data.fp16_range")] == ["warning"]   # unnormalised
    found = findings(ws, "graph.fp16_range")
    assert found and found[0].severity == "error" and found[0].evidence["max_abs"] == 2.4e5
    assert found[0].evidence["type"] == "MatMul"


@pytest.mark.parametrize("scale, found", [(1.0, False), (16.0, True)])
def test_an_fp16_fused_softmax_fed_beyond_its_exp_is_an_error(tmp_path, scale, found):
    """The Transformer fed the digits as shipped (0..1) or raw pixels (0..16) under
    allow_mix_precision: every golden value of its fp16 ops stays inside fp16 (scores reach
    about 70), so only what the fused softmax kernel does inside, exp of unshifted scores,
    leaves the range. The check judges the golden input against ln 65504, and names it."""
    m = pt.models.transformer()
    xb, yb = next(iter(pt.data.digits().batches(32, seed=0, epoch=0)))
    net = Net(m.graph, [m.x], m.y, m.loss, m.train_op, [([xb * scale], yb)])
    ws = dump_step(tmp_path, net, MIXED)
    inner = [f for f in findings(ws, "graph.fp16_range") if f.evidence.get("kernel")]
    if not found:
        assert inner == []
        return
    (f,) = inner
    assert f.severity == "error" and f.evidence["op"] == "encoder/layer_0/attention/Softmax"
    assert f.evidence["kernel"] == "SoftmaxV2" and f.evidence["max_abs"] > np.log(65504.0)


def test_a_fused_fp16_layer_norm_fed_beyond_its_square_is_an_error(tmp_path):
    """Inputs up to 400 into a LayerNorm under force_fp16: normalised, its output is small,
    but the fused kernel's one-pass variance squares x itself (160000 > 65504)."""
    def body(x):
        return pt.nn.dense(pt.nn.layer_norm(x, name="norm"), 10, name="head")
    net = custom_net(body, batch(np.random.default_rng(0).uniform(0, 400, size=(32, 64))))
    ws = dump_step(tmp_path, net, pt.SessionConfig(precision_mode="force_fp16"))
    inner = [f for f in findings(ws, "graph.fp16_range") if f.evidence.get("kernel")]
    assert [f.evidence["kernel"] for f in inner] == ["LayerNorm"]
    assert inner[0].evidence["op"] == "norm/Add_1" and inner[0].evidence["max_abs"] > 255.9


# -- determinism ------------------------------------------------------------------------------
def test_a_nondeterministic_kernel_is_named(tmp_path, monkeypatch):
    import dataclasses
    from precision_tool.ops import REGISTRY
    net = dense_net()
    ws = dump_step(tmp_path, net, MIXED)
    assert not findings(ws, "determinism")
    relu = REGISTRY["Relu"]
    noise = np.random.default_rng()             # unseeded on purpose: a racy kernel

    def racy(i, a, c):
        y = np.asarray(relu.kernel(i, a, c))
        return y + y.dtype.type(noise.normal() * 1e-6)
    monkeypatch.setitem(REGISTRY, "Relu", dataclasses.replace(relu, kernel=racy))
    (f,) = findings(ws, "determinism")
    assert f.severity == "error" and f.evidence["op"] == "Relu"


# -- no false positives -----------------------------------------------------------------------
@pytest.mark.parametrize("model", ["mlp", "cnn", "transformer"])
@pytest.mark.parametrize("config", [pt.SessionConfig(), pt.SessionConfig(precision_mode="force_fp32")],
                         ids=["default", "force_fp32"])
def test_the_shipped_models_trip_no_check(tmp_path, model, config):
    m = getattr(pt.models, model)()
    d = pt.data.digits()
    xb, yb = next(iter(d.batches(32, seed=0, epoch=0)))
    net = Net(m.graph, [m.x], m.y, m.loss, m.train_op, [([xb], yb)])
    report = ck.run_checks(dump_step(tmp_path, net, config), Workspace(str(tmp_path)).run("npu"))
    assert report.findings == [], [(f.check, f.message) for f in report.findings]
    assert len(report.checks) == len(ck.CHECKS)


def test_the_golden_replay_tells_its_progress(tmp_path):
    """check -g N replays N golden steps: progress(k, N) after each, so that the command can
    draw a bar (a thousand steps take a while)."""
    ws = dump_step(tmp_path, dense_net(), pt.SessionConfig())
    told = []
    ck.run_checks(ws, ws.run("npu"), golden_steps=5, progress=lambda k, n: told.append((k, n)))
    assert told[:5] == [(k, 5) for k in range(1, 6)]       # then the checks' own replays
    assert all(1 <= k <= n for k, n in told)


# -- the command ------------------------------------------------------------------------------
def test_check_a_script_stops_it_after_the_step_it_needs(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import numpy as np, precision_tool as pt
        from precision_tool import hooks
        from test_repair import dense_net
        net = dense_net()
        net.batches[0][0][0][0, 0] = np.nan                 # dirty data
        npu = pt.Session(net.graph, target="npu", config=hooks.session_dump_config(
            pt.SessionConfig(precision_mode="allow_mix_precision")))
        for k in range(1000):
            npu.run([net.loss, net.train_op], net.feed(k))
        print("TRAINED TO THE END")
    """))
    out = subprocess.run([sys.executable, "-m", "precision_tool", "--data-dir", str(tmp_path / "pd"),
                          "--json", "check", "--", sys.executable, str(script)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    assert "TRAINED TO THE END" not in out.stdout + out.stderr
    assert any(f["check"] == "data.nonfinite" for f in report["findings"]) and report["errors"] >= 1
    run = Workspace(str(tmp_path / "pd")).run("npu")
    assert run.bundles == [0]


def test_check_diff_lists_what_differs(tmp_path):
    net = dense_net()
    root = str(tmp_path)
    for config in (MIXED, pt.SessionConfig(precision_mode="force_fp16", overflow_mode="inf_nan")):
        sess = pt.Session(net.graph, target="npu", config=hooks.session_dump_config(
            config, action="dump", data_dir=root))
        sess.run([net.loss, net.train_op], net.feed(0))
        sess.close()
    out = CliRunner().invoke(cli, ["--data-dir", root, "--json", "check", "--diff", "npu/debug_0",
                                   "npu/debug_1"])
    assert out.exit_code == 1, out.output
    diffs = {d["what"]: (d["left"], d["right"]) for d in json.loads(out.output)["differences"]}
    assert diffs["precision_mode"] == ("allow_mix_precision", "force_fp16")
    assert diffs["overflow_mode"] == ("saturation", "inf_nan")
    dtypes = [v for k, v in diffs.items() if k.startswith("compute dtype of ")]
    assert dtypes and ("float32", "float16") in dtypes
    same = CliRunner().invoke(cli, ["--data-dir", root, "check", "--diff", "npu/debug_0", "npu/debug_0"])
    assert same.exit_code == 0 and "no configuration difference" in same.output


def test_a_pynative_runs_bundle_is_checked_and_replayed(tmp_path):
    """A pynative run's bundle records the passes that ran as a switch with every pass off;
    its configuration reads back (SessionConfig refused it: check and fix failed on any
    pynative dump), so check and a replay work on it."""
    m = pt.models.mlp(hidden=(16,))
    d = pt.data.digits()
    root = str(tmp_path / "pd")
    cfg = hooks.session_dump_config(pt.SessionConfig(mode="pynative",
                                                     precision_mode="allow_mix_precision"),
                                    action="dump", data_dir=root)
    for sess in (pt.Session(m.graph, target="npu", config=cfg),
                 hooks.sess_dump(pt.Session(m.graph), action="dump", data_dir=root)):
        sess.run([m.loss, m.train_op], {m.x: d.x_train[:32], m.y: d.y_train[:32]})
        sess.close()
    ws = Workspace(root)
    run = ws.run("npu")
    assert run.config.mode == "pynative" and run.config.effective_mode == "allow_mix_precision"
    report = ck.run_checks(ws, run)
    assert report.checks and report.precision_mode == "allow_mix_precision"
    out = CliRunner().invoke(cli, ["--data-dir", root, "train", "-d", "npu"])
    assert out.exit_code == 0 and "replayed into npu/debug_1" in out.output, out.output
    with pytest.raises(pt.PrecisionToolError, match="only mean something in graph mode"):
        pt.SessionConfig(mode="pynative", fusion_switch={"Switch": {"GraphFusion": {"ALL": "on"}}})


def test_feed_figures_from_statistics_are_those_of_the_values():
    """A statistics dump's feed is judged on figures rebuilt from its index row (max, min,
    mean and L2 norm over the finite elements, the nan/inf counts): they equal, to
    rounding, what float64 numpy gives on the values, and a mask is told from data by
    them as by its distinct values."""
    from precision_tool.analysis.replays.script_checks import _is_mask, _stats_of_mask
    from precision_tool.kernels import tensor_stats
    rng = np.random.default_rng(0)
    data = rng.normal(3.0, 2.0, (64, 9)).astype(np.float32)
    holed = data.copy()
    holed[1, 2], holed[5, 5], holed[7, 0] = np.nan, np.inf, -np.inf
    lowest = np.where(rng.random((8, 4)) < 0.3, np.finfo(np.float32).min, 0).astype(np.float32)
    cases = {"data": data, "holed": holed, "big": data * 1e5, "lowest": lowest,
             "ones": (rng.random((8, 4)) < 0.5).astype(np.float32),
             "minus_inf": np.where(rng.random((8, 4)) < 0.3, -np.inf, 0).astype(np.float32),
             "zeros": np.zeros((3, 3), np.float32), "all_nan": np.full(4, np.nan, np.float32),
             "three_values": np.array([0, 1, 2, 0], np.float32),
             "two_not_zero": np.array([1, 2, 1, 2], np.float32)}
    for name, v in cases.items():
        stats = tensor_stats(v)
        assert _stats_of_mask(v.size, stats) == _is_mask(v), name
        x = v.astype(np.float64).ravel()
        finite = x[np.isfinite(x)]
        got = ck.FeedFigures.from_stats(v.size, stats)
        assert got.elements == v.size and got.nonfinite == x.size - finite.size, name
        if finite.size:
            assert got.peak == np.abs(finite).max(), name
            assert got.mean == pytest.approx(finite.mean(), rel=1e-9, abs=1e-300), name
            assert got.std == pytest.approx(finite.std(), rel=1e-6, abs=1e-9 * abs(got.peak)), name
        else:
            assert np.isnan(got.peak) and np.isnan(got.mean), name
        # the findings are the same from either (their std may differ in the last digits)
        assert ck.feed_nonfinite(name, got) == ck.feed_nonfinite(name, v), name
        assert [(f.check, f.severity) for f in ck.feed_range(name, got)] == \
            [(f.check, f.severity) for f in ck.feed_range(name, v)], name
    assert [f.severity for f in ck.feed_range("big", cases["big"])] == ["error"]
    assert ck.feed_nonfinite("holed", cases["holed"])[0].evidence["nonfinite"] == 3
