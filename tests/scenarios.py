"""Realistic mixed-precision failures (and clean runs), each built with the public API into a
workspace of its own: a model, a cause, a precision mode and an overflow mode. The diagnosis
suite (test_scenarios.py) runs `ac -c` on each and checks what it says; `python
tests/scenarios.py` prints the table of what `ac -c` says for every scenario.

A scenario's expectations are what a user who knows the cause would accept: the op where
the divergence starts (or a part of its name), the first overflowing kernel, the step
reported, a phrase the advice must hold (and one it must not), and the exit code.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional


import precision_tool as pt
from precision_tool import hooks


@dataclass
class Scenario:
    name: str
    summary: str                           # model, cause, mode in a few words
    build: Callable[[str], None]           # writes the workspace at root
    exit_code: int
    origin: Optional[str] = None           # a substring of the origin op's name; "" none
    first_overflow: Optional[str] = None   # a substring of the first overflow's op; "" none
    step: Optional[int] = None
    advice: List[str] = field(default_factory=list)      # phrases the advice holds
    not_advice: List[str] = field(default_factory=list)  # phrases it must not hold
    args: List[str] = field(default_factory=list)        # more ac options
    # other commands on the same workspace: (arguments, exit code, phrases their output
    # holds, phrases it must not hold)
    also: List[tuple] = field(default_factory=list)


def _sessions(root, graph, npu_config, steps, golden_config=None, dump_step=None):
    when = dump_step or f"0-{steps - 1}"
    npu = pt.Session(graph, target="npu", config=hooks.session_dump_config(
        npu_config, action="dump", dump_step=when, data_dir=root))
    cpu = hooks.sess_dump(pt.Session(graph, config=golden_config or pt.SessionConfig()),
                          action="dump", dump_step=when, data_dir=root)
    return npu, cpu


def _train(root, model, npu_config, steps=1, scale=1.0, batch=32, golden_config=None,
           dump_step=None, fetch_extra=()):
    d = pt.data.digits()
    npu, cpu = _sessions(root, model.graph, npu_config, steps, golden_config, dump_step)
    for sess in (npu, cpu):
        for _, (xb, yb) in zip(range(steps), d.batches(batch, seed=0, epoch=0)):
            sess.run([model.loss, model.train_op, *fetch_extra], {model.x: xb * scale, model.y: yb})
        sess.close()


# -- the causes -------------------------------------------------------------------------------
def softmax_overflow(root):
    """The Transformer on raw pixels: attention scores beyond fp16 in the fused softmax."""
    _train(root, pt.models.transformer(), pt.SessionConfig(precision_mode="allow_mix_precision"),
           scale=16.0)


def input_beyond_fp16_inf_nan(root):
    """Inputs of 1e5 fed to an fp16 MLP: the inserted Cast of the feed overflows to inf."""
    _train(root, pt.models.mlp(), pt.SessionConfig(precision_mode="force_fp16",
                                                   overflow_mode="inf_nan"), scale=1e5)


def input_beyond_fp16_saturation(root):
    """The same inputs under saturation: clipped at 65504, finite, direction kept."""
    _train(root, pt.models.mlp(), pt.SessionConfig(precision_mode="force_fp16"), scale=1e5)


def _tiny_loss_mlp(factor: float = 2.0 ** -20):
    """An MLP whose loss is scaled down by `factor`, no loss scale (2**-20: a loss averaged
    over a huge batch, say; its gradients sit below fp16's smallest subnormal)."""
    g = pt.Graph("tiny_loss", seed=0)
    with g.as_default():
        x = pt.placeholder("x", [None, 64])
        y = pt.placeholder("y", [None], "int32")
        h = pt.ops.relu(pt.nn.dense(x, 32, name="fc1"))
        logits = pt.nn.dense(h, 10, name="logits")
        loss = pt.ops.reduce_mean(pt.ops.sparse_softmax_cross_entropy_with_logits(logits, y)) \
            * pt.constant(factor, name="loss_weight")
        train_op = pt.train.SGD(0.1).minimize(loss)
    return _Bundle(g, x, y, loss, train_op)


@dataclass
class _Bundle:
    graph: object
    x: object
    y: object
    loss: object
    train_op: object


def gradient_underflow(root):
    """fp16 gradients of a tiny loss, no loss scale: most of them flush to zero."""
    _train(root, _tiny_loss_mlp(), pt.SessionConfig(precision_mode="force_fp16"))


def gradient_underflow_mixed(root):
    """The same under allow_mix_precision (the matmuls in fp16, the rest in fp32)."""
    _train(root, _tiny_loss_mlp(), pt.SessionConfig(precision_mode="allow_mix_precision"))


def _small_factor_graph():
    """A fused elementwise chain of multiplies by a small factor: products, not sums."""
    g = pt.Graph("small_factor", seed=0)
    with g.as_default():
        x = pt.placeholder("x", [None, 64])
        y = pt.placeholder("y", [None], "int32")
        h = pt.nn.dense(x, 32, name="fc1")
        scaled = pt.ops.mul(pt.ops.mul(h, pt.constant(1e-4, name="f1")), pt.constant(2e-4, name="f2"))
        logits = pt.nn.dense(pt.ops.relu(scaled) * pt.constant(3e4, name="f3"), 10, name="logits")
        loss = pt.ops.reduce_mean(pt.ops.sparse_softmax_cross_entropy_with_logits(logits, y))
        train_op = pt.train.SGD(0.01).minimize(loss)
    return _Bundle(g, x, y, loss, train_op)


def small_factor_product(root):
    """Values multiplied down to 2e-8 in fp16 lose their digits (subnormals): a product is
    no cancellation, so the fused multiply is the origin."""
    _train(root, _small_factor_graph(), pt.SessionConfig(precision_mode="force_fp16"))


def carried_state(root):
    """The unnormalised Transformer over four steps: from step 1 the weights the fused
    softmax's error updated differ when the step starts."""
    _train(root, pt.models.transformer(), pt.SessionConfig(precision_mode="allow_mix_precision"),
           steps=4, scale=16.0, dump_step="2")


def carried_state_all(root):
    """The same, every step dumped: the update of an earlier step wrote the state."""
    _train(root, pt.models.transformer(), pt.SessionConfig(precision_mode="allow_mix_precision"),
           steps=3, scale=16.0)


def loss_scale_too_large(root):
    """MindSpore-style O2 training of the CNN: the default dynamic loss scale 2**24 does not
    fit fp16, so the first steps overflow in the scaled backward."""
    from precision_tool.trainer import DumpCallback, Model, NumpySlicesDataset
    d = pt.data.digits()
    data = NumpySlicesDataset((d.x_train[:128], d.y_train[:128])).batch(32, drop_remainder=True)
    for target in ("cpu", "npu"):
        model = Model(pt.models.cnn_network(), pt.nn.SoftmaxCrossEntropyWithLogits(),
                      pt.train.Momentum(0.05, 0.9), amp_level="O2", target=target)
        model.train(1, data, callbacks=[DumpCallback(action="dump", dump_step="0",
                                                     data_dir=root)])


def layer_norm_fp16_variance(root):
    """A Transformer on features scaled by 300 under force_fp16: attention scores reach
    25168, so the fused softmax's exp overflows inside the kernel (saturation keeps its
    output finite: only the status word shows it) and the softmax diverges; the fused
    LayerNorm's variance leaves fp16's range inside its kernel after it."""
    _train(root, pt.models.transformer(), pt.SessionConfig(precision_mode="force_fp16"),
           scale=300.0)


def epsilon_below_fp16(root, activation="tanh"):
    """A hand-written layer norm with BERT's epsilon of 1e-12 under force_fp16 (saturation),
    fed a batch whose first rows are padding (zeros): the epsilon flushes to zero in fp16, the
    padding rows' variance is 0, and rsqrt saturates there. The loss stays plausible; the
    gradient through the tanh (whose slope at 0 is 1, where a relu's is 0 and would absorb it)
    scales by rsqrt, 65504 against the golden's 1e6."""
    g = pt.Graph("eps_norm", seed=0)
    with g.as_default():
        x = pt.placeholder("x", [None, 64])
        y = pt.placeholder("y", [None], "int32")
        h = pt.nn.dense(x, 32, name="fc1")
        with pt.name_scope("norm"):
            c = h - pt.ops.reduce_mean(h, axis=1, keep_dims=True)
            var = pt.ops.reduce_mean(pt.ops.square(c), axis=1, keep_dims=True)
            n = c * pt.ops.rsqrt(var + pt.constant(1e-12, name="eps"))
        logits = pt.nn.dense(getattr(pt.ops, activation)(n), 10, name="logits")
        loss = pt.ops.reduce_mean(pt.ops.sparse_softmax_cross_entropy_with_logits(logits, y))
        train_op = pt.train.SGD(0.1).minimize(loss)
    d = pt.data.digits()
    xb = d.x_train[:32].copy()
    xb[:4] = 0.0
    npu, cpu = _sessions(root, g, pt.SessionConfig(precision_mode="force_fp16"), 1)
    for sess in (npu, cpu):
        sess.run([loss, train_op], {x: xb, y: d.y_train[:32]})
        sess.close()


def layer_norm_step(root: str, x, y, precision_mode: str) -> None:
    """One SGD step of a LayerNorm ("norm") and a dense head on the batch (x, y), dumped on
    the simulated NPU under precision_mode and on the golden, into root."""
    g = pt.Graph("layer_norm", seed=0)
    with g.as_default():
        xp = pt.placeholder("x", [None, x.shape[1]])
        yp = pt.placeholder("y", [None], "int32")
        logits = pt.nn.dense(pt.nn.layer_norm(xp, name="norm"), 10, name="head")
        loss = pt.ops.reduce_mean(pt.ops.sparse_softmax_cross_entropy_with_logits(logits, yp))
        train_op = pt.train.SGD(0.1).minimize(loss)
    npu, cpu = _sessions(root, g, pt.SessionConfig(precision_mode=precision_mode), 1)
    for sess in (npu, cpu):
        sess.run([loss, train_op], {xp: x, yp: y})
        sess.close()


def epsilon_absorbed(root):
    """The same layer norm read through a relu: the padding rows' n is 0 whatever rsqrt
    gave, and relu's slope at 0 is 0, so the saturated rsqrt reaches no output, loss or
    gradient: an overflow without effect, no finding."""
    epsilon_below_fp16(root, activation="relu")


def bf16_overflow_free(root):
    """bf16 has fp32's range: the same unnormalised Transformer does not overflow, and its
    rounding passes (a clean run)."""
    _train(root, pt.models.transformer(),
           pt.SessionConfig(precision_mode="allow_mix_precision_bf16"), scale=16.0)


def flushed_gradients(root):
    """A loss weighted by 3e-5 under allow_mix_precision, no loss scale: the largest
    gradient entries still match the golden (cosine 0.9999), 6-13% of the smaller ones
    flush to zero in the fp16 backward, and the updates lose them."""
    _train(root, _tiny_loss_mlp(3e-5),
           pt.SessionConfig(precision_mode="allow_mix_precision"))


def lost_bf16_updates(root):
    """An MLP whose weights are bf16 variables (as a model cast with .bfloat16() has),
    trained by SGD at 0.003: a step under half an ulp of the weight (2^-9 at 0.25) rounds
    away, 94% of the elements never move, and the loss drifts above the golden's while
    every value compared still matches."""
    g = pt.Graph("bf16_weights", seed=0)
    with g.as_default():
        x = pt.placeholder("x", [None, 64], "bfloat16")
        y = pt.placeholder("y", [None], "int32")
        h = pt.nn.dense(x, 32, activation=pt.ops.relu, name="fc1")
        logits = pt.ops.cast(pt.nn.dense(h, 10, name="logits"), "float32")
        loss = pt.ops.reduce_mean(pt.ops.sparse_softmax_cross_entropy_with_logits(logits, y))
        train_op = pt.train.SGD(0.003).minimize(loss)
    _train(root, _Bundle(g, x, y, loss, train_op),
           pt.SessionConfig(precision_mode="allow_mix_precision_bf16"), steps=5)


# -- clean runs -------------------------------------------------------------------------------
def _healthy(model_name: str, standardise: bool, steps: int = 30):
    """A shipped model trained `steps` steps under allow_mix_precision, every step dumped,
    on the digits as shipped (0..1) or standardised per feature."""
    def build(root):
        model = getattr(pt.models, model_name)()
        d = pt.data.digits()
        mean, std = d.x_train.mean(0), d.x_train.std(0) + 1e-6
        npu, cpu = _sessions(root, model.graph, pt.SessionConfig(
            precision_mode="allow_mix_precision"), steps)
        for sess in (npu, cpu):
            for _, (xb, yb) in zip(range(steps), d.batches(32, seed=0, epoch=0)):
                sess.run([model.loss, model.train_op],
                         {model.x: (xb - mean) / std if standardise else xb, model.y: yb})
            sess.close()
    return build


def clean_fp32(root):
    _train(root, pt.models.cnn(), pt.SessionConfig(precision_mode="force_fp32",
                                                   fusion_switch="off"), steps=3)


def clean_fp32_fused(root):
    _train(root, pt.models.transformer(), pt.SessionConfig(precision_mode="force_fp32"), steps=2)


def clean_mixed(root):
    """Normalised inputs under the default allow_fp32_to_fp16: fp16 rounding only."""
    _train(root, pt.models.mlp(), pt.SessionConfig(), steps=3)


def golden_against_fp64(root, model=pt.models.mlp, steps=3):
    """An fp32 golden checked against an fp64 golden: rounding noise only, several steps."""
    m = model()
    d = pt.data.digits()
    for dtype in ("float32", "float64"):
        sess = hooks.sess_dump(pt.Session(m.graph, config=pt.SessionConfig(golden_dtype=dtype)),
                               action="dump", dump_step=f"0-{steps - 1}", data_dir=root)
        for _, (xb, yb) in zip(range(steps), d.batches(32, seed=0, epoch=0)):
            sess.run([m.loss, m.train_op], {m.x: xb, m.y: yb})
        sess.close()


def golden_against_fp64_transformer(root):
    """The Transformer's fp32 golden against an fp64 golden over 10 steps: the attention
    key bias (gradient zero in exact arithmetic) drifts apart under Adam and changes
    nothing."""
    golden_against_fp64(root, pt.models.transformer, steps=10)


def npu_fp32_against_fp64(root):
    _train(root, pt.models.cnn(), pt.SessionConfig(precision_mode="force_fp32",
                                                   fusion_switch="off"), steps=2,
           golden_config=pt.SessionConfig(golden_dtype="float64"))



def _scaled_mlp(init_scale: float):
    """64 -> 128 -> 10 (ReLU), SGD 0.05 under a dynamic loss scale starting at init_scale."""
    g = pt.Graph("scaled_mlp", seed=0)
    with g.as_default():
        x = pt.placeholder("x", [None, 64])
        y = pt.placeholder("y", [None], "int32")
        h = pt.ops.relu(pt.nn.dense(x, 128, name="fc1"))
        h = pt.ops.relu(pt.nn.dense(h, 128, name="fc2"))
        logits = pt.nn.dense(h, 10, name="logits")
        loss = pt.ops.reduce_mean(pt.ops.sparse_softmax_cross_entropy_with_logits(logits, y))
        opt = pt.train.LossScaleOptimizer(pt.train.SGD(0.05),
                                          pt.train.DynamicLossScaleManager(init_scale))
        train_op = opt.minimize(loss)
    return _Bundle(g, x, y, loss, train_op)


def dynamic_scale_backward(root):
    """A dynamic loss scale of 2**24 under allow_mix_precision and saturation: the scaled
    backward overflows in the loss gradient's Cast first, and on its own again further
    down (the bias gradients' sums), not only by carrying the first."""
    _train(root, _scaled_mlp(2.0 ** 24), pt.SessionConfig(precision_mode="allow_mix_precision",
                                                         overflow_mode="saturation"), steps=3)


def skipped_steps_undumped(root):
    """The same model for 10 steps with only step 9 dumped: steps 0-4 overflowed and were
    skipped while the scale came down; the step history (every step, dumped or not) says
    so, and the state that came in diverging is explained by it."""
    _train(root, _scaled_mlp(2.0 ** 24), pt.SessionConfig(precision_mode="allow_mix_precision"),
           steps=10, dump_step="9")


def softmax_bf16_fp32_exp(root):
    """The Transformer on pixels x24 under allow_mix_precision_bf16 and saturation: the
    fused bf16 softmax takes an fp32 exp of scores up to 161 (beyond 88.7): the status word
    says overflow (0x20), and bf16's 8 bits on scores that large are what diverges."""
    _train(root, pt.models.transformer(), pt.SessionConfig(
        precision_mode="allow_mix_precision_bf16", overflow_mode="saturation"), scale=24.0)


def absorbed_overflow(root):
    """Digits x400 into a LayerNorm under force_fp16: the fused kernel's variance and the
    unfused graph's Square both overflow; the bisection compares like with like."""
    d = pt.data.digits()
    layer_norm_step(root, d.x_train[:32] * 400.0, d.y_train[:32], "force_fp16")


def different_graphs(root, npu_layers: int = 1, golden_layers: int = 2):
    """A 1-layer Transformer on the NPU against a 2-layer golden: no verdict on the whole."""
    d = pt.data.digits()
    xb, yb = next(iter(d.batches(32, seed=0, epoch=0)))
    for target, layers in (("npu", npu_layers), ("cpu", golden_layers)):
        m = pt.models.transformer(layers=layers)
        if target == "npu":
            sess = pt.Session(m.graph, target="npu", config=hooks.session_dump_config(
                pt.SessionConfig(precision_mode="force_fp32"), action="dump", data_dir=root))
        else:
            sess = hooks.sess_dump(pt.Session(m.graph), action="dump", data_dir=root)
        sess.run([m.loss, m.train_op], {m.x: xb, m.y: yb})
        sess.close()


def unnormalised_pixels(root):
    """The Transformer on pixels 0..1000 (x62.5) under allow_mix_precision: `check` sees
    from the golden step that the fused softmax's input leaves what its fp16 exp holds."""
    _train(root, pt.models.transformer(), pt.SessionConfig(precision_mode="allow_mix_precision"),
           scale=62.5)


def _unstable_mlp_run(root, steps: int, dump_step: str):
    """64 -> 64 -> 10 (ReLU) on standardised digits, SGD at 1.5 (unstable: the golden's own
    loss swings to 100 and back), a fixed loss scale of 1024, allow_mix_precision: the
    NPU's rounding, passed by the criteria at every step, compounds through the state."""
    g = pt.Graph("unstable_mlp", seed=0)
    with g.as_default():
        x = pt.placeholder("x", [None, 64])
        y = pt.placeholder("y", [None], "int32")
        h = pt.ops.relu(pt.nn.dense(x, 64, name="fc1"))
        logits = pt.nn.dense(h, 10, use_bias=False, name="logits")
        loss = pt.ops.reduce_mean(pt.ops.sparse_softmax_cross_entropy_with_logits(logits, y))
        opt = pt.train.LossScaleOptimizer(pt.train.SGD(1.5), pt.train.FixedLossScaleManager(1024.0))
        train_op = opt.minimize(loss)
    d = pt.data.digits()
    xs = ((d.x_train - d.x_train.mean(0)) / (d.x_train.std(0) + 1e-3)).astype("float32")
    npu, cpu = _sessions(root, g, pt.SessionConfig(precision_mode="allow_mix_precision"), steps,
                         dump_step=dump_step)
    import numpy as np
    for sess in (npu, cpu):
        rng = np.random.default_rng(0)
        for _ in range(steps):
            i = rng.integers(0, len(xs), 32)
            sess.run([loss, train_op], {x: xs[i], y: d.y_train[i]})
        sess.close()


def state_drift(root):
    """The unstable MLP, 32 steps all dumped: step 30 is the first to diverge, and replayed
    from the NPU's own state it matches the golden: the state drifted."""
    _unstable_mlp_run(root, 32, "0-31")


def loss_drift_undumped(root):
    """The unstable MLP, 40 steps with 0-5 dumped: those match, and the step histories show
    the losses parting from step 16."""
    _unstable_mlp_run(root, 40, "0-5")

SCENARIOS: Dict[str, Scenario] = {s.name: s for s in [
    Scenario("softmax_overflow", "Transformer, unnormalised, allow_mix_precision, saturation: "
             "fused softmax overflows", softmax_overflow, 1, origin="attention/Softmax",
             first_overflow="attention/Softmax", step=0,
             advice=["SoftmaxFusionPass", "precision-tool fo"]),
    Scenario("input_inf_nan", "MLP, inputs 1e5, force_fp16, inf_nan: the feed's Cast overflows",
             input_beyond_fp16_inf_nan, 1, origin="x/Cast_fp16", first_overflow="x/Cast_fp16",
             step=0, advice=["Normalise or scale what is fed to x"], not_advice=["modify_mixlist"]),
    Scenario("input_saturation", "MLP, inputs 1e5, force_fp16, saturation: clipped at 65504",
             input_beyond_fp16_saturation, 1, origin="x/Cast_fp16", first_overflow="x/Cast_fp16",
             step=0, advice=["fed to x"], not_advice=["modify_mixlist"]),
    Scenario("underflow_fp16", "MLP, loss x 2**-20, force_fp16, no loss scale: gradients flush",
             gradient_underflow, 1, first_overflow="", step=0,
             advice=["Gradients underflow", "loss scale"]),
    Scenario("underflow_mixed", "MLP, loss x 2**-20, allow_mix_precision: gradients flush",
             gradient_underflow_mixed, 1, first_overflow="", step=0,
             advice=["Gradients underflow", "loss scale"]),
    Scenario("small_factor", "fused Mul chain to 2e-8 in fp16 (force_fp16): a product, not "
             "cancellation", small_factor_product, 1, origin="Relu", first_overflow="",
             advice=["Values underflow"],
             step=0),
    Scenario("carried_state", "Transformer, 4 steps, only step 2 dumped: divergence came in "
             "with the weights", carried_state, 1, step=2,
             advice=["came in with the state", "dump them"]),
    Scenario("loss_scale_2_24", "CNN via Model.train at O2: loss scale 2**24 overflows fp16",
             loss_scale_too_large, 1, first_overflow="loss_scale", step=0,
             advice=["That is the loss scale itself"]),
    Scenario("layernorm_fp16", "Transformer, features x300, force_fp16: the fused softmax's "
             "exp (scores to 25168) overflows first and diverges; the fused LayerNorm after it "
             "overflows too", layer_norm_fp16_variance, 1, step=0,
             origin="attention/Softmax", first_overflow="attention/Softmax",
             advice=["force_fp16 takes no mixlist"], not_advice=["(SessionConfig(modify_mixlist=...)"]),
    Scenario("carried_state_dumped", "Transformer, 3 steps all dumped, asked about step 2: "
             "the earlier update that wrote the diverging state", carried_state_all, 1, step=2,
             advice=["came in with the state", "wrote the first diverging value"],
             args=["-s", "2"]),
    Scenario("epsilon_1e-12", "hand-written layer norm, eps 1e-12, force_fp16, padding rows: "
             "the constant flushes to zero", epsilon_below_fp16, 1, origin="norm/eps/Cast_fp16",
             first_overflow="norm/Rsqrt", step=0,
             advice=["carries the divergence that starts upstream at norm/eps/Cast_fp16",
                     "Give the constant norm/eps a value fp16 holds"],
             not_advice=["is harmless", '["FusedEltwise"]']),
    Scenario("epsilon_absorbed", "the same norm read through a relu: the saturated rsqrt "
             "reaches nothing (overflow and divergence without effect)", epsilon_absorbed, 0,
             origin="", first_overflow="norm/Rsqrt", step=0, advice=["without effect"],
             not_advice=["precision-tool fix", "modify_mixlist"]),
    Scenario("bf16_clean", "Transformer, unnormalised, allow_mix_precision_bf16: no overflow",
             bf16_overflow_free, 0, origin="", first_overflow=""),
    Scenario("flushed_gradients", "MLP, loss x 3e-5, allow_mix_precision, no loss scale: "
             "small gradient entries flush while the large ones match", flushed_gradients, 1,
             first_overflow="", step=0, advice=["Gradients underflow", "Scale the loss"],
             not_advice=["precision looks sound", "cancellation"]),
    Scenario("lost_bf16_updates", "MLP with bf16 weights, SGD 0.003: updates under half an "
             "ulp round away", lost_bf16_updates, 1, origin="", first_overflow="", step=0,
             advice=["Updates are lost", "fp32 master weights"],
             not_advice=["precision looks sound", "increase the learning rate"]),
    Scenario("dynamic_scale_backward", "MLP, dynamic loss scale 2**24, allow_mix_precision, "
             "saturation: the scaled backward overflows in several places on its own",
             dynamic_scale_backward, 1, first_overflow="gradients/", step=0,
             advice=["lower the loss scale to", "happen on their own",
                     "(verified: a replay of step 0 with it matches the golden)"],
             not_advice=["carry it", "only carry"]),
    Scenario("skipped_steps_undumped", "MLP, dynamic loss scale 2**24, 10 steps, only step 9 "
             "dumped: the history shows steps 0-4 skipped", skipped_steps_undumped, 1, step=9,
             advice=["5 of the 9 steps before step 9 overflowed and skipped their update (0-4)",
                     "came in with the state", "dump them"],
             also=[(("ac",), 0, ["5 of 10 observed steps overflowed"], [])]),
    Scenario("softmax_bf16_fp32_exp", "Transformer, pixels x24, allow_mix_precision_bf16, "
             "saturation: the fused softmax's fp32 exp overflows (status 0x20)",
             softmax_bf16_fp32_exp, 1, origin="attention/Softmax",
             first_overflow="attention/Softmax", step=0,
             advice=["normalise what feeds it (not verified), or switch SoftmaxFusionPass off"],
             also=[(("train", "-a", "overflow"), 1, ["1 overflowing kernel(s), the first "
                                                          "encoder/layer_0/attention/Softmax"],
                    ["no overflow"])]),
    Scenario("absorbed_overflow", "LayerNorm, digits x400, force_fp16: fused and unfused both "
             "overflow; the bisection compares like with like", absorbed_overflow, 1, step=0,
             also=[(("fo",), 1, ["LayerNormFusionPass"], ["overflow in norm/"])]),
    Scenario("different_graphs", "1-layer Transformer on the NPU against a 2-layer golden: "
             "no verdict on the whole", different_graphs, 2,
             also=[(("vc",), 2, [], [])]),
    Scenario("unnormalised_pixels_check", "Transformer, pixels 0..1000, allow_mix_precision: "
             "check sees the fused softmax's input leave its fp16 exp", unnormalised_pixels, 1,
             origin="attention/Softmax", first_overflow="attention/Softmax", step=0,
             also=[(("check",), 1, ["graph.fp16_range", "without subtracting the max"], [])]),
    Scenario("state_drift", "MLP at learning rate 1.5, loss scale 1024, allow_mix_precision, "
             "32 steps: each step computes right from its own state; the runs drift apart",
             state_drift, 1, origin="", first_overflow="", step=30,
             advice=["drift apart through the state", "fc1/kernel:0", "golden_dtype='float64'"],
             not_advice=["precision-tool fix", "Look at what feeds it", "precision looks sound"]),
    Scenario("loss_drift_undumped", "the same MLP, 40 steps, 0-5 dumped: they match; the "
             "losses part from step 16 in the step history", loss_drift_undumped, 1,
             origin="", first_overflow="",
             advice=["The losses part while every dumped step matches",
                     'npu-dump --dump-step "15-16"'],
             not_advice=["precision looks sound"]),
    Scenario("healthy_mlp_30", "MLP, standardised, allow_mix_precision, 30 steps all dumped",
             _healthy("mlp", True), 0, origin="", first_overflow=""),
    Scenario("healthy_cnn_30", "CNN, standardised, allow_mix_precision, 30 steps all dumped",
             _healthy("cnn", True), 0, origin="", first_overflow=""),
    Scenario("healthy_transformer_30", "Transformer, digits as shipped, allow_mix_precision, "
             "30 steps all dumped: the key bias drifts without effect", _healthy("transformer", False),
             0, origin="", first_overflow="", not_advice=["came in with the state"]),
    Scenario("healthy_transformer_std_30", "Transformer, standardised, allow_mix_precision, 30 "
             "steps: a saturated softmax overflow that changes nothing", _healthy("transformer", True),
             0, origin="", advice=["without effect"], not_advice=["precision-tool fix"]),
    Scenario("golden_fp32_vs_fp64_transformer", "Transformer, fp32 golden against fp64, 10 steps",
             golden_against_fp64_transformer, 0, origin="", first_overflow="",
             not_advice=['"Variable"'], args=["-lt", "cpu/debug_0", "-rt", "cpu/debug_1"]),
    Scenario("clean_fp32", "CNN, force_fp32, fusion off, 3 steps", clean_fp32, 0, origin="",
             first_overflow="", advice=["precision looks sound"]),
    Scenario("clean_fp32_fused", "Transformer, force_fp32, fusion on, 2 steps", clean_fp32_fused,
             0, origin="", first_overflow=""),
    Scenario("clean_mixed", "MLP, normalised, allow_fp32_to_fp16, 3 steps", clean_mixed, 0,
             origin="", first_overflow=""),
    Scenario("golden_fp32_vs_fp64", "fp32 golden against an fp64 golden, 3 steps",
             golden_against_fp64, 0, origin="", first_overflow="",
             args=["-lt", "cpu/debug_0", "-rt", "cpu/debug_1"]),
    Scenario("npu_fp32_vs_fp64", "CNN, force_fp32, fusion off, against an fp64 golden",
             npu_fp32_against_fp64, 0, origin="", first_overflow=""),
]}


def run_ac(root: str, scenario: Scenario):
    """`ac -c --json` on the scenario's workspace: (exit code, the AutoCheck as data, text)."""
    from click.testing import CliRunner
    from precision_tool.cli import cli
    runner = CliRunner()
    data = runner.invoke(cli, ["--data-dir", root, "--json", "--log-level", "4", "ac", "-c",
                               *scenario.args])
    text = runner.invoke(cli, ["--data-dir", root, "--log-level", "4", "ac", "-c", *scenario.args])
    return data.exit_code, json.loads(data.stdout) if data.stdout.strip() else {}, text.stdout


def describe(code: int, result: dict) -> str:
    """One cell of the table: what ac -c says, in a line."""
    parts = []
    if result.get("first_overflow"):
        parts.append(f"first overflow {result['first_overflow']['op_name']}")
    if result.get("origin"):
        parts.append(f"origin {result['origin']['op_name']} ({'; '.join(dict.fromkeys(result['origin'].get('reasons', [])))})")
    if result.get("underflow"):
        parts.append(f"underflow in {result['underflow']['tensors']} tensor(s)")
    if result.get("carried"):
        parts.append(f"carried in with {', '.join(result['carried']['variables'][:1])}...")
    parts.append(f"step {result.get('step')}")
    lead = (result.get("advice") or [""])[0]          # what the advice leads with
    parts.append("next: " + lead[:110] + ("..." if len(lead) > 110 else ""))
    return "; ".join(parts)


if __name__ == "__main__":
    import tempfile
    names = sys.argv[1:] or list(SCENARIOS)
    print("| scenario | what `ac -c` says | exit |\n|---|---|---|")
    for name in names:
        s = SCENARIOS[name]
        root = os.path.join(tempfile.mkdtemp(), "precision_data")
        s.build(root)
        code, result, _ = run_ac(root, s)
        print(f"| {s.name}: {s.summary} | {describe(code, result)} | {code} |", flush=True)
