"""Vector compare (groundwork of the analysis): mapping NPU tensors to golden ones and
comparing every dumped tensor of a step."""
import os

import numpy as np
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
    tmap = TensorMap(ws.graph_json(npu_run))
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
    assert ops[2].category == "nan" and ops[0].golden_ops == ["b"]
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


def test_an_empty_table_has_no_summary_and_no_cause():
    from precision_tool.analysis import root_cause, summarize
    from precision_tool.analysis.compare import COLUMNS
    table = pd.DataFrame([], columns=COLUMNS)
    assert summarize(table) == [] and root_cause(table).origins == []
