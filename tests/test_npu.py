"""The simulated NPU: cube/vector numerics, precision policies, overflow modes and status,
formats, fusion passes and their kernels, faithfulness to the golden run."""
import json

import ml_dtypes
import numpy as np
import pytest

import precision_tool as pt
from precision_tool import kernels
from precision_tool import numerics
from precision_tool.analysis import compare_tensors
from precision_tool.runtime.npu import policy as P

F16, F32 = np.float16, np.float32


def npu(graph, **kw):
    return pt.Session(graph, target="npu", config=pt.SessionConfig(**kw))


def _matmul_graph(m, k, n):
    g = pt.Graph("mm")
    with g.as_default():
        a = pt.placeholder("a", [m, k])
        b = pt.placeholder("b", [k, n])
        y = pt.ops.matmul(a, b)
    return g, a, b, y


# -- cube and vector numerics -----------------------------------------------------------------
def test_fp16_matmul_is_fp32_gemm_of_rounded_inputs_rounded_to_fp16_bit_for_bit():
    rng = np.random.default_rng(0)
    av, bv = rng.normal(size=(37, 129)).astype(F32), rng.normal(size=(129, 23)).astype(F32)
    g, a, b, y = _matmul_graph(37, 129, 23)
    sess = npu(g, precision_mode="force_fp16")
    got = sess.run(y, {a: av, b: bv})
    want = (av.astype(F16).astype(F32) @ bv.astype(F16).astype(F32)).astype(F16).astype(F32)
    assert got.dtype == F32                  # fetched as the graph declares it
    assert got.tobytes() == want.tobytes()
    # the compiled MatMul reads fp16 (casts were inserted) and writes fp16
    node = sess.compiled.graph.node(y.node.name)
    assert node.attrs["compute_dtype"] == "float16" and node.outputs[0].dtype == "float16"
    assert all(sess.compiled.graph.tensor(i).dtype == "float16" for i in node.inputs)


def test_allow_fp32_to_fp16_writes_the_fp32_accumulator():
    rng = np.random.default_rng(1)
    av, bv = rng.normal(size=(8, 64)).astype(F32), rng.normal(size=(64, 8)).astype(F32)
    g, a, b, y = _matmul_graph(8, 64, 8)
    got = npu(g, precision_mode="allow_fp32_to_fp16").run(y, {a: av, b: bv})
    want = av.astype(F16).astype(F32) @ bv.astype(F16).astype(F32)
    assert got.tobytes() == want.tobytes()


def test_long_k_fp16_matmul_error_is_the_fp16_output_rounding():
    rng = np.random.default_rng(2)
    k = 4096
    av, bv = rng.uniform(0, 1, (16, k)).astype(F32), rng.uniform(0, 1, (k, 16)).astype(F32)
    g, a, b, y = _matmul_graph(16, k, 16)
    got = npu(g, precision_mode="force_fp16").run(y, {a: av, b: bv}).astype(np.float64)
    exact = av.astype(F16).astype(np.float64) @ bv.astype(F16).astype(np.float64)
    rel = np.abs(got - exact) / exact
    half_ulp = 2.0 ** -11                        # fp16 has 11 significant bits
    assert rel.max() <= half_ulp * 1.001         # no worse than one rounding of the output
    assert rel.mean() > half_ulp / 8             # and visibly that: results ~1024 sit on a 0.5 grid
    golden = pt.Session(g).run(y, {a: av.astype(F16).astype(F32), b: bv.astype(F16).astype(F32)})
    assert (np.abs(golden - exact) / exact).max() < 1e-5


def test_vector_ops_round_each_result_to_fp16():
    g = pt.Graph("vec")
    with g.as_default():
        x = pt.placeholder("x", [1000])
        y = pt.ops.add(pt.ops.mul(x, x), x)
    xv = np.random.default_rng(3).uniform(1, 2, 1000).astype(F32)
    got = npu(g, precision_mode="force_fp16", fusion_switch="off").run(y, {x: xv})
    x16 = xv.astype(F16).astype(F32)
    want = ((x16 * x16).astype(F16).astype(F32) + x16).astype(F16).astype(F32)
    np.testing.assert_array_equal(got, want)


# -- overflow --------------------------------------------------------------------------------
def _exp_graph():
    g = pt.Graph("exp")
    with g.as_default():
        x = pt.placeholder("x", [3])
        y = pt.ops.exp(x)
    return g, x, y


def test_exp_12_in_fp16_saturates_or_is_inf_and_sets_0x20():
    g, x, y = _exp_graph()
    xv = np.array([1.0, 12.0, -1.0], F32)
    sat = npu(g, precision_mode="force_fp16", overflow_mode="saturation")
    out = sat.run(y, {x: xv})
    assert out[1] == 65504.0 and np.isfinite(out).all()
    task = next(t for t in sat.tasks() if t.name == "Exp")
    assert task.status == 0x20 and sat.float_status() == 0x20
    ieee = npu(g, precision_mode="force_fp16", overflow_mode="inf_nan")
    out = ieee.run(y, {x: xv})
    assert np.isinf(out[1]) and out[1] > 0
    assert ieee.float_status() == 0x20
    np.testing.assert_allclose(out[[0, 2]], np.exp(xv[[0, 2]]), rtol=1e-3)
    assert abs(npu(g, precision_mode="force_fp32").run(y, {x: xv})[1] / np.exp(12.0) - 1) < 1e-6


def test_fp32_to_fp16_cast_of_1e5_sets_0x100():
    g = pt.Graph("cast")
    with g.as_default():
        x = pt.placeholder("x", [2])
        y = pt.ops.cast(x, "float16")
    sess = npu(g, precision_mode="must_keep_origin_dtype")
    out = sess.run(y, {x: np.array([1e5, 3.0], F32)})
    assert out[0] == 65504 and out[1] == 3
    assert sess.float_status() == 0x100
    assert numerics.decode_status(0x100) == ["fp32 to fp16/bf16 conversion overflow"]


def test_cube_accumulator_overflow_sets_0x400_and_nan_propagation_is_not_blamed():
    g, a, b, y = _matmul_graph(2, 4, 2)
    big = np.full((2, 4), 3e38, F32)
    sess = npu(g, precision_mode="force_fp32", overflow_mode="inf_nan")
    out = sess.run(y, {a: big, b: np.ones((4, 2), F32)})
    assert np.isinf(out).all() and sess.float_status() == 0x400
    g2 = pt.Graph("prop")
    with g2.as_default():
        x = pt.placeholder("x", [2])
        z = pt.ops.relu(pt.ops.exp(x))
    s2 = npu(g2, precision_mode="force_fp16", overflow_mode="inf_nan", fusion_switch="off")
    s2.run(z, {x: np.array([20.0, 1.0], F32)})
    statuses = {t.name: t.status for t in s2.tasks()}
    assert statuses["Exp"] == 0x20 and statuses["Relu"] == 0   # Relu only carried the inf


def test_the_step_status_is_every_task_s_even_after_a_clear():
    """Session.float_status (what a step's history and a dump record) is the OR of every
    task's status word: NPUClearFloatStatus clears what NPUGetFloatStatus reads next, not the
    step's record; the run after starts clear."""
    from precision_tool.ops.registry import make
    g = pt.Graph("cleared")
    with g.as_default():
        x = pt.placeholder("x", [2])
        e = pt.ops.exp(x)
        cleared = make("NPUClearFloatStatus", [e], name="clear").output(0)
        read = make("NPUGetFloatStatus", [cleared], name="read").output(0)
        y = pt.ops.add(pt.ops.cast(e, "float32"), cleared)
    sess = npu(g, precision_mode="force_fp16", overflow_mode="saturation", fusion_switch="off")
    status_read, _ = sess.run([read, y], {x: np.array([20.0, 1.0], F32)})
    ors = 0
    for t in sess.tasks():
        ors |= t.status
    assert float(status_read) == 0.0                  # cleared before it was read
    assert ors == 0x20 and sess.float_status() == 0x20
    sess.run(y, {x: np.array([1.0, 1.0], F32)})
    assert sess.float_status() == 0 and all(t.status == 0 for t in sess.tasks())


def test_tasks_have_ids_streams_and_timestamps_in_execution_order():
    m = pt.models.mlp()
    sess = npu(m.graph)
    d = pt.data.digits()
    sess.run([m.loss, m.train_op], {m.x: d.x_train[:8], m.y: d.y_train[:8]})
    tasks = sess.tasks()
    ids = [t.task_id for t in tasks]
    assert ids == sorted(ids) and len(set(ids)) == len(ids) and ids[0] >= 1
    assert all(t.stream_id == 0 for t in tasks)
    stamps = [t.timestamp for t in tasks]
    assert stamps == sorted(stamps) and stamps[0] > 1_600_000_000_000_000
    assert not {"Placeholder", "Variable", "Const", "NoOp"} & {t.type for t in tasks}
    assert pt.Session(m.graph).tasks() == [] and pt.Session(m.graph).float_status() == 0


# -- precision policies ----------------------------------------------------------------------
MODES = ["force_fp32", "allow_fp32_to_fp16", "force_fp16", "must_keep_origin_dtype",
         "allow_mix_precision", "allow_mix_precision_bf16", "O0", "O1", "O2", "O3"]
STATE = {"Placeholder", "Variable", "Const"}


def pos_is_shape(node, tensor):
    from precision_tool.ops import registry
    return node.inputs.index(tensor) in registry.get(node.type).shape_inputs


def _expected(mode, node, graph, low):
    """The documented rule, restated independently of the policy code."""
    t = node.type
    if t in ("ApplyAdam", "ApplyGradientDescent", "ApplyMomentum", "AssignMovingAverage"):
        return "float32"
    if mode in ("force_fp32", "must_keep_origin_dtype", "O0"):
        return "float32"
    if mode == "allow_fp32_to_fp16":
        return "float16" if t in P.WHITE else "float32"
    if mode in ("force_fp16", "O3"):
        return "float16"
    if mode == "O2":
        return "float32" if t in ("BatchNorm", "BatchNormGrad", "LayerNorm", "RmsNorm") \
            else "float16"
    if mode == "O1":
        return "float16" if t in P.WHITE else "float32"
    if t in P.WHITE:
        return low
    if t in P.BLACK:
        return "float32"
    votes = []
    for i in node.inputs:
        src = graph.node(i.rpartition(":")[0])
        while src.type == "Cast" and src.attrs.get("inserted_by"):   # look through inserted casts
            src = graph.node(src.inputs[0].rpartition(":")[0])
        if src.type in ("Variable", "Const") or pos_is_shape(node, i):
            continue
        if graph.tensor(i).dtype in ("float16", "bfloat16", "float32"):
            votes.append(graph.tensor(f"{src.name}:0").dtype if src.type == "Placeholder"
                         else src.attrs.get("compute_dtype") if src.type != "Cast" else src.attrs["dtype"])
    return low if votes and all(v == low for v in votes) else "float32"


@pytest.mark.parametrize("mode", MODES)
def test_every_model_trains_a_step_in_every_mode_with_fusion_on(mode):
    kw = {"amp_level": mode} if mode.startswith("O") else {"precision_mode": mode}
    d = pt.data.digits()
    for build in (pt.models.mlp, pt.models.cnn, lambda: pt.models.transformer(embedding_norm=True)):
        m = build()
        loss, _ = npu(m.graph, **kw).run([m.loss, m.train_op], {m.x: d.x_train[:8], m.y: d.y_train[:8]})
        assert np.isfinite(loss) and 1.0 < loss < 4.0, (mode, m.graph.name, loss)


def test_quantize_keeps_the_shape_of_scalars_and_matches_numpy_bit_for_bit():
    for value in (np.float32(0.1), np.array(3e-6, F32), np.array(7e4, F32), np.array([[1e-8]], F32)):
        for dtype, np_dtype in (("float16", F16),):
            got = numerics.quantize(value, dtype)
            with np.errstate(over="ignore"):
                want = np.asarray(value).astype(np_dtype).astype(F32)
            assert got.shape == want.shape and got.tobytes() == want.tobytes()


@pytest.mark.parametrize("mode", MODES)
def test_every_transformer_node_gets_the_documented_dtype(mode):
    m = pt.models.transformer()
    kw = {"amp_level": mode} if mode.startswith("O") else {"precision_mode": mode}
    sess = npu(m.graph, fusion_switch="off", **kw)
    g = sess.compiled.graph
    low = "bfloat16" if mode == "allow_mix_precision_bf16" else "float16"
    checked = 0
    for node in g.nodes:
        if "compute_dtype" not in node.attrs or node.attrs.get("inserted_by"):
            continue
        assert node.attrs["compute_dtype"] == _expected(mode, node, g, low), (mode, node.name, node.type)
        checked += 1
        # every float input arrives in the node's compute dtype (casts were inserted)
        from precision_tool.ops import registry
        op = registry.get(node.type)
        for pos, i in enumerate(node.inputs):
            spec = g.tensor(i).spec
            if pos in op.shape_inputs or spec.dtype not in ("float16", "bfloat16", "float32"):
                continue
            assert spec.dtype == node.attrs["compute_dtype"], (node.name, pos, spec.dtype)
    assert checked > 150
    casts = [n for n in g.nodes if n.type == "Cast" and n.attrs.get("inserted_by")]
    assert (len(casts) == 0) == (mode in ("force_fp32", "must_keep_origin_dtype", "O0"))


def test_modify_mixlist_moves_ops_between_lists(tmp_path):
    m = pt.models.transformer()
    path = tmp_path / "mix.json"
    path.write_text(json.dumps({"black-list": {"to-add": ["Softmax", "MatMul"]},
                                "white-list": {"to-remove": ["BatchMatMul"]}}))
    g = npu(m.graph, precision_mode="allow_mix_precision", modify_mixlist=str(path),
            fusion_switch="off").compiled.graph
    types = {(n.type, n.attrs.get("compute_dtype")) for n in g.nodes}
    assert ("Softmax", "float32") in types and ("MatMul", "float32") in types
    assert ("MatMul", "float16") not in types and ("BatchMatMul", "float16") not in types


@pytest.mark.parametrize("kw, message", [
    ({"precision_mode": "fp8"}, "precision_mode must be one of"),
    ({"amp_level": "O5"}, "amp_level must be one of"),
    ({"precision_mode": "force_fp16", "modify_mixlist": {"black-list": {"to-add": ["Exp"]}}},
     "only applies to allow_mix_precision"),
    ({"precision_mode": "allow_mix_precision", "modify_mixlist": {"black-list": {"to-add": ["Nope"]}}},
     "unknown op types"),
    ({"precision_mode": "allow_mix_precision", "modify_mixlist": {"blacklist": []}},
     "modify_mixlist: expected"),
    ({"fusion_switch": {"Switch": {"GraphFusion": {"NoSuchPass": "off"}}}},
     "unknown GraphFusion pass 'NoSuchPass'"),
    ({"fusion_switch": {"Switch": {"GraphFusion": {"ALL": "maybe"}}}}, 'must be "on" or "off"'),
    ({"fusion_switch": {"switch": {}}}, "fusion switch must be"),
])
def test_bad_npu_configuration_is_refused_with_the_reason(kw, message):
    m = pt.models.mlp()
    with pytest.raises(pt.PrecisionToolError, match=message):
        npu(m.graph, **kw)


def test_malformed_files_and_graph_only_options_in_pynative(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    m = pt.models.mlp()
    with pytest.raises(pt.PrecisionToolError, match="not valid JSON"):
        npu(m.graph, fusion_switch_file=str(bad))
    with pytest.raises(pt.PrecisionToolError, match="not valid JSON"):
        npu(m.graph, precision_mode="allow_mix_precision", modify_mixlist=str(bad))
    with pytest.raises(pt.PrecisionToolError, match="only mean something in graph mode"):
        pt.SessionConfig(mode="pynative", fusion_switch_file=str(bad))


def test_device_memory_is_checked_before_running():
    m = pt.models.mlp()
    sess = npu(m.graph, device_memory=64 * 1024)
    d = pt.data.digits()
    with pytest.raises(MemoryError, match=r"out of device memory: the step needs .* GiB .*the device has 0.00 GiB"):
        sess.run([m.loss, m.train_op], {m.x: d.x_train[:64], m.y: d.y_train[:64]})
    assert sess.tasks() == [] and sess.step == 0


# -- formats ---------------------------------------------------------------------------------
def test_5hd_round_trip_is_exact_padding_included():
    x = np.random.default_rng(4).normal(size=(3, 21, 5, 4)).astype(F16)
    y = numerics.nchw_to_5hd(x)
    assert y.shape == (3, 2, 5, 4, 16)
    assert (y[:, 1, :, :, 5:] == 0).all()                   # channels 21..31 are padding
    np.testing.assert_array_equal(numerics.five_hd_to_nchw(y, x.shape), x)
    for c in range(21):
        np.testing.assert_array_equal(y[:, c // 16, :, :, c % 16], x[:, c])


def test_conv_family_computes_in_5hd_in_graph_mode_only():
    m = pt.models.cnn()
    g = npu(m.graph).compiled.graph
    conv = g.node("conv1/Conv2D")
    assert conv.outputs[0].format == "NC1HWC0" and conv.outputs[0].shape == (None, 1, 8, 8, 16)
    assert conv.outputs[0].original_shape == (None, 16, 8, 8)
    assert any(n.type == "TransData" for n in g.nodes)
    py = npu(m.graph, mode="pynative").compiled.graph
    assert not any(n.type == "TransData" or n.attrs.get("pass_name") for n in py.nodes)


# -- faithfulness ----------------------------------------------------------------------------
def _all_tensors(graph):
    return [f"{n.name}:{k}" for n in graph.nodes for k in range(len(n.outputs))
            if n.type not in ("NoOp",)]


@pytest.mark.parametrize("build", [pt.models.transformer, pt.models.cnn])
def test_force_fp32_without_fusion_matches_golden_on_every_tensor(build):
    m = build()
    d = pt.data.digits()
    feed = {m.x: d.x_train[:16], m.y: d.y_train[:16]}
    names = _all_tensors(m.graph)
    golden = pt.Session(m.graph).run(names + [m.train_op], feed)
    device = npu(m.graph, precision_mode="force_fp32", fusion_switch="off", mode="graph")
    got = device.run(names + [m.train_op], feed)
    assert device.float_status() == 0
    for name, want, have in zip(names, golden, got):
        assert have.shape == want.shape and have.dtype == want.dtype, name
        if want.dtype.kind == "f":
            np.testing.assert_allclose(have, want, rtol=1e-6, atol=1e-7, err_msg=name)
        else:
            np.testing.assert_array_equal(have, want, err_msg=name)


def test_mixed_precision_with_fusion_changes_the_loss_curve_measurably():
    d = pt.data.digits()
    m = pt.models.transformer()
    golden, device = pt.Session(m.graph), npu(m.graph, precision_mode="allow_mix_precision")
    curves = [pt.models.fit(s, m, d, epochs=2, batch_size=32, max_steps=50) for s in (golden, device)]
    diff = np.abs(np.array(curves[0]) - np.array(curves[1]))
    assert len(curves[1]) == 50 and np.isfinite(curves[1]).all()
    assert diff[0] > 0 and diff.max() > 1e-4
    assert curves[1][-1] < curves[1][0] * 0.8          # it still learns


# -- fusion passes ---------------------------------------------------------------------------
@pytest.mark.parametrize("build, passes", [
    (pt.models.transformer, ["LayerNormFusionPass", "SoftmaxFusionPass", "MatMulBiasAddFusionPass",
                             "GeluFusionPass", "BatchMatMulFusionPass", "TbeEltwiseFusionPass",
                             "TbeMultiOutputFusionPass"]),
    (pt.models.cnn, ["ConvBatchNormFusionPass", "MatMulBiasAddFusionPass"]),
])
def test_each_pass_fires_on_the_model_it_targets(build, passes):
    m = build()
    sess = npu(m.graph, precision_mode="allow_mix_precision")
    result = sess.fusion_result()[m.name]
    counts = {**result["graph_fusion"], **result["ub_fusion"]}
    for p in passes:
        assert counts[p]["effect_times"] >= 1, p
        for fused in counts[p]["fused_nodes"]:
            node = sess.compiled.graph.node(fused)
            assert node.attrs["pass_name"] == p and len(node.attrs["original_op_names"]) >= 1
            assert len(node.attrs["output_sources"]) == len(node.outputs)


def test_switch_file_turns_passes_off_and_on(tmp_path):
    m = pt.models.transformer()
    cfg = tmp_path / "fusion_switch.cfg"
    cfg.write_text(json.dumps({"Switch": {"GraphFusion": {"ALL": "off", "GeluFusionPass": "on"},
                                          "UBFusion": {"ALL": "off"}}}))
    sess = npu(m.graph, fusion_switch_file=str(cfg))
    ran = {**sess.fusion_result()[m.name]["graph_fusion"], **sess.fusion_result()[m.name]["ub_fusion"]}
    assert list(ran) == ["GeluFusionPass"]
    types = {n.type for n in sess.compiled.graph.nodes}
    assert "FastGelu" in types and "LayerNorm" not in types and "MatMulV2" not in types


def test_fused_layer_norm_loses_precision_when_mean_dwarfs_std():
    g = pt.Graph("ln")
    with g.as_default():
        x = pt.placeholder("x", [None, 64], "float16")
        y = pt.nn.layer_norm(pt.ops.mul(x, 1.0))       # a gray op on fp16 data stays fp16
    xv = (100.0 + np.random.default_rng(5).normal(size=(32, 64))).astype(F16)
    golden = pt.Session(g).run(y, {x: xv})
    fused = npu(g, precision_mode="allow_mix_precision")
    unfused = npu(g, precision_mode="allow_mix_precision", fusion_switch="off")
    ln = [n for n in fused.compiled.graph.nodes if n.type == "LayerNorm"]
    assert len(ln) == 1 and ln[0].attrs["compute_dtype"] == "float16"
    err_fused = np.abs(fused.run(y, {x: xv}) - golden).max()
    err_unfused = np.abs(unfused.run(y, {x: xv}) - golden).max()
    assert err_unfused < 0.01             # fp16 rounding of the outputs only
    assert err_fused > 0.5                # E[x^2] - E[x]^2 in fp16: the variance is lost
    fused.run(y, {x: (xv + 900).astype(F16)})   # x^2 ~ 1e6 overflows fp16 inside the kernel
    assert fused.float_status() & 0x20


def _rms_graph(dtype="float32"):
    g = pt.Graph("rms")
    with g.as_default():
        x = pt.placeholder("x", [None, 64], dtype)
        y = pt.nn.rms_norm(pt.ops.mul(x, 1.0))
    return g, x, y


def test_fused_rms_norm_keeps_its_squares_in_fp32():
    """RmsNormFusionPass fuses Square, ReduceMean, Add eps, Rsqrt and the two Muls into one
    RmsNorm whose squares and mean stay float32: under force_fp16, |x| ~ 300 squares past
    65504 in the unfused Square (status set, the output far off) and in the fused kernel
    overflows nothing, its output within fp16 rounding of float64's."""
    g, x, y = _rms_graph()
    xv = (300 * np.random.default_rng(5).normal(size=(8, 64))).astype(F16).astype(F32)
    xd = xv.astype(np.float64)
    ref = xd / np.sqrt((xd * xd).mean(-1, keepdims=True) + 1e-6)
    fused = npu(g, precision_mode="force_fp16")
    node = next(n for n in fused.compiled.graph.nodes if n.type == "RmsNorm")
    assert node.attrs["pass_name"] == "RmsNormFusionPass"
    assert len(node.attrs["original_op_names"]) == 6
    out = fused.run(y, {x: xv})
    assert fused.float_status() == 0
    assert np.all(np.abs(out - ref) <= 0.51 * np.spacing(np.abs(ref).astype(F16)))
    unfused = npu(g, precision_mode="force_fp16", fusion_switch="off")
    assert not any(n.type == "RmsNorm" for n in unfused.compiled.graph.nodes)
    assert np.abs(unfused.run(y, {x: xv}) - ref).max() > 0.5 and unfused.float_status() != 0


def test_rms_norm_pass_fuses_a_training_graph_and_no_layer_norm_tail():
    """In a training graph the backward reads what the pattern made (the root, the
    normalised x): the fused node exposes them and the losses follow the golden's. The tail
    of a LayerNorm (x - mean squared, averaged, ...) is not an RMS norm: with the LayerNorm
    pass off it stays unfused."""
    from precision_tool import ops
    g = pt.Graph("rms_train")
    with g.as_default():
        x = pt.placeholder("x", [None, 16]); y = pt.placeholder("y", [None], "int32")
        logits = pt.nn.dense(pt.nn.rms_norm(pt.nn.dense(x, 32, name="in")), 4, name="out")
        loss = ops.reduce_mean(ops.sparse_softmax_cross_entropy_with_logits(logits, y))
        train = pt.train.SGD(0.1).minimize(loss)
    rng = np.random.default_rng(0)
    feed = {x: rng.normal(size=(8, 16)).astype(F32), y: rng.integers(0, 4, 8).astype(np.int32)}
    device = npu(g, precision_mode="allow_mix_precision")
    fused = [n for n in device.compiled.graph.nodes if n.type == "RmsNorm"]
    assert len(fused) == 1 and len(fused[0].attrs["roles"]) > 1
    golden = pt.Session(g)
    for _ in range(3):
        a, b = device.run([loss, train], feed)[0], golden.run([loss, train], feed)[0]
        assert abs(a - b) < 2e-3 * abs(b)
    m = pt.models.transformer()
    off = {"Switch": {"GraphFusion": {"LayerNormFusionPass": "off"}, "UBFusion": {}}}
    types = {n.type for n in npu(m.graph, fusion_switch=off).compiled.graph.nodes}
    assert "RmsNorm" not in types and "LayerNorm" not in types


def _softmax_graph():
    g = pt.Graph("sm")
    with g.as_default():
        x = pt.placeholder("x", [2, 4], "float16")
        y = pt.ops.softmax(pt.ops.mul(x, 1.0))
    return g, x, y


@pytest.mark.parametrize("overflow_mode", ["saturation", "inf_nan"])
def test_fused_softmax_overflows_above_ln_65504_in_fp16(overflow_mode):
    g, x, y = _softmax_graph()
    sess = npu(g, precision_mode="allow_mix_precision", overflow_mode=overflow_mode)
    assert any(n.type == "SoftmaxV2" for n in sess.compiled.graph.nodes)
    ok = sess.run(y, {x: np.array([[11.0, 0, 0, 0], [1, 2, 3, 4]], F32)})
    assert sess.float_status() == 0 and np.isfinite(ok).all()
    bad = sess.run(y, {x: np.array([[12.0, 0, 0, 0], [1, 2, 3, 4]], F32)})
    softmax_task = next(t for t in sess.tasks() if t.type == "SoftmaxV2")
    assert softmax_task.status == 0x20
    if overflow_mode == "inf_nan":
        assert np.isnan(bad[0]).any()
    else:
        assert np.isfinite(bad).all()
    unfused = npu(g, precision_mode="allow_mix_precision", fusion_switch="off",
                  overflow_mode=overflow_mode)
    out = unfused.run(y, {x: np.array([[12.0, 0, 0, 0], [1, 2, 3, 4]], F32)})
    assert unfused.float_status() == 0
    np.testing.assert_allclose(out, pt.Session(g).run(y, {x: np.array([[12.0, 0, 0, 0], [1, 2, 3, 4]], F32)}),
                               atol=1e-3)


def test_fused_matmul_bias_add_rounds_once():
    rng = np.random.default_rng(6)
    g = pt.Graph("mb")
    with g.as_default():
        x = pt.placeholder("x", [16, 32])
        w = pt.placeholder("w", [32, 8])
        b = pt.placeholder("b", [8])
        y = pt.ops.bias_add(pt.ops.matmul(x, w), b)
    xv, wv = rng.normal(size=(16, 32)).astype(F32), rng.normal(size=(32, 8)).astype(F32)
    bv = rng.normal(size=8).astype(F32) * 100
    feed = {x: xv, w: wv, b: bv}
    r = lambda v: v.astype(F16).astype(F32)   # noqa: E731
    acc = r(xv) @ r(wv)
    fused = npu(g, precision_mode="force_fp16").run(y, feed)
    unfused = npu(g, precision_mode="force_fp16", fusion_switch="off").run(y, feed)
    np.testing.assert_array_equal(fused, r(acc + r(bv)))
    np.testing.assert_array_equal(unfused, r(r(acc) + r(bv)))
    assert not np.array_equal(fused, unfused)


def test_fused_gelu_is_the_tanh_approximation():
    g = pt.Graph("gelu")
    with g.as_default():
        x = pt.placeholder("x", [2001])
        y = pt.ops.gelu(x)
    xv = np.linspace(-6, 6, 2001).astype(F32)
    golden = pt.Session(g).run(y, {x: xv})
    fused = npu(g, precision_mode="force_fp32").run(y, {x: xv})
    diff = np.abs(fused - golden).max()
    assert 1e-5 < diff < 1e-3


def test_ub_eltwise_fusion_keeps_intermediates_in_fp32():
    g = pt.Graph("ub")
    with g.as_default():
        a = pt.placeholder("a", [4096])
        b = pt.placeholder("b", [4096])
        y = pt.ops.add(pt.ops.mul(a, b), a)
    rng = np.random.default_rng(7)
    av, bv = rng.uniform(1, 2, 4096).astype(F32), rng.uniform(1, 2, 4096).astype(F32)
    sess = npu(g, precision_mode="force_fp16")
    assert [n.type for n in sess.compiled.graph.nodes if n.attrs.get("pass_name")] == ["FusedEltwise"]
    r = lambda v: v.astype(F16).astype(F32)   # noqa: E731
    fused = sess.run(y, {a: av, b: bv})
    np.testing.assert_array_equal(fused, r(r(av) * r(bv) + r(av)))
    unfused = npu(g, precision_mode="force_fp16", fusion_switch="off").run(y, {a: av, b: bv})
    np.testing.assert_array_equal(unfused, r(r(r(av) * r(bv)) + r(av)))


def test_conv_batch_norm_fusion_folds_weights_in_the_inference_branch():
    m = pt.models.cnn()
    d = pt.data.digits()
    golden = pt.Session(m.graph)
    pt.models.fit(golden, m, d, epochs=1, batch_size=64, max_steps=10)
    state = golden.variables()
    sess = npu(m.graph, precision_mode="force_fp32")
    sess.load_variables(state)
    fused = [n for n in sess.compiled.graph.nodes if n.type == "Conv2DBatchNorm"]
    assert len(fused) == 2 and all(not n.name.startswith("gradients") for n in fused)
    want = golden.run(m.eval_logits, {m.x: d.x_test[:64]})
    got = sess.run(m.eval_logits, {m.x: d.x_test[:64]})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_fetching_a_fused_away_tensor_names_the_pass():
    m = pt.models.transformer()
    sess = npu(m.graph)
    with pytest.raises(pt.FetchError, match="fused into .* by LayerNormFusionPass"):
        sess.run("encoder/layer_0/attention_norm/Add:0")


# -- loss scaling ----------------------------------------------------------------------------
def _grad_names(graph):
    """Every float tensor of the gradient computation."""
    return [f"{n.name}:0" for n in graph.nodes if n.name.startswith("gradients/")
            and n.outputs and n.outputs[0].dtype == "float32"]


def _trained_mlp_grads(scale=None):
    """The share of a trained MLP's gradient elements (small: the predictions are confident)
    that force_fp16 flushes to zero where the golden run has them non-zero, optionally with a
    fixed loss scale."""
    d = pt.data.digits()
    trained = pt.models.mlp()
    sess = pt.Session(trained.graph)
    pt.models.fit(sess, trained, d, epochs=5, batch_size=32)
    state = {k: v for k, v in sess.variables().items() if "Adam" not in k}
    opt = pt.train.SGD(0.1)
    if scale is not None:
        opt = pt.train.LossScaleOptimizer(opt, pt.train.FixedLossScaleManager(scale))
    m = pt.models.mlp(optimizer=opt)
    names = _grad_names(m.graph)
    feed = {m.x: d.x_train[:64], m.y: d.y_train[:64]}
    out = []
    for s in (pt.Session(m.graph), npu(m.graph, precision_mode="force_fp16")):
        s.load_variables(state)
        out.append(np.concatenate([g.ravel() for g in s.run(names, feed)]))
    golden, device = out
    return compare_tensors(device, golden)["FlushedToZeroRatio"]   # flushed where golden is not


def test_force_fp16_without_loss_scaling_flushes_small_gradients_to_zero():
    lost_plain = _trained_mlp_grads()
    lost_scaled = _trained_mlp_grads(scale=2.0 ** 12)
    assert lost_plain > 0.01               # measured: about 2.3% of the live gradient elements
    assert lost_scaled < lost_plain / 3


def test_dynamic_loss_scale_halves_and_skips_exactly_the_overflowed_update():
    opt = pt.train.LossScaleOptimizer(pt.train.SGD(0.1),
                                      pt.train.DynamicLossScaleManager(2.0 ** 10, 2, 1000))
    m = pt.models.mlp(optimizer=opt)
    d = pt.data.digits()
    sess = npu(m.graph, precision_mode="allow_mix_precision")
    xb, yb = d.x_train[:32], d.y_train[:32]
    history = []
    for step, x in enumerate([xb, xb, xb * 3e4, xb]):
        before = sess.variables()
        sess.run(m.train_op, {m.x: x, m.y: yb})
        status = sess.float_status()
        after = sess.variables()
        scale, finite = sess.run([opt.loss_scale, opt.last_step_finite])
        changed = not np.array_equal(before["fc1/kernel"], after["fc1/kernel"])
        history.append((float(scale), float(finite), changed, status))
    assert history[0][:3] == (1024.0, 1.0, True) and history[1][:3] == (1024.0, 1.0, True)
    assert history[2][:3] == (512.0, 0.0, False) and history[2][3] != 0
    assert history[3][:3] == (512.0, 1.0, True)


def test_loss_scale_managers_grow_after_a_clean_window():
    opt = pt.train.LossScaleOptimizer(
        pt.train.SGD(0.01), pt.train.ExponentialUpdateLossScaleManager(8.0, incr_every_n_steps=2,
                                                                       decr_every_n_nan_or_inf=2,
                                                                       decr_ratio=0.5))
    m = pt.models.mlp(optimizer=opt)
    d = pt.data.digits()
    sess = pt.Session(m.graph)            # also on the golden executor: inf in the grads counts
    scales = []
    for x in [d.x_train[:16]] * 4 + [d.x_train[:16] * np.float32(3e38)] * 2:
        sess.run(m.train_op, {m.x: x, m.y: d.y_train[:16]})
        scales.append(float(sess.run(opt.loss_scale)))
    assert scales == [8.0, 16.0, 16.0, 32.0, 32.0, 16.0]


@pytest.mark.parametrize("size", [7, 2048, 2049, 70_000])
def test_quantize_matches_the_reference_conversions_on_both_paths(size):
    """The bit arithmetic gives the reference conversions (numpy for fp16, ml_dtypes for
    bf16) bit for bit, on random bit patterns and the edge cases (ties, subnormals, the
    overflow threshold, inf and nan)."""
    import ml_dtypes
    rng = np.random.default_rng(size)
    bits = rng.integers(0, 2 ** 32, size=size, dtype=np.uint64).astype(np.uint32)
    x = bits.view(F32).copy()
    edge = np.array([0.0, -0.0, 65504.0, 65519.99, 65520.0, -65520.0, 2.0 ** -24, 2.0 ** -25,
                     3 * 2.0 ** -26, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, np.inf, -np.inf,
                     np.nan, 1e-45, 3.4e38], F32)
    x[:min(size, len(edge))] = edge[:size]
    for dtype, ref in (("float16", F16), ("bfloat16", ml_dtypes.bfloat16)):
        with np.errstate(over="ignore", invalid="ignore"):
            want = x.astype(ref).astype(F32)
        got = numerics.quantize(x, dtype)
        same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), (dtype, x[~same][:5], got[~same][:5], want[~same][:5])


def test_tensor_stats_stream_in_blocks_and_match_a_float64_reference(monkeypatch):
    rng = np.random.default_rng(5)
    x = rng.normal(size=10_000).astype(F32) * 100
    x[[3, 500, 9999]] = [np.nan, np.inf, -np.inf]
    monkeypatch.setattr(kernels.stats, "STATS_BLOCK", 333)          # many uneven blocks
    got = kernels.tensor_stats(x)
    f = x[np.isfinite(x)].astype(np.float64)
    assert (got["nan_count"], got["pos_inf_count"], got["neg_inf_count"]) == (1, 1, 1)
    assert got["max"] == f.max() and got["min"] == f.min()
    assert got["mean"] == pytest.approx(f.mean(), rel=1e-12, abs=0)
    assert got["l2norm"] == pytest.approx(np.sqrt((f * f).sum()), rel=1e-12, abs=0)
    empty = kernels.tensor_stats(np.array([np.nan, np.inf], F32))
    assert np.isnan(empty["mean"]) and empty["nan_count"] == 1 and empty["pos_inf_count"] == 1


@pytest.mark.parametrize("mode, data, want", [
    # the modes lower float32 ops: data declared in the other low dtype keeps it
    ("allow_mix_precision", "bfloat16", {"MatMul": "bfloat16", "Mul": "bfloat16", "Exp": "float32"}),
    ("allow_mix_precision_bf16", "float16", {"MatMul": "float16", "Mul": "float16", "Exp": "float32"}),
    ("allow_fp32_to_fp16", "bfloat16", {"MatMul": "bfloat16", "Mul": "bfloat16", "Exp": "bfloat16"}),
    # and lower what is float32 as before
    ("allow_mix_precision", "float32", {"MatMul": "float16", "Mul": "float16", "Exp": "float32"}),
    ("allow_fp32_to_fp16", "float32", {"MatMul": "float16", "Mul": "float32", "Exp": "float32"}),
])
def test_a_mixed_mode_never_moves_one_low_dtype_to_the_other(mode, data, want):
    """allow_mix_precision lowers float32 ops to fp16 (its _bf16 variant to bf16), and
    allow_fp32_to_fp16 float32 Cube ops: an op a graph (a script's .bfloat16()) declares in
    the other low dtype keeps it, white list and gray list alike; the black list stays fp32.
    The product is then on that dtype's grid: float64 numpy's, rounded once."""
    g = pt.Graph("low")
    with g.as_default():
        a = pt.placeholder("a", [4, 8], data)
        b = pt.placeholder("b", [8, 4], data)
        y = pt.ops.matmul(a, b)
        z = pt.ops.exp(pt.ops.mul(y, 0.5))
    sess = npu(g, precision_mode=mode, fusion_switch="off")
    got = {n.type: n.attrs["compute_dtype"] for n in sess.compiled.graph.nodes
           if n.type in want and not n.attrs.get("inserted_by")}
    assert got == want
    rng = np.random.default_rng(3)
    grid = np.dtype(data if data != "bfloat16" else ml_dtypes.bfloat16)
    av = rng.normal(size=(4, 8)).astype(grid)
    bv = rng.normal(size=(8, 4)).astype(grid)
    compute = np.dtype(want["MatMul"] if want["MatMul"] != "bfloat16" else ml_dtypes.bfloat16)
    # the inputs on the compute dtype's grid, the product in float64, rounded once to the
    # output's dtype (allow_fp32_to_fp16 writes a float32 op's product in float32)
    out = np.dtype(np.float32) if mode == "allow_fp32_to_fp16" and data == "float32" else compute
    ref = av.astype(compute).astype(np.float64) @ bv.astype(compute).astype(np.float64)
    yv, zv = sess.run([y, z], {a: av, b: bv})
    # (a float32 product may differ from float64's in its last bit: fp32 accumulation)
    np.testing.assert_allclose(np.asarray(yv, np.float32), ref.astype(out).astype(np.float32),
                               rtol=2 ** -22 if out == np.float32 else 0, atol=0)
    assert np.all(np.isfinite(np.asarray(zv, np.float32)))
