"""Fusion-off replay and pass bisection (groundwork): the planted pass is named."""
import numpy as np

import precision_tool as pt
from precision_tool import hooks
from precision_tool.analysis import bisect_fusion, fired_passes
from precision_tool.dump import Workspace


def _planted(tmp_path):
    """An unnormalised (mean 100, std 1) fp16 input straight into a LayerNorm, then a
    classifier trained one step; mixed precision with every pass on."""
    from test_repair import dump_step, planted_layer_norm_net
    return dump_step(tmp_path, planted_layer_norm_net(),
                     pt.SessionConfig(precision_mode="allow_mix_precision"))


def test_bisection_names_the_layer_norm_pass(tmp_path):
    ws = _planted(tmp_path)
    npu_run, golden = ws.run("npu"), ws.run("cpu")
    fired = fired_passes(ws, npu_run)
    assert "LayerNormFusionPass" in fired and len(fired) >= 2
    verdict = bisect_fusion(ws, npu_run, golden, 0)
    assert verdict.fusion_to_blame
    assert verdict.culprits == ["LayerNormFusionPass"]
    assert verdict.fused_nodes["LayerNormFusionPass"] == ["norm/Add_1"]
    # about ceil(log2 P) + 2 replays: the baseline, the original, then the halvings
    assert verdict.replays <= int(np.ceil(np.log2(len(fired)))) + 2
    assert "norm/Add_1:0" in verdict.new_failures
    runs = [r.name for r in Workspace(str(tmp_path)).runs("npu")]
    assert runs == ["debug_0", verdict.runs[0]] and verdict.kept == verdict.runs[:1]
    assert len(verdict.runs) == verdict.replays


def test_auto_check_tells_the_story_of_the_planted_graph(tmp_path):
    import json
    from precision_tool.analysis import auto_check
    ws = _planted(tmp_path)
    result = auto_check(ws, compare=True)
    assert result.fusion["LayerNormFusionPass"] == 1
    # the one-pass variance E[x^2] - E[x]^2 of inputs near 100 cancels below zero in fp16 and
    # its square root is nan inside the kernel: the status word tells, though saturation
    # keeps the kernel's output finite
    assert result.first_overflow["op_name"] == "norm/Add_1"
    assert result.origin["op_name"] == "norm/Add_1"
    assert result.origin["pass_name"] == "LayerNormFusionPass"
    assert result.origin_replay == "local"
    advice = " ".join(result.advice)
    assert "LayerNormFusionPass" in advice and "norm/Add_1" in advice
    assert json.loads(json.dumps(result.to_dict()))["origin"]["op_type"] == "LayerNorm"
    quick = auto_check(ws)                       # without -c: fusion and overflow only
    assert quick.origin is None and "add -c" in " ".join(quick.advice)


def test_unnormalised_transformer_story(tmp_path):
    """Raw pixels (0..16) under mixed precision: attention scores reach ~70, the fused fp16
    softmax (no max subtraction) overflows; saturation hides it in the values. The analysis
    finds the first overflow, the origin, its pass, and bisection confirms the pass."""
    from precision_tool.analysis import auto_check
    d = pt.data.digits(scale=1.0)
    m = pt.models.transformer()
    root = str(tmp_path)
    npu = pt.Session(m.graph, target="npu", config=hooks.session_dump_config(
        pt.SessionConfig(precision_mode="allow_mix_precision"), action="dump", data_dir=root))
    cpu = hooks.sess_dump(pt.Session(m.graph), action="dump", data_dir=root)
    feed = {m.x: d.x_train[:32], m.y: d.y_train[:32]}
    loss_npu, _ = npu.run([m.loss, m.train_op], feed)
    loss_cpu, _ = cpu.run([m.loss, m.train_op], feed)
    assert np.isfinite(loss_npu) and npu.float_status() == 0x20   # only the status tells
    ws = Workspace(root)
    result = auto_check(ws, compare=True)
    softmax = "encoder/layer_0/attention/Softmax"
    assert result.first_overflow["op_name"] == softmax
    assert result.origin["op_name"] == softmax and result.origin["pass_name"] == "SoftmaxFusionPass"
    verdict = bisect_fusion(ws, ws.run("npu"), ws.run("cpu"), 0)
    assert verdict.culprits == ["SoftmaxFusionPass"]
    assert verdict.replays <= 2 + 2 * int(np.ceil(np.log2(len(verdict.fired))))


def test_unnormalised_transformer_with_embedding_norm_blames_the_fused_layer_norm(tmp_path):
    """BERT-style embeddings LayerNorm fed unnormalised pixels (x32) under force_fp16: the
    fused kernel's one-pass variance squares x itself (E[x^2] - E[x]^2) and saturates fp16;
    the two-pass unfused graph squares x - mean and stays close to the golden. The fused LayerNorm is the first overflow and the origin, its
    single-op replay shows local error, and bisection names LayerNormFusionPass."""
    from precision_tool.analysis import auto_check
    d = pt.data.digits(scale=32.0)
    m = pt.models.transformer(embedding_norm=True)
    root = str(tmp_path)
    npu = pt.Session(m.graph, target="npu", config=hooks.session_dump_config(
        pt.SessionConfig(precision_mode="force_fp16"), action="dump", data_dir=root))
    cpu = hooks.sess_dump(pt.Session(m.graph), action="dump", data_dir=root)
    feed = {m.x: d.x_train[:32], m.y: d.y_train[:32]}
    npu.run([m.loss, m.train_op], feed)
    cpu.run([m.loss, m.train_op], feed)
    ws = Workspace(root)
    result = auto_check(ws, compare=True)
    assert result.first_overflow["op_name"] == "embedding_norm/Add_1"
    assert result.origin["op_name"] == "embedding_norm/Add_1"
    assert result.origin["pass_name"] == "LayerNormFusionPass" and result.origin_replay == "local"
    # the attention key-bias gradient (zero in exact arithmetic) is noise, not a lead
    assert "gradients/encoder/layer_0/attention/key/BiasAdd_grad/BiasAddGrad" in result.cancellations
    verdict = bisect_fusion(ws, ws.run("npu"), ws.run("cpu"), 0)
    assert verdict.fusion_to_blame and verdict.culprits == ["LayerNormFusionPass"]
    assert "embedding_norm/Add_1" in verdict.fused_nodes["LayerNormFusionPass"]
    assert verdict.replays <= int(np.ceil(np.log2(len(verdict.fired)))) + 2


def test_a_fused_overflow_is_the_unfused_one_when_the_kernel_absorbed_its_op(tmp_path):
    """Digits x400 into a LayerNorm under force_fp16: the fused kernel's one-pass variance
    squares x itself (to 160000) and the unfused graph's Square squares x - mean (beyond
    65504 too): both runs overflow, in ops the fused kernel stands for. The fused kernel's
    overflow is then no failure 'only with fusion' (like with like); what is only with
    fusion is the divergence it makes, and bisection still names the pass for that."""
    from precision_tool.analysis import overflow_report
    from scenarios import layer_norm_step
    d = pt.data.digits()
    root = str(tmp_path)
    layer_norm_step(root, d.x_train[:32] * 400.0, d.y_train[:32], "force_fp16")
    ws = Workspace(root)
    verdict = bisect_fusion(ws, ws.run("npu"), ws.run("cpu"), 0)
    unfused = Workspace(root).run("npu", verdict.runs[0])        # every pass off
    assert [t.op_name for t in overflow_report(ws, unfused, 0).tasks] == ["norm/Square"]
    assert verdict.fusion_to_blame and verdict.culprits == ["LayerNormFusionPass"]
    assert verdict.new_failures and not any(f.startswith("overflow in") for f in verdict.new_failures)
