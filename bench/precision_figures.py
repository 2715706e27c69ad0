"""The simulated NPU's precision effects, measured: `python bench/precision_figures.py`.

- the share of a trained MLP's gradient elements that force_fp16 flushes to zero where the
  golden run has them non-zero, without and with a fixed loss scale of 2^12;
- the fused LayerNorm's error against golden on fp16 input with mean 100 and std 1, fused
  and unfused (allow_mix_precision);
- the fused softmax on logits 11 and 12 in fp16: status words;
- the loss curves of 50 Transformer steps, allow_mix_precision with fusion against golden.
"""
import sys

import numpy as np

import precision_tool as pt
from precision_tool.analysis import compare_tensors

F16, F32 = np.float16, np.float32


def npu(graph, **kw):
    return pt.Session(graph, target="npu", config=pt.SessionConfig(**kw))


def flushed_gradients(state, digits, scale=None):
    opt = pt.train.SGD(0.1)
    if scale is not None:
        opt = pt.train.LossScaleOptimizer(opt, pt.train.FixedLossScaleManager(scale))
    m = pt.models.mlp(optimizer=opt)
    names = [f"{n.name}:0" for n in m.graph.nodes if n.name.startswith("gradients/")
             and n.outputs and n.outputs[0].dtype == "float32"]
    feed = {m.x: digits.x_train[:64], m.y: digits.y_train[:64]}
    grads = []
    for sess in (pt.Session(m.graph), npu(m.graph, precision_mode="force_fp16")):
        sess.load_variables(state)
        grads.append(np.concatenate([g.ravel() for g in sess.run(names, feed)]))
    golden, device = grads
    return compare_tensors(device, golden)["FlushedToZeroRatio"], int((golden != 0).sum())


def main():
    digits = pt.data.digits()
    trained = pt.models.mlp()
    sess = pt.Session(trained.graph)
    pt.models.fit(sess, trained, digits, epochs=5, batch_size=32)
    state = {k: v for k, v in sess.variables().items() if "Adam" not in k}
    for scale in (None, 2.0 ** 12):
        share, live = flushed_gradients(state, digits, scale)
        print(f"force_fp16 MLP gradients flushed to zero (of {live} non-zero golden elements), "
              f"loss scale {scale or 1:g}: {share:.4%}")

    g = pt.Graph("ln")
    with g.as_default():
        x = pt.placeholder("x", [None, 64], "float16")
        y = pt.nn.layer_norm(pt.ops.mul(x, 1.0))
    xv = (100.0 + np.random.default_rng(5).normal(size=(32, 64))).astype(F16)
    golden = pt.Session(g).run(y, {x: xv})
    for label, kw in (("fused", {}), ("unfused", {"fusion_switch": "off"})):
        out = npu(g, precision_mode="allow_mix_precision", **kw).run(y, {x: xv})
        print(f"LayerNorm on fp16 input, mean 100 std 1, {label:8}: max |npu - golden| = "
              f"{np.abs(out - golden).max():.6g}")

    g = pt.Graph("sm")
    with g.as_default():
        x = pt.placeholder("x", [1, 4], "float16")
        y = pt.ops.softmax(pt.ops.mul(x, 1.0))
    for mode in ("saturation", "inf_nan"):
        s = npu(g, precision_mode="allow_mix_precision", overflow_mode=mode)
        for logit in (11.0, 11.09, 12.0):
            out = s.run(y, {x: np.array([[logit, 0, 0, 0]], F32)})
            print(f"fused softmax fp16 {mode:10} logit {logit:5}: status 0x{s.float_status():x}, "
                  f"p = {out[0].astype(np.float64).round(6).tolist()}")

    m = pt.models.transformer()
    curves = [np.array(pt.models.fit(s, m, digits, epochs=2, batch_size=32, max_steps=50))
              for s in (pt.Session(m.graph), npu(m.graph, precision_mode="allow_mix_precision"))]
    diff = np.abs(curves[0] - curves[1])
    print(f"Transformer, 50 steps, allow_mix_precision + fusion vs golden: |loss diff| first "
          f"{diff[0]:.3g}, mean {diff.mean():.3g}, max {diff.max():.3g}; final loss "
          f"{curves[1][-1]:.6f} vs {curves[0][-1]:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
