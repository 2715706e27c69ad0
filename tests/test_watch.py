"""Training watchpoints: each condition with its problem planted is hit (with the numbers),
written to watch/hits.csv and said once on stderr; the shipped models' default training hits
none; `wp` lists the hits first hit first and `ac` shows them."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

import precision_tool as pt
from precision_tool import hooks
from precision_tool.cli import cli
from precision_tool.dump import watch
from test_repair import Net, dense_net


def train(tmp_path, net, condition, steps=6, config=None, target="cpu", **thresholds):
    cfg = hooks.watch(config, data_dir=str(tmp_path), conditions=[condition], **thresholds)
    sess = pt.Session(net.graph, target=target, config=cfg)
    for k in range(steps):
        sess.run([net.loss, net.train_op], net.feed(k))
    (observer,) = sess.observers
    return [h for h in observer.hits if h.condition == condition]


def body_net(build, x, optimizer=None, loss_weight=None):
    g = pt.Graph("body", seed=0)
    with g.as_default():
        xp = pt.placeholder("x", [None, x.shape[1]])
        y = pt.placeholder("y", [None], "int32")
        loss = pt.ops.reduce_mean(pt.ops.sparse_softmax_cross_entropy_with_logits(build(xp), y))
        if loss_weight is not None:
            loss = loss * pt.constant(loss_weight, name="loss_weight")
        train_op = (optimizer or pt.train.SGD(0.05)).minimize(loss)
    labels = np.random.default_rng(1).integers(0, 10, len(x)).astype(np.int32)
    return Net(g, [xp], y, loss, train_op, [([x.astype(np.float32)], labels)])


X = np.random.default_rng(0).normal(size=(32, 64))


def test_vanishing_gradients(tmp_path):
    net = body_net(lambda x: pt.nn.dense(x, 10, name="out"), X, loss_weight=1e-12)
    hits = train(tmp_path, net, "gradient_vanishing")
    assert hits and all(h.value < 1e-10 for h in hits) and hits[0].step == 0


def test_exploding_gradients(tmp_path):
    net = body_net(lambda x: pt.nn.dense(x, 10, name="out"), X * 1e6)
    hits = train(tmp_path, net, "gradient_exploding")
    assert hits and hits[0].value > 1e4


def cut_off(x):
    """A dense layer plus a weight the loss does not feel (its product times zero)."""
    dead = pt.variable("dead", [x.shape[1], 10], init="glorot_uniform")
    return pt.nn.dense(x, 10, name="out") + pt.ops.matmul(x, dead) * pt.constant(0.0, name="zero")


def test_weights_that_stand_still(tmp_path):
    hits = train(tmp_path, body_net(cut_off, X), "weights_static")
    assert {h.tensor for h in hits} == {"dead"} and len(hits) == 6


def test_weights_that_jump(tmp_path):
    net = body_net(lambda x: pt.nn.dense(x, 10, name="out"), X, optimizer=pt.train.SGD(300.0))
    hits = train(tmp_path, net, "weights_jump")
    assert hits and hits[0].value > 0.5 and hits[0].tensor == "out/kernel"


def test_activations_all_zero(tmp_path):
    net = body_net(lambda x: pt.nn.dense(pt.ops.relu(pt.ops.neg(x) - 100.0), 10, name="out"), X)
    hits = train(tmp_path, net, "activation_zero", steps=2)
    assert hits[0].tensor == "Relu:0" and {h.step for h in hits} == {0, 1}


def test_activations_at_the_fp16_maximum(tmp_path):
    net = dense_net(scale=1e5)
    hits = train(tmp_path, net, "activation_fp16_max", steps=1, target="npu",
                 config=pt.SessionConfig(precision_mode="force_fp16"))
    assert hits and all(h.value == 65504 for h in hits)


def test_nonfinite_tensors_and_a_nan_loss(tmp_path):
    x = X.copy()
    x[0, 0] = np.nan
    net = body_net(lambda x: pt.nn.dense(x, 10, name="out"), x)
    (first, *_) = train(tmp_path, net, "nonfinite", steps=2)
    assert first.step == 0 and first.tensor.startswith("out/")     # where it starts
    assert all(np.isnan(h.value) for h in train(tmp_path, net, "loss_nan", steps=2))


def test_a_loss_that_stalls(tmp_path):
    net = body_net(lambda x: pt.nn.dense(x, 10, name="out"), X, optimizer=pt.train.SGD(1e-12))
    hits = train(tmp_path, net, "loss_stalled", steps=7, loss_patience=3)
    # said once per loss_patience steps of stall, not every step after the first
    assert [h.step for h in hits] == [3, 6] and hits[0].value == 3


def test_a_loss_scale_stuck_at_its_minimum(tmp_path):
    """Inputs beyond fp16 under inf_nan: every step overflows, the dynamic scale falls to its
    minimum and stays."""
    manager = pt.train.DynamicLossScaleManager(init_loss_scale=4.0, scale_window=100)
    net = body_net(lambda x: pt.nn.dense(x, 10, name="out"), X * 1e5,
                   optimizer=pt.train.LossScaleOptimizer(pt.train.SGD(0.05), manager))
    hits = train(tmp_path, net, "loss_scale_min", steps=8, target="npu", scale_patience=3,
                 config=pt.SessionConfig(precision_mode="force_fp16", overflow_mode="inf_nan"))
    assert hits and hits[0].value == 1.0


# -- where hits go ----------------------------------------------------------------------------
def test_hits_are_written_and_said_once(tmp_path, capsys):
    train(tmp_path, body_net(cut_off, X), "weights_static", steps=4)
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("watchpoint")]
    assert len(said) == 1 and "weights_static at step 0" in said[0]
    hits = watch.read_hits(str(tmp_path))
    assert [h["step"] for h in hits] == [0, 1, 2, 3] and hits[0]["tensor"] == "dead"
    with open(tmp_path / "watch" / "hits.csv", "a") as f:       # a torn last line is skipped
        f.write("2026-01-01T00:00:00,cpu:x,7,weights_sta")
    assert len(watch.read_hits(str(tmp_path))) == 4


def test_wp_lists_first_hits_first_and_ac_shows_them(tmp_path):
    from test_repair import dump_step
    x = X.copy()
    x[0, 0] = np.inf
    net = body_net(lambda x: pt.nn.dense(x, 10, name="out"), x)
    dump_step(tmp_path, dense_net(), pt.SessionConfig())        # a workspace to check
    train(tmp_path, body_net(lambda x: pt.nn.dense(x, 10, name="out"), X,
                             optimizer=pt.train.SGD(1e-12)), "loss_stalled", steps=7, loss_patience=2)
    train(tmp_path, net, "nonfinite", steps=2)
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "wp"])
    assert out.exit_code == 1
    data = json.loads(out.output)
    assert data["hits"] == 3 + 2
    assert [h["condition"] for h in data["shown"]] == ["nonfinite", "loss_stalled"]  # by step
    # (once per two steps of stall: steps 2, 4 and 6)
    assert data["shown"][1]["count"] == 3 and data["shown"][1]["last_step"] == 6
    every = json.loads(CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "wp", "-a"]).output)
    assert len(every["shown"]) == 5
    ac = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "ac"])
    assert ac.exit_code == 1 and "Training watchpoints" in ac.output and "precision-tool wp" in ac.output
    empty = CliRunner().invoke(cli, ["--data-dir", str(tmp_path / "none"), "wp"])
    assert empty.exit_code == 0 and "no watchpoint hit" in empty.output


def test_unknown_conditions_and_thresholds_are_refused():
    with pytest.raises(pt.PrecisionToolError, match="unknown watch condition"):
        hooks.watch(conditions=["gradient_vanish"])
    with pytest.raises(pt.PrecisionToolError, match="unknown watch threshold"):
        pt.trainer.WatchpointCallback(grad_mx=3)


# -- no false positives -----------------------------------------------------------------------
def test_a_long_healthy_run_never_stalls(tmp_path):
    """The MLP trained 20 epochs of 32 batches (640 steps, well past loss_patience): its batch
    loss falls to 0.03 and wanders there. The raw best batch was an outlier the next fifty
    did not beat, and loss_stalled fired at every step from 205 on; the smoothed loss of a
    model that has learned (below loss_progress of its start) is convergence."""
    from precision_tool.trainer import Model, NumpySlicesDataset, WatchpointCallback
    d = pt.data.digits()
    data = NumpySlicesDataset((d.x_train[:1024], d.y_train[:1024])).shuffle(0).batch(
        32, drop_remainder=True)
    callback = WatchpointCallback(data_dir=str(tmp_path))
    Model(pt.models.mlp_network(), pt.nn.SoftmaxCrossEntropyWithLogits(),
          pt.train.Adam(0.01)).train(20, data, callbacks=[callback])
    assert callback.hits == [], [(h.step, h.condition, h.message) for h in callback.hits[:5]]


@pytest.mark.parametrize("model", ["mlp", "cnn", "transformer"])
def test_the_shipped_models_default_training_hits_nothing(tmp_path, model):
    from precision_tool.trainer import Model, NumpySlicesDataset, WatchpointCallback
    d = pt.data.digits()
    data = NumpySlicesDataset((d.x_train[:256], d.y_train[:256])).batch(32, drop_remainder=True)
    network = getattr(pt.models, f"{model}_network")()
    callback = WatchpointCallback(data_dir=str(tmp_path))
    Model(network, pt.nn.SoftmaxCrossEntropyWithLogits(), pt.train.Adam(0.01)).train(
        3, data, callbacks=[callback])
    assert callback.hits == [], [(h.condition, h.message) for h in callback.hits[:5]]
    assert watch.read_hits(str(tmp_path)) == []
