"""Session: feeds, fetches, state across steps, determinism, initializers and error messages."""
import numpy as np
import pytest

import precision_tool as pt
from precision_tool import kernels


def _linear(batch=None):
    g = pt.Graph("lin", seed=5)
    with g.as_default():
        x = pt.placeholder("x", [batch, 3])
        y = pt.placeholder("y", [batch], "int32")
        logits = pt.nn.dense(x, 4, name="fc")
        loss = pt.ops.reduce_mean(pt.ops.sparse_softmax_cross_entropy_with_logits(logits, y))
        train = pt.train.SGD(0.1).minimize(loss)
    return g, x, y, logits, loss, train


XV = np.arange(6, dtype=np.float32).reshape(2, 3) / 6
YV = np.array([1, 3], dtype=np.int32)


def test_wrong_feed_shape_names_placeholder_and_both_shapes():
    g, x, y, logits, loss, train = _linear()
    with pytest.raises(pt.FeedError, match=r"placeholder 'x' expects shape \[\?, 3\], was fed shape \[2, 5\]"):
        pt.Session(g).run(loss, {x: np.zeros((2, 5), np.float32), y: YV})


def test_wrong_feed_dtype_names_placeholder_and_both_dtypes():
    g, x, y, logits, loss, train = _linear()
    with pytest.raises(pt.FeedError, match="placeholder 'y' expects int32, was fed float64"):
        pt.Session(g).run(loss, {x: XV, y: np.array([1.0, 2.0])})
    with pytest.raises(pt.FeedError, match="placeholder 'y' expects int32; fed values do not fit"):
        pt.Session(g).run(loss, {x: XV, y: np.array([1, 2 ** 40])})


def test_missing_feed_and_bad_feed_keys():
    g, x, y, logits, loss, train = _linear()
    with pytest.raises(pt.FeedError, match="placeholder 'y' must be fed a value of int32"):
        pt.Session(g).run(loss, {x: XV})
    with pytest.raises(pt.FeedError, match="only placeholders are fed"):
        pt.Session(g).run(loss, {x: XV, y: YV, logits: np.zeros((2, 4))})
    with pytest.raises(pt.FeedError, match="no tensor or op named 'nope:0'"):
        pt.Session(g).run(loss, {"nope:0": XV})


def test_unknown_fetch_is_named():
    g, *_ = _linear()
    with pytest.raises(pt.FetchError, match="graph 'lin' has no tensor or op named 'fc/Nope:0'"):
        pt.Session(g).run("fc/Nope:0")
    with pytest.raises(pt.FetchError, match="has 1 outputs|no tensor"):
        pt.Session(g).run("fc/MatMul:3")
    other = pt.Graph("other")
    with other.as_default():
        z = pt.constant(1.0)
    with pytest.raises(pt.FetchError, match="belongs to graph 'other'"):
        pt.Session(g).run(z)


@pytest.mark.parametrize("build, message", [
    (lambda: pt.ops.matmul(pt.placeholder("a", [2, 3]), pt.placeholder("b", [4, 5])),
     r"MatMul block/MatMul: inner dimensions differ: a is float32\[2, 3\].*b is float32\[4, 5\]"),
    (lambda: pt.ops.add(pt.placeholder("a", [2, 3]), pt.placeholder("b", [4])),
     r"Add block/Add: shapes do not broadcast: x is \[2, 3\], y is \[4\]"),
    (lambda: pt.ops.add(pt.placeholder("a", [2]), pt.placeholder("b", [2], "int32")),
     r"Add block/Add: dtypes differ: x is float32, y is int32"),
    (lambda: pt.ops.conv2d(pt.placeholder("a", [1, 3, 8, 8]), pt.variable("f", [4, 2, 3, 3])),
     r"Conv2D block/Conv2D: input channels of float32\[1, 3, 8, 8\] differ from filter float32\[4, 2, 3, 3\]"),
    (lambda: pt.ops.reshape(pt.placeholder("a", [2, 3]), [4, 2]),
     r"Reshape block/Reshape: cannot reshape float32\[2, 3\] \(6 elements\) into \[4, 2\] \(8 elements\)"),
    (lambda: pt.ops.softmax(pt.placeholder("a", [2, 3]), axis=2), r"Softmax block/Softmax: axis 2 is out of range"),
])
def test_build_errors_name_the_op_and_both_shapes(build, message):
    g = pt.Graph("e")
    with g.as_default(), pytest.raises(pt.GraphError, match=message):
        with pt.name_scope("block"):
            build()


def test_kernel_failure_names_the_op():
    g, x, y, logits, loss, train = _linear()
    with pytest.raises(pt.ExecutionError, match=r"op 'SparseSoftmaxCrossEntropyWithLogits' .*label 7 is outside \[0, 4\)"):
        pt.Session(g).run(loss, {x: XV, y: np.array([1, 7], np.int32)})


def test_variables_persist_and_the_train_op_updates_all_of_them():
    g, x, y, logits, loss, train = _linear()
    sess = pt.Session(g)
    start = sess.variables()
    losses = [float(sess.run([loss, train], {x: XV, y: YV})[0]) for _ in range(20)]
    assert losses[-1] < losses[0]
    after = sess.variables()
    assert set(after) == {"fc/kernel", "fc/bias"}
    assert all(not np.array_equal(start[k], after[k]) for k in after)
    assert sess.step == 20


def test_fetched_arrays_never_alias_session_state():
    g, *_ = _linear()
    sess = pt.Session(g)
    w = sess.run("fc/kernel")
    w[:] = 123.0
    assert not (sess.run("fc/kernel") == 123.0).any()
    state = sess.variables()
    state["fc/kernel"][:] = 7
    assert not (sess.variables()["fc/kernel"] == 7).any()


def test_load_variables_checks_names_and_shapes():
    g, *_ = _linear()
    sess = pt.Session(g)
    sess.load_variables({"fc/bias": np.ones(4)})
    np.testing.assert_array_equal(sess.run("fc/bias"), np.ones(4, np.float32))
    with pytest.raises(pt.FeedError, match="no variable named 'fc/nope'"):
        sess.load_variables({"fc/nope": np.ones(4)})
    with pytest.raises(pt.FeedError, match=r"variable 'fc/bias' has shape \[4\], was given \[5\]"):
        sess.load_variables({"fc/bias": np.ones(5)})


def test_fetch_structures_are_preserved():
    g, x, y, logits, loss, train = _linear()
    out = pt.Session(g).run({"pair": (loss, logits), "op": train, "name": "fc/bias"},
                            {x: XV, y: YV})
    assert set(out) == {"pair", "op", "name"}
    assert isinstance(out["pair"], tuple) and out["pair"][1].shape == (2, 4)
    assert out["op"] is None and out["name"].shape == (4,)


def _train_mlp_with_dropout(steps=4):
    g = pt.Graph("det", seed=11)
    with g.as_default():
        x = pt.placeholder("x", [None, 64])
        y = pt.placeholder("y", [None], "int32")
        h = pt.nn.dropout(pt.nn.dense(x, 32, activation=pt.ops.relu), 0.2, seed=3)
        logits = pt.nn.dense(h, 10)
        loss = pt.ops.reduce_mean(pt.ops.sparse_softmax_cross_entropy_with_logits(logits, y))
        train = pt.train.Adam(0.01).minimize(loss)
    d = pt.data.digits()
    sess = pt.Session(g)
    losses = [sess.run([loss, train], {x: d.x_train[:32], y: d.y_train[:32]})[0] for _ in range(steps)]
    return np.array(losses), sess.variables()


def test_training_is_bit_for_bit_deterministic():
    l1, v1 = _train_mlp_with_dropout()
    l2, v2 = _train_mlp_with_dropout()
    assert l1.tobytes() == l2.tobytes()
    assert all(v1[k].tobytes() == v2[k].tobytes() for k in v1)


def test_fp64_golden_runs_in_float64_from_the_same_start():
    g, x, y, logits, loss, train = _linear()
    s32 = pt.Session(g)
    s64 = pt.Session(g, config=pt.SessionConfig(golden_dtype="float64"))
    for name, v in s64.variables().items():
        assert v.dtype == np.float64
        np.testing.assert_array_equal(v, s32.variables()[name].astype(np.float64))
    l64 = s64.run(loss, {x: XV, y: YV})
    l32 = s32.run(loss, {x: XV, y: YV})
    assert l64.dtype == np.float64 and l32.dtype == np.float32
    assert abs(float(l64) - float(l32)) < 1e-6
    with pytest.raises(pt.PrecisionToolError, match="golden_dtype"):
        pt.SessionConfig(golden_dtype="float16")


def test_unknown_target_lists_the_available_ones():
    g, *_ = _linear()
    with pytest.raises(pt.PrecisionToolError, match="unknown target 'tpu'; available: cpu"):
        pt.Session(g, target="tpu")


def test_initializers_are_seeded_by_name_and_follow_their_distribution():
    def values(seed):
        g = pt.Graph("init", seed=seed)
        with g.as_default():
            pt.variable("a", [200, 300], init="glorot_uniform")
            pt.variable("b", [200, 300], init="glorot_uniform")
            pt.variable("he", [64, 32, 3, 3], init="he_normal")
            pt.variable("tn", [10000], init={"kind": "truncated_normal", "stddev": 0.5})
            pt.variable("c", [3], init=0.25)
            pt.variable("z", [3], init="zeros")
            pt.variable("s", [3], init="normal", seed=42)
        return pt.Session(g).variables()
    v = values(0)
    limit = np.sqrt(6 / 500)
    assert np.abs(v["a"]).max() <= limit and np.abs(v["a"]).max() > 0.99 * limit
    assert not np.array_equal(v["a"], v["b"])
    assert abs(v["he"].std() - np.sqrt(2 / (32 * 9))) < 0.01
    assert np.abs(v["tn"]).max() <= 1.0 and abs(v["tn"].std() - 0.44) < 0.02
    np.testing.assert_array_equal(v["c"], [0.25] * 3)
    np.testing.assert_array_equal(v["z"], [0, 0, 0])
    again, other = values(0), values(1)
    assert all(np.array_equal(v[k], again[k]) for k in v)
    assert not np.array_equal(v["a"], other["a"])
    with pytest.raises(pt.GraphError, match="unknown initializer"):
        g = pt.Graph("bad")
        with g.as_default():
            pt.variable("q", [2], init="magic")


def test_integer_placeholders_accept_any_integer_that_fits():
    g, x, y, logits, loss, train = _linear()
    out = pt.Session(g).run(loss, {x: XV.tolist(), y: [1, 3]})
    assert np.isfinite(out)


class _Watch:
    """An observer that wants what it is told to want and keeps the last trace."""

    def __init__(self, want):
        self.want, self.trace = want, None

    def begin_run(self, session, feeds, fetch_tensors, fetch_nodes):
        return self.want

    def end_run(self, session, trace):
        self.trace = trace

    def abort_run(self, session, error):
        pass


@pytest.mark.parametrize("model", ["mlp", "cnn", "transformer"])
@pytest.mark.parametrize("target", ["npu", "cpu"])
def test_a_statistics_only_run_keeps_no_values_and_has_each_ones_statistics(model, target):
    """Observers that all ask for statistics only get a run that kept no values, with each
    value's statistics in its row (plan.slots): those of the value a run that keeps them
    made, bit for bit: every op's outputs (5HD ones over their real values, padding left out,
    with the stored size), feeds, variables."""
    from precision_tool import numerics
    from precision_tool.runtime.plan import STATS_ONLY
    m = getattr(pt.models, model)()
    d = pt.data.digits()
    values, stats = _Watch(True), _Watch(STATS_ONLY)
    sessions = []
    for watch in (values, stats):
        sessions.append(pt.Session(m.graph, target=target))
        sessions[-1].add_observer(watch)
    for step in range(2):
        feed = {m.x: d.x_train[8 * step:8 * step + 8], m.y: d.y_train[8 * step:8 * step + 8]}
        for sess in sessions:
            sess.run([m.loss, m.train_op], feed)
    kept, table = values.trace, stats.trace
    assert table.outputs is None and kept.stats is None
    plan = kept.plan
    want = np.full((plan.slots[""], 8), np.nan)
    for node, outputs in zip(plan.nodes, kept.outputs):
        for k, value in enumerate(outputs):
            row = want[plan.slots[node.name] + k]
            spec = node.outputs[k]
            if spec.format == "NC1HWC0":
                kernels.stats_row(numerics.logical_view(value, spec.original_shape[1]), row)
                row[7] = value.size
            else:
                kernels.stats_row(value, row)
    for name, value in kept.feeds.items():
        kernels.stats_row(value, want[plan.slots[name]])
    assert np.array_equal(table.stats, want, equal_nan=True)
    assert int(want[:, 7].sum()) > 1000
    assert table.scalar(m.loss.name) == float(kept.value(m.loss.name))


@pytest.mark.parametrize("target", ["npu", "cpu"])
def test_a_statistics_only_run_of_one_feed_and_one_variable_or_none(target):
    """The sources are picked by name in one call: one feed, one variable or none at all
    are picked as well as many (an eval plan, a graph without weights)."""
    from precision_tool.runtime.plan import STATS_ONLY
    g = pt.Graph("one")
    with g.as_default():
        x = pt.placeholder("x", [2])
        w = pt.ops.variable("w", [2], init="ones")
        scaled = pt.ops.mul(x, w)
        bare = pt.ops.exp(x)
        doubled = pt.ops.add(w, w)
    sess = pt.Session(g, target=target)
    watch = _Watch(STATS_ONLY)
    sess.add_observer(watch)
    xv = np.array([0.5, -2.0], np.float32)
    ones = np.ones(2, np.float32)
    for fetch, feed, sources in ((scaled, {x: xv}, {"x:0": xv, "w:0": ones}),
                                 (bare, {x: xv}, {"x:0": xv}),
                                 (doubled, {}, {"w:0": ones})):
        sess.run(fetch, feed)
        trace = watch.trace
        assert trace.outputs is None
        for name, value in sources.items():
            want = np.empty(8)
            kernels.stats_row(value, want)
            assert np.array_equal(trace.stats[trace.row(name)], want), name


def test_values_are_kept_when_any_observer_needs_them():
    from precision_tool.runtime.plan import STATS_ONLY
    m = pt.models.mlp()
    d = pt.data.digits()
    sess = pt.Session(m.graph, target="npu")
    stats, values, idle = _Watch(STATS_ONLY), _Watch(True), _Watch(False)
    for watch in (stats, values, idle):
        sess.add_observer(watch)
    sess.run(m.train_op, {m.x: d.x_train[:8], m.y: d.y_train[:8]})
    assert stats.trace is values.trace and stats.trace.outputs is not None
    assert idle.trace is None


def test_a_scalar_is_read_back_from_its_statistics():
    from precision_tool.runtime.plan import ExecutionPlan, RunTrace
    g = pt.Graph("g")
    with g.as_default():
        pt.constant(np.ones((2, 3), np.float32), name="wide")
    node = g.node("wide")
    plan = ExecutionPlan((node,), ((),), frozenset())
    trace = RunTrace(plan, None, {}, stats=np.zeros((1, 8)))
    for row, want in (([5.5, 5.5, 5.5, 5.5, 0, 0, 0, 1], 5.5), ([np.nan] * 4 + [1, 0, 0, 1], None),
                      ([np.nan] * 4 + [0, 1, 0, 1], np.inf), ([np.nan] * 4 + [0, 0, 1, 1], -np.inf)):
        trace.stats[0] = row
        got = trace.scalar("wide:0")
        assert np.isnan(got) if want is None else got == want
    trace.stats[0, 7] = 6
    with pytest.raises(ValueError, match="holds 6 values"):
        trace.scalar("wide:0")


def test_a_statistics_only_run_takes_strided_and_integer_sources():
    """The sources' statistics come in one C call where it can (integer feeds too); a strided
    variable (load_variables keeps a view it need not convert) goes the slower way, to the
    same numbers, as the integers' agree with a float64 reference."""
    from precision_tool.runtime.plan import STATS_ONLY
    g, x, y, logits, loss, train = _linear()
    sess = pt.Session(g, target="npu")
    watch = _Watch(STATS_ONLY)
    sess.add_observer(watch)
    wide = np.arange(24, dtype=np.float32).reshape(3, 8) / 10
    sess.load_variables({"fc/kernel": wide[:, ::2]})
    assert not sess.variables(copy=False)["fc/kernel"].flags.c_contiguous
    for step in range(2):       # strided at the start of both runs
        sess.run(train, {x: XV, y: YV})
        if step == 0:
            sess.load_variables({"fc/kernel": wide[:, 1::2]})
    trace = watch.trace
    for name, value in (("fc/kernel", wide[:, 1::2]), ("y:0", YV)):
        want = np.empty(8)
        kernels.stats_row(value, want)
        assert np.array_equal(trace.stats[trace.plan.slots[name]], want), name
    labels = YV.astype(np.float64)
    assert np.allclose(trace.stats[trace.plan.slots["y:0"]],
                       [labels.max(), labels.min(), labels.mean(), np.sqrt((labels ** 2).sum()),
                        0, 0, 0, labels.size], rtol=1e-15)


def test_a_session_config_round_trips_through_its_saved_form(tmp_path):
    """to_dict inlines the mixlist and the switch file (a saved config must not depend on
    files that may move), from_dict rebuilds the same config, an unknown field is refused."""
    import json
    mixlist = {"black-list": {"to-add": ["SoftmaxV2"]}}
    (tmp_path / "mix.json").write_text(json.dumps(mixlist))
    switch = {"Switch": {"GraphFusion": {"SoftmaxFusionPass": "off"}, "UBFusion": {}}}
    (tmp_path / "switch.cfg").write_text(json.dumps(switch))
    cfg = pt.SessionConfig(precision_mode="allow_mix_precision", overflow_mode="inf_nan",
                           modify_mixlist=str(tmp_path / "mix.json"),
                           fusion_switch_file=str(tmp_path / "switch.cfg"))
    saved = json.loads(json.dumps(cfg.to_dict()))
    assert saved["modify_mixlist"] == mixlist and saved["fusion_switch"] == switch
    again = pt.SessionConfig.from_dict(saved)
    assert again.precision_mode == "allow_mix_precision" and again.overflow_mode == "inf_nan"
    assert again.modify_mixlist == mixlist and again.fusion_switch == switch
    ran = pt.SessionConfig().to_dict(fusion_ran={"SoftmaxFusionPass"})["fusion_switch"]
    assert ran["Switch"]["GraphFusion"] == {"ALL": "off", "SoftmaxFusionPass": "on"}
    with pytest.raises(pt.PrecisionToolError, match="unknown session config field"):
        pt.SessionConfig.from_dict({"precision_mod": "force_fp16"})
