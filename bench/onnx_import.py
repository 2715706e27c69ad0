"""An imported model's golden step against ONNX Runtime's CPU time, side by side.

`python bench/onnx_import.py [--runs N]`: torchvision's ResNet-18 (random weights, batch 1,
224x224), exported with torch's exporter, imported by precision_tool.onnx, one inference step
on the golden executor (fp32) and on ONNX Runtime's CPU provider (its default graph
optimisations, its default threads, its thread pool not spinning between runs), interleaved,
the median of each. Needs the onnx-export
extra and onnxruntime; `bench/run.py` reports the row as skipped without them.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def missing():
    """The packages this bench needs that are not installed."""
    import importlib.util
    return [p for p in ("onnx", "onnxruntime", "torch", "torchvision", "onnxscript")
            if importlib.util.find_spec(p) is None]


def resnet18_golden_vs_ort(runs=20):
    """(golden ÷ ORT median step time, golden ms, ORT ms), or None when packages are missing."""
    if missing():
        return None
    import numpy as np
    import onnxruntime as ort

    import onnx_models
    import precision_tool as pt
    from precision_tool.onnx import load
    with tempfile.TemporaryDirectory() as tmp:
        path = onnx_models.export_resnet18(os.path.join(tmp, "resnet18.onnx"))
        imported = load(path, batch=1)
        options = ort.SessionOptions()
        # ORT's pool spins after each run by default, which would take the cores from the
        # golden step measured next; off, each side has the machine to itself in turn
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        ort_sess = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    golden = pt.Session(imported.graph)
    imported.load_weights(golden)
    (name, tensor), = imported.inputs.items()
    x = np.random.default_rng(0).normal(size=tensor.shape).astype(np.float32)
    fetches = list(imported.outputs.values())

    def ours():
        golden.run(fetches, {tensor: x})

    def theirs():
        ort_sess.run(None, {name: x})
    times = {ours: [], theirs: []}
    for fn in (ours, theirs):                   # warm both: first runs allocate
        fn()
    for _ in range(runs):
        for fn in (ours, theirs):
            start = time.perf_counter()
            fn()
            times[fn].append(time.perf_counter() - start)
    a, b = statistics.median(times[ours]), statistics.median(times[theirs])
    return a / b, a * 1e3, b * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    result = resnet18_golden_vs_ort(args.runs)
    if result is None:
        print(f"skipped: needs {', '.join(missing())}")
        return 0
    ratio, ours, theirs = result
    print(f"ResNet-18 (imported ONNX), batch 1: golden {ours:.1f} ms, ONNX Runtime {theirs:.1f} ms, "
          f"golden ÷ ORT {ratio:.2f} (target ≤ 2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
