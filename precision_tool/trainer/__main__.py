"""`python -m precision_tool.trainer [--epochs N]`: the CNN on the digits through Model.train
at each AMP level, on the golden executor and the simulated NPU from the same start, with the
final training loss and the held-out loss and accuracy of each."""
import argparse
import sys
import time

from .. import data, models, nn, train
from . import Callback, Model, NumpySlicesDataset, OverflowMonitor


class _LastLoss(Callback):
    value = float("nan")

    def step_end(self, run_context):
        self.value = run_context.original_args().net_outputs


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m precision_tool.trainer", description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--levels", default="O0,O1,O2,O3")
    args = parser.parse_args(argv)
    digits = data.digits()
    train_ds = NumpySlicesDataset((digits.x_train, digits.y_train)).shuffle(0).batch(
        32, drop_remainder=True)
    test_ds = NumpySlicesDataset((digits.x_test, digits.y_test)).batch(256)
    print(f"CNN, Momentum(0.05, 0.9), batch 32, {args.epochs} epochs, sink mode (one sink per "
          f"epoch); O2 with the default dynamic loss scale (2**24)")
    print(f"{'level':5} {'target':6} {'train loss':>12} {'test loss':>10} {'accuracy':>9} "
          f"{'overflowed steps':>17} {'final scale':>12} {'time':>6}")
    for level in args.levels.split(","):
        for target in ("cpu", "npu"):
            start = time.perf_counter()
            model = Model(models.cnn_network(), nn.SoftmaxCrossEntropyWithLogits(),
                          train.Momentum(0.05, 0.9), amp_level=level, target=target)
            last, overflow = _LastLoss(), OverflowMonitor(quiet=True)
            model.train(args.epochs, train_ds, callbacks=[last, overflow], dataset_sink_mode=True)
            result = model.eval(test_ds)
            scale = overflow.trajectory[-1][1] if overflow.trajectory else None
            print(f"{level:5} {target:6} {last.value:12.8f} {result['loss']:10.6f} "
                  f"{result['accuracy']:9.4f} {len(overflow.overflowed_steps):17d} "
                  f"{'-' if scale is None else repr(scale):>12} "
                  f"{time.perf_counter() - start:5.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
