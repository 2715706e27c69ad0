"""Vector compare (groundwork of the analysis): mapping NPU tensors to golden ones and
comparing every dumped tensor of a step."""
import os

import numpy as np
import pytest
import pandas as pd

import precision_tool as pt
from precision_tool import hooks
from precision_tool.analysis import TensorMap, vector_compare, write_result
from precision_tool.dump import Workspace


def _dump_both(root, model, **npu_kw):
    d = pt.data.digits()
    npu = pt.Session(model.graph, target="npu",
                     config=hooks.session_dump_config(pt.SessionConfig(**npu_kw), action="dump",
                                                      data_dir=root))
    cpu = hooks.sess_dump(pt.Session(model.graph), action="dump", data_dir=root)
    feed = {model.x: d.x_train[:16], model.y: d.y_train[:16]}
    npu.run([model.loss, model.train_op], feed)
    cpu.run([model.loss, model.train_op], feed)
    ws = Workspace(root)
    return ws, ws.run("npu"), ws.run("cpu"), npu


def test_an_exact_npu_run_passes_everywhere(tmp_path):
    m = pt.models.cnn()
    ws, npu_run, cpu_run, _ = _dump_both(str(tmp_path), m, precision_mode="force_fp32",
                                         fusion_switch="off")
    table = vector_compare(ws, npu_run, cpu_run, 0)
    assert len(table) > 100
    compared = table[table.Verdict != "npu-only"]
    assert (compared.Verdict == "pass").all()
    finite = compared.CosineSimilarity.dropna()
    assert (finite > 1 - 1e-6).all()
    # the 5HD tensors were converted back before comparing
    five_hd = compared[compared.TensorIndex.str.startswith("conv1/Conv2D:output")]
    assert len(five_hd) == 1 and five_hd.MaxAbsoluteError.iloc[0] < 1e-5


def test_fused_and_inserted_ops_map_to_the_golden_tensors_they_stand_for(tmp_path):
    m = pt.models.transformer()
    ws, npu_run, cpu_run, sess = _dump_both(str(tmp_path), m, precision_mode="allow_mix_precision")
    table = vector_compare(ws, npu_run, cpu_run, 0)
    assert not (table.Verdict == "error").any(), table[table.Verdict == "error"].head()
    ln = table[(table.OpType == "LayerNorm") & (table.TensorIndex.str.contains(":output:0"))]
    assert set(ln.GoldenTensor) == {"encoder/layer_0/attention_norm/Add_1:0",
                                    "encoder/layer_0/output_norm/Add_1:0"}
    casts = table[(table.OpType == "Cast") & table.TensorIndex.str.contains(":output:")]
    assert len(casts) > 10 and (casts.GoldenTensor != "").all()
    tmap = TensorMap(ws.compiled_graph(npu_run))
    assert tmap.golden_tensor("encoder/layer_0/attention/query/kernel/Cast_fp16:0") == \
        "encoder/layer_0/attention/query/kernel:0"


def test_results_are_written_to_separate_directories(tmp_path):
    m = pt.models.mlp()
    ws, npu_run, cpu_run, _ = _dump_both(str(tmp_path), m)
    table = vector_compare(ws, npu_run, cpu_run, 0)
    first, second = write_result(ws, table), write_result(ws, table)
    assert first != second and os.path.dirname(first) != os.path.dirname(second)
    assert os.path.basename(os.path.dirname(first)).startswith(
        os.path.basename(first)[len("result_"):-len(".csv")])
    back = pd.read_csv(first)
    assert list(back.columns[:9]) == ["Index", "OpType", "NPUDump", "NpuDataType", "GroundTruth",
                                      "GoldenDataType", "TensorIndex", "Shape", "OverFlow"]
    assert len(back) == len(table)


def _table(rows):
    base = {"OpType": "Add", "GroundTruth": "", "PassName": "", "Verdict": "pass"}
    return pd.DataFrame([dict(base, Index=k, **r) for k, r in enumerate(rows)])


def test_summary_lists_ops_under_the_threshold_in_order_with_their_cosines():
    from precision_tool.analysis import summarize
    table = _table([
        {"NPUDump": "a", "TensorIndex": "a:input:0", "CosineSimilarity": 1.0},
        {"NPUDump": "a", "TensorIndex": "a:output:0", "CosineSimilarity": 0.999, "GroundTruth": "a"},
        {"NPUDump": "b", "TensorIndex": "b:input:0", "CosineSimilarity": 0.999},
        {"NPUDump": "b", "TensorIndex": "b:output:0", "CosineSimilarity": 0.5, "GroundTruth": "b"},
        {"NPUDump": "c", "TensorIndex": "c:input:0", "CosineSimilarity": 0.5},
        {"NPUDump": "c", "TensorIndex": "c:output:0", "CosineSimilarity": 0.3, "GroundTruth": "c"},
        {"NPUDump": "d", "TensorIndex": "d:output:0", "CosineSimilarity": float("nan"), "Verdict": "nan"},
    ])
    ops = summarize(table, threshold=0.98, limit=3)
    assert [o.op_name for o in ops] == ["b", "c", "d"]
    assert ops[0].input_cosines == [0.999] and ops[0].output_cosines == [0.5]
    assert ops[2].category == "nonfinite" and ops[0].golden_ops == ["b"]
    assert [o.op_name for o in summarize(table, 0.98, limit=2, by_cosine=True)] == ["d", "c"]
    assert [o.op_name for o in summarize(table, threshold=0.0, limit=0)] == ["d"]   # nan always shows
    assert [o.op_name for o in summarize(table, 0.98, limit=0)] == ["b", "c", "d"]


def test_root_cause_names_the_origin_not_the_propagators():
    from precision_tool.analysis import root_cause
    table = _table([
        {"NPUDump": "a", "TensorIndex": "a:output:0", "CosineSimilarity": 0.9999},
        {"NPUDump": "b", "TensorIndex": "b:input:0", "CosineSimilarity": 0.9999,
         "PassName": "LayerNormFusionPass"},
        {"NPUDump": "b", "TensorIndex": "b:output:0", "CosineSimilarity": 0.4, "Verdict": "fail",
         "PassName": "LayerNormFusionPass"},
        {"NPUDump": "c", "TensorIndex": "c:input:0", "CosineSimilarity": 0.4},
        {"NPUDump": "c", "TensorIndex": "c:output:0", "CosineSimilarity": 0.3, "Verdict": "fail"},
        {"NPUDump": "e", "TensorIndex": "e:input:0", "CosineSimilarity": 1.0},
        {"NPUDump": "e", "TensorIndex": "e:output:0", "CosineSimilarity": float("nan"), "Verdict": "nan"},
    ])
    rc = root_cause(table, 0.98)
    assert [o.op_name for o in rc.origins] == ["b", "e"]
    assert [p.op_name for p in rc.propagators] == ["c"]
    assert rc.first_origin.pass_name == "LayerNormFusionPass"
    assert rc.propagators[0].bad_inputs == ["c:input:0"]


def test_root_cause_finds_the_planted_fused_layer_norm(tmp_path):
    """Unnormalised input under mixed precision with fusion: the fused LayerNorm is where the
    divergence starts."""
    from precision_tool.analysis import root_cause
    g = pt.Graph("planted")
    with g.as_default():
        x = pt.placeholder("x", [None, 64], "float16")
        y = pt.nn.layer_norm(pt.ops.mul(x, 1.0), name="norm")    # mean 100, std 1: fp16 E[x^2]
        out = pt.nn.dense(y, 10, name="head")
    xv = (100 + np.random.default_rng(1).normal(size=(16, 64))).astype(np.float16)
    npu = pt.Session(g, target="npu", config=hooks.session_dump_config(
        pt.SessionConfig(precision_mode="allow_mix_precision"), action="dump", data_dir=str(tmp_path)))
    cpu = hooks.sess_dump(pt.Session(g), action="dump", data_dir=str(tmp_path))
    npu.run(out, {x: xv})
    cpu.run(out, {x: xv})
    ws = Workspace(str(tmp_path))
    table = vector_compare(ws, ws.run("npu"), ws.run("cpu"), 0)
    rc = root_cause(table)
    assert rc.first_origin is not None
    assert rc.first_origin.op_type == "LayerNorm" and rc.first_origin.pass_name == "LayerNormFusionPass"
    assert all(p.order > rc.first_origin.order for p in rc.propagators)


def test_ops_are_taken_in_execution_order_whatever_the_row_order():
    """A table whose rows are not in execution order (an op's rows apart, a later op first)
    and an op named "nan", which a CSV reader turns into a missing value."""
    from precision_tool.analysis import root_cause, summarize
    rows = [
        {"NPUDump": "c", "TensorIndex": "c:output:0", "CosineSimilarity": 0.3, "Verdict": "fail"},
        {"NPUDump": "b", "TensorIndex": "b:output:0", "CosineSimilarity": 0.4, "Verdict": "fail"},
        {"NPUDump": float("nan"), "TensorIndex": "nan:output:0", "CosineSimilarity": 0.2,
         "Verdict": "fail"},
        {"NPUDump": "c", "TensorIndex": "c:input:0", "CosineSimilarity": 0.4},
        {"NPUDump": "b", "TensorIndex": "b:input:0", "CosineSimilarity": 1.0},
    ]
    table = _table(rows).assign(Index=[5, 3, 9, 4, 2])
    ops = summarize(table, 0.98, limit=0)
    assert [o.op_name for o in ops[:2]] == ["b", "c"] and [o.order for o in ops] == [2, 4, 9]
    assert ops[2].op_name != ops[2].op_name                        # the nan-named op, apart
    assert ops[0].input_cosines == [1.0] and ops[1].input_cosines == [0.4]
    rc = root_cause(table, 0.98)
    assert [o.op_name for o in rc.origins][:1] == ["b"] and len(rc.origins) == 2
    assert [p.op_name for p in rc.propagators] == ["c"]


def test_an_fp32_adam_step_that_amplifies_rounding_is_noise_and_nothing_else_is():
    """Adam's step ends in addcdiv_: from inputs within tolerance of the golden's, a bias that
    starts at zero differs in direction and in norm (full steps where the golden's gradient,
    below eps, took partial ones): computed in fp32 it is noise, not an origin. Computed in
    fp16, from inputs equal to the golden's, or by a step that divides by nothing (add_),
    the same rows stay an origin."""
    from precision_tool.analysis import root_cause

    def table(op_type="Tensor.addcdiv_", dtype="float32", in_cosine=0.9999914):
        rows = [{"NPUDump": "upd", "OpType": op_type, "TensorIndex": f"upd:input:{k}",
                 "CosineSimilarity": c, "NpuNorm": 1.0, "GoldenNorm": 1.0,
                 "NpuDataType": dtype, "GoldenTensor": f"g{k}"}
                for k, c in enumerate([1.0, in_cosine, in_cosine])]
        rows.append({"NPUDump": "upd", "OpType": op_type, "TensorIndex": "upd:output:0",
                     "CosineSimilarity": 0.82897008, "NpuNorm": 1.2005, "GoldenNorm": 1.0,
                     "NpuDataType": dtype, "GoldenTensor": "out", "GroundTruth": "upd"})
        return _table(rows)
    assert root_cause(table()).origins == []
    assert [d.op_name for d in root_cause(table()).cancellations] == ["upd"]
    for t in (table(dtype="float16"), table(in_cosine=1.0), table(op_type="Tensor.add_")):
        assert [d.op_name for d in root_cause(t).origins] == ["upd"]


def test_an_fp32_adam_step_by_statistics_is_judged_as_by_tensors():
    """The same Adam step in a statistics dump (a healthy transformer's step 0: its first
    moment's norm 0.004653 against 0.004651, its output's 0.001028 against 0.000905): no
    cosine, and the inputs' norms differ, so the step is noise as its tensors say (a
    statistics dump of that run called it the origin and asked for fp32 master weights of
    fp32 weights). With the inputs' norms equal, or computed in fp16, it stays an origin."""
    from precision_tool.analysis import root_cause
    from precision_tool.analysis.comparing.verdicts import STATS_ONLY

    def row(io, a, b, dtype, golden):
        return {"NPUDump": "upd", "OpType": "Tensor.addcdiv_", "TensorIndex": f"upd:{io}",
                "CosineSimilarity": float("nan"), "NpuNorm": a, "GoldenNorm": b,
                "NormRelativeDiff": (a - b) / b if b else 0.0, "CompareFailReason": STATS_ONLY,
                "NpuDataType": dtype, "GoldenTensor": golden}

    def table(dtype="float32", norms=((0.0, 0.0), (0.004653, 0.004651), (0.093053, 0.093023))):
        rows = [row(f"input:{k}", a, b, dtype, f"g{k}") for k, (a, b) in enumerate(norms)]
        rows.append(dict(row("output:0", 0.001028, 0.000905, dtype, "out"), GroundTruth="upd"))
        return _table(rows)
    assert root_cause(table()).origins == []
    assert [d.op_name for d in root_cause(table()).cancellations] == ["upd"]
    for t in (table(dtype="float16"), table(norms=((0.0, 0.0), (0.5, 0.5), (0.25, 0.25)))):
        assert [d.op_name for d in root_cause(t).origins] == ["upd"]


def test_an_empty_table_has_no_summary_and_no_cause():
    from precision_tool.analysis import root_cause, summarize
    from precision_tool.analysis.comparing.compare import COLUMNS
    table = pd.DataFrame([], columns=COLUMNS)
    assert summarize(table) == [] and root_cause(table).origins == []


def test_cancellation_noise_is_not_an_origin_and_neither_is_what_carries_it():
    """Norm bounds: a BiasAddGrad whose golden output is below fp16 tolerance x its input norm
    is noise; Adam reading only that noise carries it; a product beyond the bound of its
    inputs' norms product and a sum above its bound are real origins."""
    from precision_tool.analysis import root_cause, summarize
    def row(op, kind, io, cos, norm, golden, op_type, verdict="fail", dtype="float16"):
        return {"NPUDump": op, "OpType": op_type, "TensorIndex": f"{op}:{io}", "CosineSimilarity": cos,
                "GoldenNorm": norm, "GoldenTensor": golden, "NpuDataType": dtype,
                "Verdict": "pass" if cos >= 0.98 else verdict}
    table = _table([
        row("bgrad", "", "input:0", 1.0, 10.0, "dk:0", "BiasAddGrad"),
        row("bgrad", "", "output:0", 0.1, 5e-3, "bgrad:0", "BiasAddGrad"),   # <= 1e-3 * 10
        row("adam", "", "input:0", 0.1, 5e-3, "bgrad:0", "ApplyAdam", dtype="float32"),
        row("adam", "", "output:0", 0.2, 0.01, "adam:0", "ApplyAdam", dtype="float32"),
        row("mul", "", "input:0", 1.0, 2.0, "a:0", "Mul"),
        row("mul", "", "input:1", 1.0, 3.0, "b:0", "Mul"),
        row("mul", "", "output:0", 0.5, 0.1, "mul:0", "Mul"),                 # > 1e-3 * 6
        row("sum", "", "input:0", 1.0, 10.0, "c:0", "ReduceSum"),
        row("sum", "", "output:0", 0.5, 0.02, "sum:0", "ReduceSum"),          # > 1e-3 * 10
        row("exp", "", "input:0", 1.0, 10.0, "d:0", "Exp"),
        row("exp", "", "output:0", 0.5, 1e-9, "exp:0", "Exp"),                # not a sum or product
        row("nan", "", "input:0", 1.0, 10.0, "e:0", "Add"),
        row("nan", "", "output:0", float("nan"), 1e-9, "nan:0", "Add", verdict="nan"),
    ])
    rc = root_cause(table)
    assert [d.op_name for d in rc.cancellations] == ["bgrad", "adam"]
    assert [d.op_name for d in rc.origins] == ["mul", "sum", "exp", "nan"] and rc.propagators == []
    cats = {s.op_name: s.category for s in summarize(table, limit=0)}
    assert cats == {"bgrad": "cancellation", "adam": "cancellation", "mul": "diverging",
                    "sum": "diverging", "exp": "diverging", "nan": "nonfinite"}


def _chain_row(op, io, cos, red, golden, op_type="Mul", dtype="float16"):
    """A row of a compare table with its cosine, its relative Euclidean distance and the
    golden tensor it holds (verdict by cosine 0.98)."""
    return {"NPUDump": op, "OpType": op_type, "TensorIndex": f"{op}:{io}",
            "CosineSimilarity": cos, "RelativeEuclideanDistance": red, "GoldenTensor": golden,
            "GoldenNorm": 1.0, "NpuDataType": dtype,
            "Verdict": "pass" if cos >= 0.98 else "fail"}


def test_a_list_kernels_lanes_carry_their_own_effects():
    """The scaler's unscale takes every gradient in one call. Lane 1 reads a BatchNorm's
    weight gradient (inputs at 0.999, output at 0.9797: an origin by the rule), whose update
    writes a weight that matches; lane 0 reads another origin's gradient whose update moves
    its weight apart. As one op, the unscale had an effect through lane 0, and so the
    BatchNorm was a finding; lane by lane, the BatchNorm's divergence is absorbed by its own
    update, and the other origin stays the finding. The lanes also read what every lane
    shares (found_inf, inv_scale)."""
    from precision_tool.analysis import root_cause
    from precision_tool.analysis.diagnosis.rootcause import OpRows, call_name
    row, scaler = _chain_row, "Torch._amp_foreach_non_finite_check_and_unscale_"

    def unscale(io, cos, red, golden):
        return row("unscale", io, cos, red, golden, scaler, "float32")

    def update(op, io, cos, red, golden):
        return row(op, io, cos, red, golden, "Tensor.addcdiv_", "float32")
    table = _table([
        row("other", "input:0", 1.0, 0.0, "x:0"),
        row("other", "output:0", 0.5, 1.0, "g0:0"),
        row("bn", "input:0", 0.999, 0.04, "dy:0"),
        row("bn", "output:0", 0.9797, 0.2, "g1:0"),
        unscale("input:0", 0.5, 1.0, "g0:0"), unscale("input:1", 0.9797, 0.2, "g1:0"),
        unscale("input:2", 1.0, 0.0, "found_inf:0"), unscale("input:3", 1.0, 0.0, "inv:0"),
        unscale("output:0", 0.5, 1.0, "u0:0"), unscale("output:1", 0.9797, 0.2, "u1:0"),
        update("upd0", "input:0", 1.0, 0.0, "w0:0"), update("upd0", "input:1", 0.5, 1.0, "u0:0"),
        update("upd0", "output:0", 0.5, 1.0, "upd0:0"),
        update("upd1", "input:0", 1.0, 0.0, "w1:0"),
        update("upd1", "input:1", 0.9797, 0.2, "u1:0"),
        update("upd1", "output:0", 1.0, 1e-5, "upd1:0"),
    ])
    rc = root_cause(table)
    assert [d.op_name for d in rc.origins] == ["other"]
    quiet = {d.op_name: d.absorbed_by for d in rc.no_effect}
    assert quiet == {"bn": [], "unscale[1]": ["upd1"]}
    assert [d.op_name for d in rc.propagators] == ["unscale[0]", "upd0"]
    t = OpRows(table)
    lane = t.rows_by_op["unscale[1]"]
    assert sorted(t.tensor[i] for i in t.inputs("unscale[1]", lane)) == [
        "unscale:input:1", "unscale:input:2", "unscale:input:3"]
    # the table and the dump know the call: a lane's name leads back to it
    assert [call_name(n) for n in ("unscale[1]", "bn", "x[a]", "y[]")] == \
        ["unscale", "bn", "x[a]", "y[]"]


def test_adams_first_step_of_a_small_bias_is_noise_where_its_gradient_only_rounds():
    """EfficientNet's SE-block bias (4 zeros) at its first AdamW step: the gradient comes in
    at cosine 0.9987, off by a relative error of 5.6% (a tensor of few elements is judged
    by it: a fail), one element moved across zero by the fp16 rounding it carries, and the
    normalised step takes a full step the other way there (the bias at cosine 0.5, its norm
    kept). That update is noise, as where its inputs match: no propagator with an effect,
    and the gradient's op, whose divergence only it read, has none. An input off by more
    than its relative error (its cosine fails too) keeps the update a propagator."""
    from precision_tool.analysis import root_cause
    row = _chain_row

    def update(io, cos, red, golden):
        return dict(row("upd", io, cos, red, golden, "Tensor.addcdiv_", "float32"), Elements=4,
                    GoldenNorm=1e-3)

    def table(grad_cos):
        return _table([
            row("grad", "input:0", 0.9993, 0.038, "dy:0"),
            dict(row("grad", "output:0", grad_cos, 0.056, "g:0"), Elements=4),
            update("input:0", 1.0, 0.0, "b:0"), update("input:1", grad_cos, 0.056, "g:0"),
            update("input:2", 0.9994, 0.042, "d:0"), update("output:0", 0.5, 1.0, "upd:0"),
        ])
    rc = root_cause(table(0.9987))
    assert rc.origins == [] and rc.propagators == []
    assert "upd" in {d.op_name for d in rc.cancellations}
    rc = root_cause(table(0.9))
    assert [d.op_name for d in rc.propagators] == ["upd"]


def test_an_op_that_crosses_with_what_came_in_is_gradual_not_an_origin():
    """ResNet-18's fp16 backward, as measured: a ReLU's gradient passes at cosine 0.9806
    (distance 0.197, from a mask its forward saved at 0.07), the BatchNorm backward reading
    it crosses to 0.978 (0.210, 1.07x) and the ops after it each add a little: gradual, no
    origin, no finding. An op reading that gradual error and adding more than GROWS times it
    is a finding (a propagator no origin leads); an op whose inputs match at rounding level
    and whose output fails by as much is an origin; so is one with no distances (statistics
    only). A crossing whose input's difference one op made (a jump of AMPLIFIES times, past
    rounding, though that op's outputs pass) stays an origin."""
    from precision_tool.analysis import count_findings, root_cause, summarize
    from precision_tool.analysis.diagnosis.rootcause import GROWS
    row = _chain_row
    table = _table([
        row("relu_b", "input:0", 0.99995, 0.07, "g0:0"),
        row("relu_b", "output:0", 0.9806, 0.197, "relu_b:0"),
        row("bn_b", "input:0", 0.9806, 0.197, "relu_b:0"),
        row("bn_b", "output:0", 0.978, 0.210, "bn_b:0"),             # 1.07x: crosses
        row("conv_b", "input:0", 0.978, 0.210, "bn_b:0"),
        row("conv_b", "output:0", 0.969, 0.2476, "conv_b:0"),       # carries it on
        row("amp", "input:0", 0.969, 0.2476, "conv_b:0"),
        row("amp", "output:0", 0.5, GROWS * 0.2476 * 1.5, "amp:0"),  # adds 3x: a finding
        row("real", "input:0", 0.99999, 0.001, "r0:0"),
        row("real", "output:0", 0.978, 0.210, "real:0"),            # 210x: an origin
        row("stats", "input:0", 0.99, float("nan"), "s0:0"),
        row("stats", "output:0", 0.97, float("nan"), "stats:0"),    # no distance: an origin
    ])
    rc = root_cause(table)
    assert [d.op_name for d in rc.gradual] == ["bn_b", "conv_b"]
    assert [d.op_name for d in rc.origins] == ["real", "stats"]
    assert [d.op_name for d in rc.propagators] == ["amp"]
    assert rc.gradual_ops <= rc.benign_ops
    cats = {s.op_name: s.category for s in summarize(table, limit=0)}
    assert cats["bn_b"] == cats["conv_b"] == "gradual" and cats["amp"] == "diverging"
    assert count_findings(table) == 3
    # the same crossing with a wider jump (2.5x its input's distance) is an origin
    wider = table.copy()
    wider.loc[3, "RelativeEuclideanDistance"] = 2.5 * 0.197
    rc = root_cause(wider)
    assert rc.gradual == [] and rc.origins[0].op_name == "bn_b"
    # the ReLU's gradient made from one at rounding level (19.5x, past fp16's 0.01): the
    # BatchNorm's crossing carries what the ReLU made, and stays an origin
    made = table.copy()
    made.loc[0, "RelativeEuclideanDistance"] = 0.0101
    rc = root_cause(made)
    assert rc.gradual == [] and rc.origins[0].op_name == "bn_b"


def test_an_exact_kernel_whose_mask_flips_is_gradual_unless_its_inputs_are_the_goldens():
    """A healthy fp16-autocast ResNet-18, as measured at its third step: the last ReLU's
    gradient reads an incoming gradient at cosine 0.99994 and the activation its forward
    saved at 0.9942, and comes out at 0.97278: the saved activation's
    rounding moved elements near zero across the mask. A ReLU's gradient rounds nothing, so
    it is gradual, not an origin, and so is the BatchNorm backward that carries it on.
    With inputs equal to the golden's bit for bit, the same output is the kernel's own
    error: an origin. So is one whose output is narrower than its input (a cast inside),
    a nan/inf output, and the same numbers from a kernel that rounds (a Mul)."""
    from precision_tool.analysis import count_findings, root_cause

    def table(op_type="ReluGrad", in_cos=0.99994, in_red=0.0105, out_dtype="float16",
              out_verdict=None):
        row = _chain_row
        out = row("relu_b", "output:0", 0.97278, 0.2331, "relu_b:0", op_type, out_dtype)
        if out_verdict:
            out["Verdict"] = out_verdict
        return _table([
            row("relu_b", "input:0", in_cos, in_red, "g0:0", op_type),
            row("relu_b", "input:1", 0.9942 if in_cos < 1 else 1.0,
                0.1077 if in_red > 0 else 0.0, "act:0", op_type),
            out,
            row("bn_b", "input:0", 0.97278, 0.2331, "relu_b:0", "BatchNormGrad"),
            row("bn_b", "output:0", 0.9688, 0.2498, "bn_b:0", "BatchNormGrad"),
        ])
    rc = root_cause(table())
    assert [d.op_name for d in rc.gradual] == ["relu_b", "bn_b"] and rc.origins == []
    assert count_findings(table()) == 0
    for changed in (dict(in_cos=1.0, in_red=0.0),          # inputs bit for bit: its own
                    dict(op_type="Mul"),                     # a kernel that rounds
                    dict(out_dtype="bfloat16"),              # a cast down inside the kernel
                    dict(out_verdict="nonfinite")):
        rc = root_cause(table(**changed))
        assert [d.op_name for d in rc.origins] == ["relu_b"], changed
        assert rc.gradual == [], changed


def test_a_loss_its_backward_saved_is_still_what_the_step_puts_out():
    """A script's step as its dump has it: a loss (one element) off by 40% from logits that
    pass, read by nothing but its own backward, which saved its forward's rows and matches
    (the gradient of a loss is 1 whatever the loss). That backward absorbs nothing of the
    loss's value: the loss is an origin with an effect, a finding. A ReLU's output, which
    its backward does read (the mask), is absorbed by a backward that matches, as before."""
    from precision_tool.analysis import count_findings, root_cause

    def row(op, io, cos, verdict, elements, golden, op_type="Functional.cross_entropy"):
        return {"NPUDump": op, "OpType": op_type, "TensorIndex": f"{op}:{io}",
                "CosineSimilarity": cos, "RelativeEuclideanDistance": 1 - cos,
                "GoldenTensor": golden, "GoldenNorm": 1.0, "NpuDataType": "float32",
                "Elements": elements, "Verdict": verdict}
    table = _table([
        row("ce.forward", "input:0", 0.999, "pass", 40, "logits:0"),
        dict(row("ce.forward", "output:0", 1.0, "fail", 1, "ce.forward:0"),
             RelativeEuclideanDistance=0.4),                             # relative error
        row("ce.backward", "input:0", 1.0, "pass", 1, "one:0"),
        row("ce.backward", "output:0", 0.999, "pass", 40, "ce.backward:0"),
        row("relu.forward", "input:0", 0.999, "pass", 40, "h:0", "Functional.relu"),
        row("relu.forward", "output:0", 0.9, "fail", 40, "relu.forward:0", "Functional.mul"),
        row("relu.backward", "input:0", 1.0, "pass", 40, "g:0", "Functional.relu"),
        row("relu.backward", "output:0", 0.999, "pass", 40, "relu.backward:0",
            "Functional.relu"),
    ])
    rc = root_cause(table)
    assert [d.op_name for d in rc.origins] == ["ce.forward"]
    assert [d.op_name for d in rc.no_effect] == ["relu.forward"]
    assert rc.no_effect[0].absorbed_by == ["relu.backward"]
    assert count_findings(table) == 1


def test_a_call_is_exact_by_its_api_and_direction():
    """A dumped call with no kernel named (msprobe's) is exact by its API and the direction
    its name ends in: a ReLU both ways (a module's call too, msprobe's Module...forward.0),
    a max pool forward only (its backward sums overlapping windows); a gradient's sum over
    branches, a Linear and an unnamed direction are not."""
    from precision_tool.analysis.comparing.sums import call_kind
    exact = [("Functional.relu", "Functional.relu.3.backward"),
             ("Tensor.relu_", "Tensor.relu_.0.forward"),
             ("Module.ReLU", "Module.layer1.0.relu.ReLU.forward.0"),
             ("Module.ReLU", "Module.layer1.0.relu.ReLU.backward.2"),
             ("Functional.max_pool2d", "Functional.max_pool2d.0.forward")]
    other = [("Functional.max_pool2d", "Functional.max_pool2d.0.backward"),
             ("Functional.relu", "Functional.relu.14.backward.grad_sum.0"),
             ("Functional.linear", "Functional.linear.0.forward"),
             ("Functional.relu", "Functional.relu")]
    assert [call_kind(*c) for c in exact] == ["exact"] * len(exact)
    assert [call_kind(*c) for c in other] == [""] * len(other)


def test_a_statistics_only_origin_says_how_far_its_inputs_norms_already_moved():
    """A BatchNorm backward compared by statistics only, as a healthy fp16-autocast
    ResNet-18 gave it at step 6: its incoming gradient's norm 4.1% off (within the
    criteria), its bias gradient's 19.7%. Norms cannot tell its own error from its inputs'
    made larger, so the origin carries that 4.1% for the advice to say; inputs whose norms
    match give 0, and so does an origin judged by tensors."""
    from precision_tool.analysis import root_cause

    def table(in_diff, by_tensors=False):
        def row(io, diff, verdict):
            r = {"NPUDump": "bn_b", "OpType": "Functional.batch_norm", "TensorIndex":
                 f"bn_b:{io}", "NormRelativeDiff": diff, "GoldenNorm": 1.0,
                 "NpuDataType": "float32", "GoldenTensor": f"bn_b.{io}", "Verdict": verdict,
                 "CompareFailReason": "" if by_tensors else "statistics only"}
            if by_tensors:
                r.update(CosineSimilarity=0.999 if verdict == "pass" else 0.9,
                         RelativeEuclideanDistance=0.01 if verdict == "pass" else 0.3)
            return r
        return _table([row("input:0", in_diff, "pass"), row("output:2", 0.1972, "fail")])
    origin = root_cause(table(0.041019)).origins[0]
    assert origin.op_name == "bn_b" and origin.inputs_off == pytest.approx(0.041019)
    assert root_cause(table(0.0)).origins[0].inputs_off == 0.0
    assert root_cause(table(0.041019, by_tensors=True)).origins[0].inputs_off == 0.0


def _deep_batch_norm_step(root, mode="force_fp16"):
    """One SGD step of 12 dense layers, each with BatchNorm over a batch of 8 and ReLU,
    on digits, dumped on the NPU under `mode` and on the golden."""
    from precision_tool import ops
    g = pt.Graph("deep", seed=0)
    with g.as_default():
        x = pt.placeholder("x", [None, 64])
        y = pt.placeholder("y", [None], "int32")
        h = x
        for k in range(12):
            h = pt.nn.relu(pt.nn.batch_norm(pt.nn.dense(h, 64, name=f"fc{k}"), name=f"bn{k}"))
        logits = pt.nn.dense(h, 10, name="out")
        loss = ops.reduce_mean(ops.sparse_softmax_cross_entropy_with_logits(logits, y))
        train = pt.train.SGD(0.1).minimize(loss)
    d = pt.data.digits()
    npu = pt.Session(g, target="npu", config=hooks.session_dump_config(
        pt.SessionConfig(precision_mode=mode), action="dump", data_dir=root))
    cpu = hooks.sess_dump(pt.Session(g), action="dump", data_dir=root)
    feed = {x: d.x_train[:8], y: d.y_train[:8]}
    npu.run([loss, train], feed)
    cpu.run([loss, train], feed)


def test_fp16_rounding_grown_over_a_deep_network_is_said_gradual_and_sound(tmp_path):
    """12 dense + BatchNorm (batch 8) + ReLU layers under force_fp16: the backward's
    rounding grows layer by layer past cosine 0.98, no op adding as much again as it
    receives; the bias gradients (zero in exact arithmetic under a BatchNorm) are noise at
    the floor of the error their terms carry. ac -c says so (a panel and the advice, the
    first crossing's cosines in full) and calls the run sound, exit 0. Against 0.999 the
    first backward ReLU's mask flips turn rounding-level activations into a gradient
    further off (cosine 0.99987 to 0.9906): an exact kernel rounds nothing, so that is
    gradual too, and the run stays sound; its first crossing is that ReLU's gradient."""
    import json
    from click.testing import CliRunner
    from precision_tool.cli import cli
    root = str(tmp_path)
    _deep_batch_norm_step(root)
    out = CliRunner().invoke(cli, ["--data-dir", root, "--json", "ac", "-c"])
    assert out.exit_code == 0, out.output
    r = json.loads(out.stdout)
    g = r["gradual"]
    assert r["verdict"] == "sound" and r["origin"] is None and g["ops"] >= 3
    assert g["first"]["input_cosine"] >= 0.98 > g["first"]["output_cosine"]
    assert any("BiasAddGrad" in c for c in r["cancellations"])
    assert "cross the threshold gradually" in " ".join(r["advice"])
    shown = CliRunner().invoke(cli, ["--data-dir", root, "ac", "-c"]).output
    assert "Diverges gradually" in shown and f"{g['first']['output_cosine']:.8g}" in shown
    strict = CliRunner().invoke(cli, ["--data-dir", root, "--json", "ac", "-c", "-t", "0.999"])
    assert strict.exit_code == 0, strict.output
    s = json.loads(strict.stdout)
    assert s["origin"] is None and s["gradual"]["first"]["op_type"] == "ReluGrad"
    assert s["gradual"]["first"]["input_cosine"] >= 0.999 > s["gradual"]["first"]["output_cosine"]


def test_an_update_stepping_by_what_an_overflow_made_is_its_effect():
    """An AdamW-like update (an in-place call writing its input 0) whose written weight
    matches the golden's while the moment it steps by diverges: what an overflowing op made
    reaches the update's change, an effect (the op is the origin); a divergence no overflow
    made is left to the value the update writes (absorbed, no effect)."""
    from precision_tool.analysis import root_cause
    row = _chain_row
    table = _table([
        row("norm", "input:0", 0.99999, 0.001, "x:0"),
        row("norm", "output:0", 0.1, 1.0, "norm:0"),
        dict(row("upd", "input:0", 1.0, 0.0, "w:0"), OpType="Tensor.addcdiv_"),
        dict(row("upd", "input:1", 0.1, 1.0, "norm:0"), OpType="Tensor.addcdiv_"),
        dict(row("upd", "output:0", 1.0, 1e-4, "upd:0"), OpType="Tensor.addcdiv_"),
    ])
    assert [d.op_name for d in root_cause(table).no_effect] == ["norm"]
    rc = root_cause(table, overflowed={"norm"})
    assert [d.op_name for d in rc.origins] == ["norm"] and rc.no_effect == []


def test_a_calls_backward_reads_what_its_forward_saved():
    """An API-level dump records a backward with its gradients only; it computes from what
    its forward saved too. A ReLU's backward whose gradient input matches but whose forward
    output (its mask) diverges is no origin: its bad inputs name the forward's output, and
    it carries on the forward's origin. Without the forward's rows it stays an origin."""
    from precision_tool.analysis import root_cause
    row = _chain_row
    rows = [
        row("Functional.linear.0.forward", "input:0", 0.99999, 0.001, "x:0"),
        row("Functional.linear.0.forward", "output:0", 0.95, 0.30, "lin:0"),
        row("Functional.relu.0.forward", "input:0", 0.95, 0.30, "lin:0"),
        row("Functional.relu.0.forward", "output:0", 0.95, 0.31, "relu:0"),
        row("Functional.relu.0.backward", "input:0", 0.99999, 0.001, "grad:0"),
        row("Functional.relu.0.backward", "output:0", 0.93, 0.40, "relu_b:0"),
    ]
    rc = root_cause(_table(rows))
    assert [d.op_name for d in rc.origins] == ["Functional.linear.0.forward"]
    backward = next(d for d in rc.propagators if d.op_name == "Functional.relu.0.backward")
    assert "Functional.relu.0.forward:output:0" in backward.bad_inputs
    alone = root_cause(_table(rows[4:]))
    assert [d.op_name for d in alone.origins] == ["Functional.relu.0.backward"]


def test_a_short_summary_is_the_head_of_the_whole_one():
    """summarize builds only the ops it returns: with a limit, by cosine or not, noise last or
    not, they are the head of the whole list in that order; count_findings counts the whole
    list's findings."""
    from precision_tool.analysis import count_findings, root_cause, summarize
    def row(op, io, cos, norm, op_type, verdict="fail"):
        return {"NPUDump": op, "OpType": op_type, "TensorIndex": f"{op}:{io}", "CosineSimilarity": cos,
                "GoldenNorm": norm, "GoldenTensor": f"{op}:0", "NpuDataType": "float16",
                "Verdict": "pass" if cos >= 0.98 else verdict}
    table = _table([
        row("bgrad", "input:0", 1.0, 10.0, "BiasAddGrad"),
        row("bgrad", "output:0", 0.1, 5e-3, "BiasAddGrad"),            # noise, worst cosine
        row("mul", "input:0", 1.0, 2.0, "Mul"),
        row("mul", "output:0", 0.5, 0.1, "Mul"),
        row("nan", "input:0", 1.0, 10.0, "Add"),
        row("nan", "output:0", float("nan"), 1e-9, "Add", verdict="nan"),
        row("sum", "input:0", 1.0, 10.0, "ReduceSum"),
        row("sum", "output:0", 0.7, 0.02, "ReduceSum"),
    ])
    cause = root_cause(table)
    assert cause.noise_ops == {"bgrad"}
    same = lambda a, b: list(map(repr, a)) == list(map(repr, b))      # nan cosines compare equal
    for by_cosine in (False, True):
        whole = summarize(table, limit=0, by_cosine=by_cosine, cause=cause)
        findings_first = sorted(whole, key=lambda s: not s.is_finding)
        for limit in (1, 2, 3):
            assert same(summarize(table, limit=limit, by_cosine=by_cosine), whole[:limit])
            assert same(summarize(table, limit=limit, by_cosine=by_cosine, cause=cause,
                                  noise_last=True), findings_first[:limit])
    assert [s.op_name for s in summarize(table, limit=0, by_cosine=True)] == ["nan", "bgrad", "mul", "sum"]
    assert [s.op_name for s in summarize(table, limit=2, noise_last=True)] == ["mul", "nan"]
    assert count_findings(table) == count_findings(table, cause=cause) == 3


def _planted_layer_norm():
    """An fp16 input of mean 100 and std 1 straight into a LayerNorm, then a dense head."""
    g = pt.Graph("planted")
    with g.as_default():
        x = pt.placeholder("x", [None, 64], "float16")
        y = pt.nn.layer_norm(pt.ops.mul(x, 1.0), name="norm")
        out = pt.nn.dense(y, 10, name="head")
    return g, x, out, (100 + np.random.default_rng(1).normal(size=(16, 64))).astype(np.float16)


def test_two_npu_runs_compare_fusion_on_against_fusion_off(tmp_path):
    """The planted fp16 LayerNorm: fusion on against fusion off names the fused LayerNorm as
    the origin; a run against a rerun of itself is identical on every tensor."""
    from precision_tool.analysis import root_cause
    g, x, out, xv = _planted_layer_norm()
    root = str(tmp_path)
    for switch in ("on", "off", "on"):
        cfg = pt.SessionConfig(precision_mode="allow_mix_precision", fusion_switch=switch)
        pt.Session(g, target="npu", config=hooks.session_dump_config(
            cfg, action="dump", data_dir=root)).run(out, {x: xv})
    ws = Workspace(root)
    fused, unfused, again = ws.runs("npu")
    table = vector_compare(ws, fused, unfused, 0)
    assert not (table.Verdict == "error").any()
    origin = root_cause(table).first_origin
    assert origin.op_name == "norm/Add_1" and origin.pass_name == "LayerNormFusionPass"
    same = vector_compare(ws, fused, again, 0)
    compared = same[same.Verdict != "npu-only"]
    assert len(compared) > 5 and (compared.MaxAbsoluteError == 0).all()
    assert (compared.CosineSimilarity.dropna() == 1.0).all()


def test_golden_against_golden_passes_every_op_with_cosine_exactly_one(tmp_path):
    m = pt.models.transformer()
    d = pt.data.digits()
    for _ in range(2):
        sess = hooks.sess_dump(pt.Session(m.graph), action="dump", data_dir=str(tmp_path))
        sess.run([m.loss, m.train_op], {m.x: d.x_train[:16], m.y: d.y_train[:16]})
    ws = Workspace(str(tmp_path))
    first, second = ws.runs("cpu")
    table = vector_compare(ws, first, second, 0)
    assert len(table) > 300 and (table.Verdict == "pass").all()
    assert (table.CosineSimilarity == 1.0).all() and (table.MaxAbsoluteError == 0).all()


def test_compare_from_statistics_only(tmp_path):
    """The NPU dumped statistics only: rows come from the two index rows; their norms equal
    the norms of a tensor dump of the same step, the planted fused LayerNorm (whose variance
    goes wrong) is still the origin, and a stats row on its own passes or fails by the norm."""
    from precision_tool.analysis import root_cause
    from precision_tool.analysis.comparing.compare import compare_stats
    from precision_tool.analysis.comparing.verdicts import verdict
    g, x, out, xv = _planted_layer_norm()
    root = str(tmp_path)
    for data in ("stats", "tensor"):
        pt.Session(g, target="npu", config=hooks.session_dump_config(
            pt.SessionConfig(precision_mode="allow_mix_precision"), action="dump", dump_data=data,
            data_dir=root)).run(out, {x: xv})
    hooks.sess_dump(pt.Session(g), action="dump", data_dir=root).run(out, {x: xv})
    ws = Workspace(root)
    stats_run, tensor_run = ws.runs("npu")
    by_stats = vector_compare(ws, stats_run, ws.run("cpu"), 0)
    by_tensor = vector_compare(ws, tensor_run, ws.run("cpu"), 0)
    compared = by_stats.Verdict != "npu-only"
    assert by_stats[compared].CompareFailReason.str.startswith("statistics only").all()
    assert by_stats[compared].CosineSimilarity.isna().all()
    # tensor compares take norms over the elements finite on both sides: compare where all are
    finite = compared & (by_tensor.NpuNanCount + by_tensor.NpuInfCount == 0)
    assert finite.sum() >= 5
    np.testing.assert_allclose(by_stats[finite].NpuNorm, by_tensor[finite].NpuNorm, rtol=1e-12)
    np.testing.assert_allclose(by_stats[finite].GoldenNorm, by_tensor[finite].GoldenNorm, rtol=1e-12)
    origin = root_cause(by_stats).first_origin
    assert origin.op_name == "norm/Add_1" and origin.pass_name == "LayerNormFusionPass"
    # one row by hand: norms 3 and 4 differ by 1/4 relatively
    a = {"max": 2.0, "min": -1.0, "mean": 0.5, "l2norm": 3.0, "nan_count": 0, "pos_inf_count": 0,
         "neg_inf_count": 0}
    b = dict(a, l2norm=4.0, max=3.0)
    row = compare_stats(a, b)
    assert row["NormRelativeDiff"] == -0.25 and row["MaxDiff"] == -1.0 and row["MeanDiff"] == 0.0
    # a statistics row is judged by its norms against the norm threshold (the cosine has none)
    assert verdict(row) == "fail" and verdict(row, {"norm": 0.3}) == "pass"
    assert verdict(row, 0.7) == "fail"                 # the cosine threshold does not decide it
    assert verdict(compare_stats(a, dict(a, l2norm=0.0))) == "fail"      # golden all zero
    assert verdict(compare_stats(dict(a, l2norm=0.0), dict(a, l2norm=0.0))) == "pass"


def test_a_statistics_row_takes_the_goldens_infinities_as_the_npus_saturated_values():
    """A mask's -inf that saturation mode holds at -65504: by statistics alone (no element
    count) the golden's k infinities are taken as the NPU's k -65504s and left out of its
    norm, as a tensor compare leaves them out; the norm then is the float64 norm of the
    other elements and the row passes. Where the NPU clipped more than those (a real
    overflow), or its extreme is not 65504, or its norm cannot hold k of them, the row is
    judged as it is."""
    from precision_tool import kernels
    from precision_tool.analysis.comparing.compare import compare_stats
    from precision_tool.analysis.comparing.verdicts import verdict
    rng = np.random.default_rng(4)
    golden = rng.normal(size=(8, 32, 32)).astype(np.float32)
    mask = np.triu(np.ones((32, 32), bool), 1)
    golden[:, mask] = -np.inf
    npu = golden.astype(np.float16)
    npu[:, mask] = -65504.0
    k = int(mask.sum()) * 8

    def stats(a):
        return kernels.tensor_stats(a)
    row = compare_stats(stats(npu), stats(golden))
    rest = npu[:, ~mask].astype(np.float64)
    assert row["NpuAtFp16Max"] == k and row["GoldenInfCount"] == k and row["NpuInfCount"] == 0
    # the subtraction cancels: its error is about 2**-52 of k * 65504**2 (0.015 of 4117)
    assert row["NpuNorm"] == pytest.approx(float(np.sqrt((rest ** 2).sum())), rel=1e-6)
    assert "taken as the NPU's ±65504" in row["CompareFailReason"]
    assert verdict(row) == "pass"
    beyond, clipped = golden.copy(), npu.copy()
    beyond[0, 5, 3], clipped[0, 5, 3] = -9e4, -65504.0      # a real overflow besides the mask
    more = compare_stats(stats(clipped), stats(beyond))
    assert more["NpuAtFp16Max"] == k and verdict(more) == "fail"
    other = compare_stats(stats(np.where(mask, np.float16(-6e4), npu)), stats(golden))
    assert other["NpuAtFp16Max"] == 0 and verdict(other) == "fail"
    small = dict(stats(npu), l2norm=1.0)        # cannot hold k values of 65504
    assert compare_stats(small, stats(golden))["NpuNorm"] == 1.0


def test_compare_step_is_vector_compare_without_pandas(tmp_path):
    """The Table vc works on and the DataFrame of vector_compare hold the same rows, their
    CSVs are the same bytes as pandas writes them, and `vc` itself never imports pandas."""
    import subprocess
    import sys
    from precision_tool.analysis import compare_step
    from precision_tool.table import Table
    m = pt.models.mlp()
    root = str(tmp_path)
    ws, npu_run, cpu_run, _ = _dump_both(root, m, precision_mode="allow_mix_precision")
    table = compare_step(ws, npu_run, cpu_run, 0)
    frame = vector_compare(ws, npu_run, cpu_run, 0)
    assert isinstance(table, Table) and table.attrs == frame.attrs
    assert table.to_csv() == frame.to_csv(index=False)
    assert table.columns == list(frame.columns) and len(table) == len(frame) > 20
    assert frame.Index.dtype == np.int64 and frame.CosineSimilarity.dtype == np.float64
    code = ("import sys; from precision_tool.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\nprint('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, "--data-dir", root, "vc"],
                         capture_output=True, text=True, timeout=120)
    assert "tensors compared" in out.stdout and out.stdout.split()[-1] == "False", \
        out.stdout + out.stderr


def test_a_compare_pauses_the_cyclic_collector_and_restores_it(tmp_path):
    """compare_step makes some forty containers a tensor and no cycles: no collection runs
    while it works (they walked every container again and again; one may run as the pause
    ends), and the collector is left as it was found, running or not, after an error too."""
    import contextlib
    import gc
    import sys
    from precision_tool.analysis import compare_step
    from precision_tool.collector import collector_paused
    ws, npu_run, cpu_run, _ = _dump_both(str(tmp_path), pt.models.transformer(layers=1),
                                         precision_mode="allow_mix_precision")
    within = []

    def callback(phase, info):                 # a collection that starts inside the compare
        frame = sys._getframe(1)
        while phase == "start" and frame is not None:
            if frame.f_code.co_name in ("_compare_step", "compare_pairs", "_allocate"):
                within.append(info["generation"])
                break
            frame = frame.f_back

    def _allocate():
        return [[k] for k in range(100_000)]         # allocations that start collections

    def _inside(pause):
        with pause():
            return _allocate()

    gc.callbacks.append(callback)
    try:
        _inside(contextlib.nullcontext)
        assert within, "the collector should run on these allocations when not paused"
        within.clear()
        _inside(collector_paused)
        compare_step(ws, npu_run, cpu_run, 0)
        assert not within and gc.isenabled()
    finally:
        gc.callbacks.remove(callback)
    gc.disable()
    try:
        with pytest.raises(Exception):
            compare_step(ws, npu_run, cpu_run, 99)               # a step that was not dumped
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(Exception):
        compare_step(ws, npu_run, cpu_run, 99)
    assert gc.isenabled()


def test_only_a_narrow_float_flushes_and_a_float32_row_carries_what_it_reads():
    """A zero in a float32 NPU tensor where the golden holds 4e-6 is cancellation (two
    ranks' +-0.0149 all-reduced), not underflow: it passes. A float32 row holding the same
    golden tensor as a flushed fp16 row (its cast), or made by an op that reads one, carries
    the flush and fails; a table that gives no dtype keeps the old rule."""
    from precision_tool.analysis.comparing.verdicts import judge
    from precision_tool.table import Table
    rows = [  # (op, tensor index, golden tensor, dtype, flushed share)
        ("all_reduce", "all_reduce:input:0", "grad", "float32", 0.0),
        ("all_reduce", "all_reduce:output:0", "reduced", "float32", 0.0625),
        ("mm", "mm:output:0", "g16", "float16", 0.077),
        ("cast", "cast:input:0", "g16", "float16", 0.077),
        ("cast", "cast:output:0", "g16", "float32", 0.077),
        ("unscale", "unscale:input:0", "g16", "float32", 0.077),
        ("unscale", "unscale:output:0", "unscaled", "float32", 0.077),
        ("sgd", "sgd:input:0", "unscaled", "float32", 0.077),
        ("sgd", "sgd:output:0", "w", "float32", 0.0),
        ("hand", "hand:output:0", "h", "", 0.0625),
    ]
    n = len(rows)
    table = Table({"Index": np.arange(n), "NPUDump": np.array([r[0] for r in rows], dtype=object),
                   "TensorIndex": np.array([r[1] for r in rows], dtype=object),
                   "GoldenTensor": np.array([r[2] for r in rows], dtype=object),
                   "NpuDataType": np.array([r[3] for r in rows], dtype=object),
                   "FlushedToZeroRatio": np.array([r[4] for r in rows]),
                   "CosineSimilarity": np.full(n, 0.9999), "NpuNorm": np.ones(n),
                   "GoldenNorm": np.ones(n), "Elements": np.full(n, 16.0)})
    got = dict(zip([r[1] for r in rows], judge(table)["Verdict"].tolist()))
    assert got == {"all_reduce:input:0": "pass", "all_reduce:output:0": "pass",
                   "mm:output:0": "fail", "cast:input:0": "fail", "cast:output:0": "fail",
                   "unscale:input:0": "fail", "unscale:output:0": "fail", "sgd:input:0": "fail",
                   "sgd:output:0": "pass", "hand:output:0": "fail"}
    # the same rows in another order are walked in execution order all the same
    shuffled = Table({k: np.asarray(table[k])[::-1] for k in table.columns})
    assert judge(shuffled)["Verdict"].tolist() == judge(table)["Verdict"].tolist()[::-1]
    # without the tensors' names nothing says what a float32 row carries: its holes pass
    bare = Table({k: np.asarray(table[k]) for k in table.columns if k != "GoldenTensor"})
    assert judge(bare)["Verdict"].tolist()[4:7] == ["pass", "pass", "pass"]


def test_golden_infinities_held_saturated_are_no_clip_but_one_more_65504_is():
    """An fp16 NPU row whose 65504s are as many as the golden's infinities the NPU does not
    hold (a mask's -inf held at -65504 in saturation mode) passes: inf_nan mode would hold
    -inf and pass too. One 65504 more is a finite value clipped: it fails "at max", and so
    does a clip where the golden has no infinity at all."""
    from precision_tool.analysis.comparing.verdicts import evaluate
    from precision_tool.table import Table
    cases = [  # (golden inf, npu inf, npu at or beyond 65504) -> verdict
        (64, 0, 64, "pass"), (64, 4, 60, "pass"), (64, 4, 61, "fail"), (64, 0, 65, "fail"),
        (0, 0, 1, "fail"),
        (0, 0, 0, "pass")]
    n = len(cases)
    table = Table({"Index": np.arange(n), "NPUDump": np.array(["fill"] * n, dtype=object),
                   "TensorIndex": np.array([f"fill:output:{k}" for k in range(n)], dtype=object),
                   "NpuDataType": np.array(["float16"] * n, dtype=object),
                   "GoldenInfCount": np.array([c[0] for c in cases], dtype=float),
                   "NpuInfCount": np.array([c[1] for c in cases], dtype=float),
                   "NpuAtFp16Max": np.array([c[1] + c[2] for c in cases], dtype=float),
                   "GoldenNanCount": np.zeros(n), "NpuNanCount": np.zeros(n),
                   "GoldenAbsMax": np.full(n, 3.0), "CosineSimilarity": np.ones(n),
                   "NpuNorm": np.ones(n), "GoldenNorm": np.ones(n),
                   "Elements": np.full(n, 256.0)})
    judged = evaluate(table)
    assert judged.verdicts.tolist() == [c[3] for c in cases]
    assert judged.only("at max").tolist() == [c[3] == "fail" for c in cases]


def test_a_replay_that_left_tensors_out_does_not_say_the_step_matches():
    """A step judged against the golden rerun from the NPU's state fails in nothing only if
    that compare saw every tensor: calls the rerun made under other names (an optimizer's
    state made at another step) had no golden, and the step was said to match."""
    from types import SimpleNamespace
    from precision_tool.analysis.autocheck import _still_failing

    def judged(complete):
        return SimpleNamespace(findings=0, updates=SimpleNamespace(lost=[]),
                               coverage=SimpleNamespace(complete=complete,
                                                        text=lambda: "36 of 228 tensors"))
    assert _still_failing(judged(True)) == []
    assert _still_failing(judged(False)) == ["not compared: 36 of 228 tensors"]
