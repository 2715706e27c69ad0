"""Train the reference models on digits with the CPU golden executor and report held-out
accuracy: `python -m precision_tool.models [mlp cnn transformer] [--epochs N]`."""
import argparse
import sys
import time

from .. import Session, SessionConfig, data
from . import accuracy, cnn, fit, mlp, transformer

BUILDERS = {"mlp": (mlp, 20), "cnn": (cnn, 10), "transformer": (transformer, 20)}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m precision_tool.models", description=__doc__)
    parser.add_argument("models", nargs="*", metavar="MODEL",
                        help=f"models to train: {', '.join(BUILDERS)} (default: all)")
    parser.add_argument("--epochs", type=int, help="epochs (default: 20 / 10 / 20)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--golden-dtype", choices=["float32", "float64"], default="float32")
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in BUILDERS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; choose from {', '.join(BUILDERS)}")
    digits = data.digits(seed=args.seed)
    print(f"digits: {len(digits.x_train)} training and {len(digits.x_test)} held-out images")
    for name in args.models or list(BUILDERS):
        build, default_epochs = BUILDERS[name]
        start = time.perf_counter()
        model = build(seed=args.seed)
        sess = Session(model.graph, config=SessionConfig(golden_dtype=args.golden_dtype))
        losses = fit(sess, model, digits, epochs=args.epochs or default_epochs,
                     batch_size=args.batch_size, seed=args.seed)
        acc = accuracy(sess, model, digits.x_test, digits.y_test)
        print(f"{name:12} steps {len(losses):5}  final loss {losses[-1]:.6f}  "
              f"held-out accuracy {acc:.4f}  ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
