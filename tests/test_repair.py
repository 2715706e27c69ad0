"""Precision repair (`fix`): on planted causes, the minimal fix is found, proven over steps,
written in Ascend's formats, and the written files applied to a fresh training run bring its
loss curve to the golden's."""
import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

import precision_tool as pt
from precision_tool import hooks
from precision_tool.analysis.replays import repair as rp
from precision_tool.cli import cli
from precision_tool.dump import Workspace


class Net:
    """A graph with its placeholders, loss and train op, and batches to feed it."""

    def __init__(self, graph, inputs, y, loss, train_op, batches):
        self.graph, self.inputs, self.y = graph, inputs, y
        self.loss, self.train_op, self.batches = loss, train_op, batches

    def feed(self, k):
        xs, y = self.batches[k % len(self.batches)]
        return {**dict(zip(self.inputs, xs)), self.y: y}


def _batches(widths, scale, count=4, n=32):
    rng = np.random.default_rng(7)
    return [([(rng.normal(size=(n, w)) * scale).astype(np.float32) for w in widths],
             rng.integers(0, 10, n).astype(np.int32)) for _ in range(count)]


def dense_net(scale=1.0, loss_weight=None, loss_scale=None, optimizer=None):
    """64 -> 32 (ReLU) -> 10 with a cross-entropy loss (times loss_weight), SGD, optionally
    with a fixed loss scale."""
    g = pt.Graph("dense", seed=0)
    with g.as_default():
        x = pt.placeholder("x", [None, 64])
        y = pt.placeholder("y", [None], "int32")
        logits = pt.nn.dense(pt.ops.relu(pt.nn.dense(x, 32, name="fc1")), 10, name="logits")
        loss = pt.ops.reduce_mean(pt.ops.sparse_softmax_cross_entropy_with_logits(logits, y))
        if loss_weight is not None:
            loss = loss * pt.constant(loss_weight, name="loss_weight")
        opt = optimizer or pt.train.SGD(0.05)
        if loss_scale is not None:
            opt = pt.train.LossScaleOptimizer(opt, pt.train.FixedLossScaleManager(loss_scale))
        train_op = opt.minimize(loss)
    return Net(g, [x], y, loss, train_op, _batches([64], scale))


def two_branch_net():
    """Two independent overflows under allow_mix_precision: a MatMul and a Conv2D (fp16
    white-list ops of two types) each read inputs of 1e5, and the loss needs both."""
    g = pt.Graph("two_branch", seed=0)
    with g.as_default():
        a = pt.placeholder("a", [None, 16])
        b = pt.placeholder("b", [None, 16])
        y = pt.placeholder("y", [None], "int32")
        w = pt.variable("w", [16, 10], init="glorot_uniform")
        left = pt.ops.matmul(a, w)
        right = pt.ops.reshape(pt.nn.conv2d(pt.ops.reshape(b, [-1, 1, 4, 4]), 10, 4,
                                            padding="VALID", use_bias=False, name="conv"), [-1, 10])
        logits = (left + right) * pt.constant(1e-5, name="shrink")
        loss = pt.ops.reduce_mean(pt.ops.sparse_softmax_cross_entropy_with_logits(logits, y))
        train_op = pt.train.Adam(0.01).minimize(loss)
    return Net(g, [a, b], y, loss, train_op, _batches([16, 16], 1e5))


def planted_layer_norm_net():
    """An unnormalised (mean 100) fp16 input into a LayerNorm: its fused kernel loses the
    variance (the fusion bisection's planted pass)."""
    g = pt.Graph("planted", seed=0)
    with g.as_default():
        x = pt.placeholder("x", [None, 64], "float16")
        y = pt.placeholder("y", [None], "int32")
        h = pt.nn.layer_norm(pt.ops.mul(x, 1.0), name="norm")
        logits = pt.nn.dense(pt.ops.cast(h, "float32"), 10, name="head")
        loss = pt.ops.reduce_mean(pt.ops.sparse_softmax_cross_entropy_with_logits(logits, y))
        train_op = pt.train.SGD(0.1).minimize(loss)
    rng = np.random.default_rng(3)
    batches = [([(100 + rng.normal(size=(32, 64))).astype(np.float16)],
                rng.integers(0, 10, 32).astype(np.int32)) for _ in range(4)]
    return Net(g, [x], y, loss, train_op, batches)


def dump_step(root, net, config):
    """Step 0 of the net dumped on the NPU (with its replay bundle) and on the golden."""
    npu = pt.Session(net.graph, target="npu", config=hooks.session_dump_config(
        config, action="dump", dump_step="0", data_dir=str(root)))
    cpu = hooks.sess_dump(pt.Session(net.graph), action="dump", dump_step="0", data_dir=str(root))
    for sess in (npu, cpu):
        sess.run([net.loss, net.train_op], net.feed(0))
        sess.close()
    return Workspace(str(root))


def train_losses(net, config, steps=12, target="npu"):
    """A fresh training run over the net's batches: the loss of each step."""
    sess = pt.Session(net.graph, target=target, config=config)
    losses = [float(sess.run([net.loss, net.train_op], net.feed(k))[0]) for k in range(steps)]
    sess.close()
    return np.array(losses)


def fresh_config(result, root, **extra):
    """The config a user writes from the fix: the written files, and the mode it reports."""
    cfg = result.config
    files = {os.path.basename(f): f for f in result.files}
    mode = {"amp_level": cfg["amp_level"]} if cfg.get("amp_level") else \
        {"precision_mode": cfg["precision_mode"]}
    if "modify_mixlist.json" in files:
        extra["modify_mixlist"] = files["modify_mixlist.json"]
    if "fusion_switch.cfg" in files:
        extra["fusion_switch_file"] = files["fusion_switch.cfg"]
    return pt.SessionConfig(**mode, overflow_mode=cfg["overflow_mode"], **extra)


def assert_follows_golden(losses, golden, rtol=0.02, atol=0.0):
    assert np.all(np.isfinite(losses)), losses
    assert np.all(np.abs(losses - golden) <= rtol * np.abs(golden) + atol), (losses, golden)


def run_repair(ws, **kw):
    kw.setdefault("workers", 1)
    return rp.repair(ws, ws.run("npu"), ws.run("cpu"), 0, **kw)


# -- the causes -------------------------------------------------------------------------------
def test_a_fused_pass_is_switched_off(tmp_path):
    net = planted_layer_norm_net()
    config = pt.SessionConfig(precision_mode="allow_mix_precision")
    ws = dump_step(tmp_path, net, config)
    result = run_repair(ws)
    assert result.needed and result.verified and result.minimal
    assert [c.describe() for c in result.fix] == ["fusion pass LayerNormFusionPass off"]
    switch = json.load(open(tmp_path / "config" / "fusion_switch.cfg"))
    assert switch["Switch"]["GraphFusion"]["LayerNormFusionPass"] == "off"
    assert not (tmp_path / "config" / "modify_mixlist.json").exists()
    golden = train_losses(net, None, target="cpu")
    assert_follows_golden(train_losses(net, fresh_config(result, tmp_path)), golden)
    with pytest.raises(AssertionError):          # the unfixed run does not
        assert_follows_golden(train_losses(net, config), golden)


def test_an_fp16_op_overflowing_under_mixed_precision_goes_to_the_black_list(tmp_path):
    net = dense_net(scale=1e5, optimizer=pt.train.Adam(0.01))
    config = pt.SessionConfig(precision_mode="allow_mix_precision")
    ws = dump_step(tmp_path, net, config)
    result = run_repair(ws)
    assert result.before.overflow and result.verified and result.minimal
    assert result.config["precision_mode"] == "allow_mix_precision"      # no mode change
    kinds = {c.kind for c in result.fix}
    assert "fp32" in kinds and kinds <= {"fp32", "fusion"}
    black = json.load(open(tmp_path / "config" / "modify_mixlist.json"))["black-list"]["to-add"]
    assert set(black) == {c.name for c in result.fix if c.kind == "fp32"}
    assert result.moved_to_fp32                      # what it costs is said
    golden = train_losses(net, None, target="cpu")
    assert_follows_golden(train_losses(net, fresh_config(result, tmp_path)), golden)


def tiny_loss_net(loss_scale):
    """A loss weighted by 2**-20 (averaged over a huge batch, say) and a learning rate that
    makes up for it: fp16 gradients flush to zero, and without them nothing trains."""
    return dense_net(loss_weight=2.0 ** -20, loss_scale=loss_scale,
                     optimizer=pt.train.SGD(0.05 * 2.0 ** 20))


def test_gradient_underflow_is_fixed_by_a_loss_scale(tmp_path):
    net = tiny_loss_net(1.0)
    config = pt.SessionConfig(precision_mode="force_fp16")
    ws = dump_step(tmp_path, net, config)
    result = run_repair(ws)
    assert not result.before.overflow and result.verified
    assert [c.kind for c in result.fix] == ["loss_scale"]
    scale = result.fix[0].value
    assert scale >= 2.0 ** 10 and np.log2(scale) == int(np.log2(scale))
    fix = json.load(open(tmp_path / "config" / "fix.json"))
    assert fix["fix"] == [f"loss scale {scale:g}"] and fix["verified"] is True
    # the report says what the run said: its replays, and the files written (itself too)
    assert fix["replays"] == result.replays > 0 and fix["files"] == result.files
    assert result.files[-1].endswith("fix.json")
    # the fresh run: the same model built with the scale the fix names
    fixed = tiny_loss_net(scale)
    golden = train_losses(fixed, None, target="cpu")
    spacing = np.spacing(golden.astype(np.float16)).astype(np.float64)   # an fp16 loss of 2e-6
    assert_follows_golden(train_losses(fixed, config), golden, atol=spacing)
    with pytest.raises(AssertionError):
        assert_follows_golden(train_losses(net, config), golden, atol=spacing)


def test_two_independent_culprits_are_both_in_the_fix(tmp_path):
    net = two_branch_net()
    config = pt.SessionConfig(precision_mode="allow_mix_precision")
    ws = dump_step(tmp_path, net, config)
    result = run_repair(ws)
    assert result.verified and result.minimal
    names = {c.name for c in result.fix}
    # both branches: the MatMul (forward and gradients), the convolution (forward, and the
    # filter gradient, which reads the same input)
    assert "MatMul" in names and "Conv2D" in names and len(names) == len(result.fix)
    # each one alone is not enough: the minimal fix needs both
    replay = rp.StepReplay(rp.load_bundle(ws.bundle_path(ws.run("npu"), 0)), "float32",
                           pt.analysis.Criteria())
    for change in result.fix:
        assert not replay.run([change]).passed
    golden = train_losses(net, None, target="cpu")
    assert_follows_golden(train_losses(net, fresh_config(result, tmp_path)), golden)


def test_a_mode_without_mixlists_gets_the_mode_that_takes_one(tmp_path):
    net = dense_net(scale=1e5, optimizer=pt.train.Adam(0.01))
    config = pt.SessionConfig(precision_mode="force_fp16")
    ws = dump_step(tmp_path, net, config)
    result = run_repair(ws)
    assert result.verified
    assert result.config["precision_mode"] == "allow_mix_precision"
    assert any(c.kind == "fp32" for c in result.fix)
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "fix", "-j", "1", "--dry-run"])
    assert out.exit_code == 0, out.output
    assert "precision mode allow_mix_precision" in out.output
    golden = train_losses(net, None, target="cpu")
    assert_follows_golden(train_losses(net, fresh_config(result, tmp_path)), golden)


def test_a_clean_run_needs_no_fix_and_writes_nothing(tmp_path):
    net = dense_net()
    ws = dump_step(tmp_path, net, pt.SessionConfig(precision_mode="allow_mix_precision"))
    result = run_repair(ws)
    # the dumped step's compare finds nothing (as ac -c): no replay, no search, no proof
    assert not result.needed and result.fix == [] and result.verified and result.replays == 0
    assert result.healthy and result.proof is None
    assert not (tmp_path / "config").exists()
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "fix", "-j", "1"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["fix"] == [] and data["needed"] is False and data["healthy"] is True
    # asked for a loss tolerance, the replays decide: the step is replayed and proven
    proven = run_repair(ws, loss_rtol=0.05)
    assert not proven.healthy and proven.replays == 1 and proven.proof.drift_step is None


def squared_gain_net():
    """64 -> 32, times 400, squared (to ~1.6e5: fp16 overflows in Square), scaled back by
    1e-5, -> 10. Square in fp32 alone fixes the step; so does every MatMul in fp32 (the gray
    ops after it then follow fp32 inputs), at the price of five cube kernels."""
    g = pt.Graph("squared_gain", seed=0)
    with g.as_default():
        x = pt.placeholder("x", [None, 64])
        y = pt.placeholder("y", [None], "int32")
        h = pt.ops.square(pt.nn.dense(x, 32, name="fc1") * pt.constant(400.0, name="gain"))
        logits = pt.nn.dense(h * pt.constant(1e-5, name="back"), 10, name="logits")
        loss = pt.ops.reduce_mean(pt.ops.sparse_softmax_cross_entropy_with_logits(logits, y))
        train_op = pt.train.SGD(0.001).minimize(loss)
    return Net(g, [x], y, loss, train_op, _batches([64], 1.0))


def test_the_fix_is_the_cheapest_single_change_whatever_the_leads_say(tmp_path):
    """The root cause's types are tried first; told MatMul, the search meets 'MatMul in fp32'
    first, which passes and is 1-minimal in itself. The sweep over every single candidate
    finds Square alone, which gives up fewer fp16 kernels: that is the fix."""
    net = squared_gain_net()
    ws = dump_step(tmp_path, net, pt.SessionConfig(precision_mode="allow_mix_precision",
                                                   fusion_switch="off"))
    result = run_repair(ws, leads=["MatMul"], write=False)
    assert [c.describe() for c in result.fix] == ["Square in fp32"] and result.minimal
    assert result.verified and any("costs less than MatMul in fp32" in n for n in result.notes)
    replay = rp.StepReplay(rp.load_bundle(ws.bundle_path(ws.run("npu"), 0)), "float32",
                           pt.analysis.Criteria())
    matmul, square = rp.Change("fp32", "MatMul"), rp.Change("fp32", "Square")
    assert replay.run([matmul]).passed and replay.run([square]).passed
    assert not replay.run([]).passed
    assert rp.fix_cost(replay, [square]) < rp.fix_cost(replay, [matmul])


def test_the_sweep_replays_only_cheaper_singles_and_ranks_them():
    items = [rp.Change("fp32", t) for t in ("A", "B", "C", "D")]
    price = {"A": 9, "B": 3, "C": 1, "D": 2}
    tried = []

    def test(subsets):
        tried.extend(subsets)
        return [s[0].name in ("A", "B", "D") for s in subsets]

    def cost(changes):
        return sum(price[c.name] for c in changes)
    assert rp.cheaper_singles([items[0]], items, cost, test) == [items[3], items[1]]
    assert sorted(s[0].name for s in tried) == ["B", "C", "D"]      # A is the fix itself
    tried.clear()
    assert rp.cheaper_singles([items[2]], items, cost, test) == [] and tried == []
    assert rp.cheaper_singles([], items, cost, test) == []


# -- the search and the proof -----------------------------------------------------------------
def test_the_search_is_logarithmic_and_parallel_replays_agree(tmp_path):
    net = dense_net(scale=1e5)
    ws = dump_step(tmp_path, net, pt.SessionConfig(precision_mode="allow_mix_precision"))
    one = run_repair(ws, write=False)
    two = run_repair(ws, write=False, workers=2)
    assert [c.describe() for c in one.fix] == [c.describe() for c in two.fix]
    n, k = len(one.candidates), len(one.fix)
    # golden probe aside: the step, the prefix bisection, the halving and the 1-minimal check
    assert one.replays <= 2 + int(np.ceil(np.log2(n))) + 2 * k * int(np.ceil(np.log2(n))) + k + 1


def test_minimize_finds_every_culprit_with_few_tests():
    """QuickXplain over 64 candidates with culprits 5 and 40 (a set passes when it holds
    both): both found, in O(k log n) tests."""
    items = [rp.Change("fp32", f"T{i}") for i in range(64)]
    need = {items[5], items[40]}
    calls = []

    def test(subsets):
        calls.extend(subsets)
        return [need <= set(s) for s in subsets]
    found = rp.minimize(items, test)
    assert set(found) == need and rp.one_minimal(found, test)
    assert len(calls) <= 2 * 2 * 6 + 2 + 2


def test_the_budget_is_kept_and_said(tmp_path):
    dump_step(tmp_path, dense_net(scale=1e5), pt.SessionConfig(precision_mode="allow_mix_precision"))
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "fix", "-j", "1", "-b", "3"])
    assert out.exit_code == 1, out.output
    assert "budget of 3 replays ran out" in out.output
    assert not (tmp_path / "config").exists()


def test_the_proof_catches_a_fix_that_drifts(tmp_path):
    """The proof compares the loss of every step: no fix at all on the overflowing net
    drifts at once, and a real fix holds at every step."""
    net = dense_net(scale=1e5)
    ws = dump_step(tmp_path, net, pt.SessionConfig(precision_mode="allow_mix_precision"))
    bundle = rp.load_bundle(ws.bundle_path(ws.run("npu"), 0))
    replay = rp.StepReplay(bundle, "float32", pt.analysis.Criteria())
    drifting = rp.prove(replay, [], steps=5, rtol=0.02)
    assert not drifting.holds and drifting.drift_step == 0
    held = rp.prove(replay, [rp.Change("mode", "force_fp32")], steps=5, rtol=0.02)
    assert held.holds and held.fixed == pytest.approx(held.golden, rel=1e-6)


def test_no_bundle_is_a_one_line_error(tmp_path):
    net = dense_net()
    npu = pt.Session(net.graph, target="npu", config=hooks.session_dump_config(
        pt.SessionConfig(), action="overflow", data_dir=str(tmp_path)))
    cpu = hooks.sess_dump(pt.Session(net.graph), action="dump", data_dir=str(tmp_path))
    for sess in (npu, cpu):
        sess.run([net.loss, net.train_op], net.feed(0))
        sess.close()
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "fix"])
    assert out.exit_code == 2


def test_ac_points_at_fix_where_it_would_help(tmp_path):
    broken = dump_step(tmp_path / "broken", dense_net(scale=1e5, optimizer=pt.train.Adam(0.01)),
                       pt.SessionConfig(precision_mode="allow_mix_precision"))
    clean = dump_step(tmp_path / "clean", dense_net(),
                      pt.SessionConfig(precision_mode="allow_mix_precision"))
    for ws, expected in ((broken, True), (clean, False)):
        out = CliRunner().invoke(cli, ["--data-dir", ws.root, "--json", "ac", "-c"])
        advice = " ".join(json.loads(out.output)["advice"])
        assert ("precision-tool fix -s 0" in advice) is expected, advice


# -- the modelled step time -------------------------------------------------------------------
def test_the_step_time_model_prices_a_matmul_as_its_doc_says():
    from precision_tool.runtime.npu import cost
    g = pt.Graph("mm", seed=0)
    with g.as_default():
        x = pt.placeholder("x", [None, 512])
        w = pt.variable("w", [512, 256], init="glorot_uniform")
        pt.ops.matmul(x, w, name="mm")
    m, k, n = 1024, 512, 256
    for mode, dtype, size in (("force_fp16", "float16", 2), ("force_fp32", "float32", 4)):
        graph = pt.Session(g, target="npu", config=pt.SessionConfig(precision_mode=mode)).compiled.graph
        node = graph.node("mm")
        flops = 2.0 * m * n * k / {"float16": 256e12, "float32": 64e12}[dtype]
        moved = (m * k + k * n + m * n) * size / 1.2e12
        assert cost.kernel_seconds(graph, node, m) == pytest.approx(3e-6 + max(flops, moved))
    # the fp16 step also launches the two Casts the compiler inserted (vector kernels: one
    # operation per element, reading fp32 and writing fp16)
    fp16 = pt.Session(g, target="npu", config=pt.SessionConfig(precision_mode="force_fp16"))
    casts = sum(3e-6 + max(e / 8e12, e * (4 + 2) / 1.2e12) for e in (m * k, k * n))
    mm = 3e-6 + max(2.0 * m * n * k / 256e12, (m * k + k * n + m * n) * 2 / 1.2e12)
    assert cost.step_seconds(fp16.compiled.graph, m) == pytest.approx(casts + mm)


def test_a_fix_that_drifts_later_is_searched_again_over_the_steps(tmp_path):
    """The Transformer on features x300 under force_fp16: the matmuls in fp32 make step 0
    match, yet the loss leaves the golden's within the proof's steps (by 1-2.3% from step 8,
    as the BLAS kernels of the machine round: a proof tolerance of 0.5% makes the drift certain
    on every one); the search runs again with the proof as its test and finds a fix that
    holds at every step."""
    import scenarios
    scenarios.layer_norm_fp16_variance(str(tmp_path))
    ws = Workspace(str(tmp_path))
    said = []
    result = rp.repair(ws, ws.run("npu"), ws.run("cpu"), 0, workers=2, progress=said.append,
                       proof_rtol=0.005)
    drifted = [m for m in said if m.startswith("the fix drifts at step")]
    assert drifted and result.verified and result.minimal, (said, result.notes)
    # the fix found first (the step alone) is not the final one, which holds at every step
    assert all(abs(x - y) <= 0.005 * abs(y) for x, y in zip(result.proof.fixed, result.proof.golden))
    assert (tmp_path / "config" / "fix.json").exists()


def test_the_loss_goal_judges_the_loss_alone(tmp_path):
    """--loss-rtol: the loss within the tolerance and no overflow, whatever the updates do."""
    net = dense_net(scale=1e5, optimizer=pt.train.Adam(0.01))
    dump_step(tmp_path, net, pt.SessionConfig(precision_mode="allow_mix_precision"))
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "fix", "-j", "1",
                                   "--loss-rtol", "1e-3", "--dry-run"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["goal"].startswith("the loss within 0.001")
    assert data["before"]["loss_error"] > 1e-3 and data["after"]["loss_error"] <= 1e-3
    assert data["files"] == [] and not (tmp_path / "config").exists()


def test_a_half_dump_is_said_and_the_fix_still_judged_on_replays(tmp_path):
    ws = dump_step(tmp_path, dense_net(scale=1e5, optimizer=pt.train.Adam(0.01)),
                   pt.SessionConfig(precision_mode="allow_mix_precision"))
    step = ws.step_path(ws.run("npu"), 0)
    for name in sorted(f for f in os.listdir(step) if f.endswith(".npy"))[::6]:
        os.remove(os.path.join(step, name))
    result = run_repair(Workspace(str(tmp_path)), write=False)
    assert result.verified
    assert any("incomplete" in n and "file missing" in n for n in result.notes), result.notes


@pytest.mark.parametrize("mode", ["force_fp32", "allow_fp32_to_fp16", "force_fp16",
                                  "must_keep_origin_dtype", "allow_mix_precision",
                                  "allow_mix_precision_bf16", "O0", "O1", "O2", "O3"])
def test_ac_advises_what_fix_replays_under_every_mode(mode):
    """For an fp16 Softmax that should stay in fp32, the advice's sentence (ac) and the
    change fix replays name the same mode and the same black-list, under every mode and amp
    level: the mode that reads a mixlist is the policy's one answer (mixlist_mode). Under a
    mode that already computes in fp32 there is nothing to replay, and the advice says so."""
    import re
    from precision_tool.analysis.advice import fp32_changes, keep_in_fp32
    from precision_tool.analysis.replays.step_replay import configure
    from precision_tool.runtime import SessionConfig
    from precision_tool.runtime.config import AMP_LEVELS, PRECISION_MODES
    assert set(PRECISION_MODES) | set(AMP_LEVELS) == {
        "force_fp32", "allow_fp32_to_fp16", "force_fp16", "must_keep_origin_dtype",
        "allow_mix_precision", "allow_mix_precision_bf16", "O0", "O1", "O2", "O3"}
    op = {"op_name": "attention/Softmax", "op_type": "SoftmaxV2", "policy_types": ["SoftmaxV2"],
          "compute_dtype": "float16"}
    base = SessionConfig(**({"amp_level": mode} if mode.startswith("O")
                            else {"precision_mode": mode})).to_dict()
    said, changes = keep_in_fp32(op, mode), fp32_changes(op, mode)
    if mode in ("force_fp32", "O0"):
        assert changes == () and "no precision setting raises it" in said
        return
    fixed = SessionConfig.from_dict(configure(base, changes))
    m = re.search(r"train with (?:precision_mode|amp_level) (\S+) with", said)
    advised = m.group(1) if m else mode          # a mode that reads a mixlist keeps itself
    assert advised == fixed.effective_mode, (said, fixed.effective_mode)
    assert '"black-list": {"to-add": ["SoftmaxV2"]}' in said
    assert fixed.modify_mixlist == {"black-list": {"to-add": ["SoftmaxV2"]}}
    fixed.check_policy()                          # a configuration the NPU compiles
