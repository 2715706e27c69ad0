"""Text with holes, for the files a dump writes every step: the index and the file names.

From one dumped step to the next only the timestamps and the tensor values change; the rest
of the index (names, dtypes, shapes, formats) is built once as a Template whose holes are
a timestamp or a tensor's statistics. A frozen template is three flat arrays the C module
fills in one call without the GIL (kernels.write.index_text); fill() is the same in Python, for
where the module is not built, and the tests hold the two to the same bytes.
"""
from __future__ import annotations

from typing import List, Sequence

import numpy as np


class Template:
    """Built piece by piece: text(), then stamp(r) for record r's timestamp, stats(i) for
    the statistics of tensor i, and so on; freeze() when done."""

    def __init__(self):
        self._pieces: List[str] = [""]
        self._refs: List[int] = []

    def text(self, s: str) -> "Template":
        self._pieces[-1] += s
        return self

    def stamp(self, record: int) -> "Template":
        return self._hole(record)

    def stats(self, tensor: int) -> "Template":
        return self._hole(-1 - tensor)     # negative: the C module's convention

    def _hole(self, ref: int) -> "Template":
        self._refs.append(ref)
        self._pieces.append("")
        return self

    def freeze(self) -> "Frozen":
        return Frozen(self._pieces, self._refs)


class Frozen:
    """literal (UTF-8 bytes of every piece), cuts (int64: where each piece starts in it) and
    refs (int64: the hole after each piece but the last), as native.index_text takes them."""

    def __init__(self, pieces: Sequence[str], refs: Sequence[int]):
        encoded = [p.encode("utf-8") for p in pieces]
        self.literal = b"".join(encoded)
        self.cuts = np.zeros(len(encoded), dtype=np.int64)
        np.cumsum([len(e) for e in encoded[:-1]], out=self.cuts[1:])
        self.refs = np.asarray(refs, dtype=np.int64)
        self._pieces = list(pieces)
        self._refs = list(refs)

    def fill(self, stamps: Sequence[int], stats_lines: Sequence[str]) -> bytes:
        """The text with record r's timestamp (decimal) and tensor i's statistics line in
        their holes."""
        out = [self._pieces[0]]
        for ref, piece in zip(self._refs, self._pieces[1:]):
            out.append(str(stamps[ref]) if ref >= 0 else stats_lines[-1 - ref])
            out.append(piece)
        return "".join(out).encode("utf-8")
