"""Regenerate precision_tool/data/digits.npz from scikit-learn's bundled copy of the UCI
hand-written digits (1,797 8x8 images, pixels 0..16). Needs scikit-learn; the package
itself never does: it ships the result. Run: python tools/make_digits_data.py"""
import gzip
import os
import sys

import numpy as np


def main():
    import sklearn
    src = os.path.join(os.path.dirname(sklearn.__file__), "datasets", "data", "digits.csv.gz")
    with gzip.open(src, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    images = table[:, :64].astype(np.uint8)
    labels = table[:, 64].astype(np.uint8)
    assert images.shape == (1797, 64) and images.max() == 16 and set(labels) == set(range(10))
    out = os.path.join(os.path.dirname(__file__), "..", "precision_tool", "data", "digits.npz")
    np.savez_compressed(out, images=images, labels=labels)
    print(f"wrote {os.path.normpath(out)}: {images.shape[0]} images, {os.path.getsize(out)} bytes")


if __name__ == "__main__":
    sys.exit(main())
