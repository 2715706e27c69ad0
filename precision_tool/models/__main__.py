"""Train the reference models on digits and report held-out accuracy:
`python -m precision_tool.models [mlp cnn transformer] [--epochs N] [--target npu ...]`.
With --compare, each model trains on the golden executor and on the target side by side
from the same start, and the loss curves are compared step by step."""
import argparse
import sys
import time

import numpy as np

from .. import data
from ..runtime import Session, SessionConfig
from . import accuracy, cnn, fit, mlp, transformer

BUILDERS = {"mlp": (mlp, 20), "cnn": (cnn, 10), "transformer": (transformer, 20)}


def _config(args, target):
    if target == "cpu":
        return SessionConfig(golden_dtype=args.golden_dtype)
    return SessionConfig(precision_mode=args.precision_mode, amp_level=args.amp_level,
                         overflow_mode=args.overflow_mode,
                         fusion_switch="off" if args.fusion_off else None)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m precision_tool.models", description=__doc__)
    parser.add_argument("models", nargs="*", metavar="MODEL",
                        help=f"models to train: {', '.join(BUILDERS)} (default: all)")
    parser.add_argument("--epochs", type=int, help="epochs (default: 20 / 10 / 20)")
    parser.add_argument("--max-steps", type=int, help="stop after this many steps")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", choices=["cpu", "npu"], default="cpu")
    parser.add_argument("--golden-dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--precision-mode", default="allow_fp32_to_fp16", help="NPU precision mode")
    parser.add_argument("--amp-level", choices=["O0", "O1", "O2", "O3"], help="instead of --precision-mode")
    parser.add_argument("--overflow-mode", choices=["saturation", "inf_nan"], default="saturation")
    parser.add_argument("--fusion-off", action="store_true", help="switch every fusion pass off")
    parser.add_argument("--compare", action="store_true",
                        help="also train on the golden executor and compare the loss curves")
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in BUILDERS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; choose from {', '.join(BUILDERS)}")
    digits = data.digits(seed=args.seed)
    print(f"digits: {len(digits.x_train)} training and {len(digits.x_test)} held-out images; "
          f"target {args.target}")
    for name in args.models or list(BUILDERS):
        build, default_epochs = BUILDERS[name]
        model = build(seed=args.seed)
        targets = ["cpu", args.target] if args.compare and args.target != "cpu" else [args.target]
        curves = {}
        for target in targets:
            start = time.perf_counter()
            sess = Session(model.graph, target=target, config=_config(args, target))
            losses = fit(sess, model, digits, epochs=args.epochs or default_epochs,
                         batch_size=args.batch_size, seed=args.seed, max_steps=args.max_steps)
            acc = accuracy(sess, model, digits.x_test, digits.y_test)
            curves[target] = np.array(losses)
            print(f"{name:12} {target:4} steps {len(losses):5}  final loss {losses[-1]:.6f}  "
                  f"held-out accuracy {acc:.4f}  ({time.perf_counter() - start:.1f} s)")
        if len(curves) == 2:
            diff = np.abs(curves["cpu"] - curves[args.target])
            print(f"{name:12} loss |npu - golden|: first step {diff[0]:.3g}, mean {diff.mean():.3g}, "
                  f"max {diff.max():.3g} (step {int(diff.argmax())}), last {diff[-1]:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
