"""A CSV file's columns parsed by the C module, where it is built: table.read_csv defines
what is read (the csv module and its number grammar) and reads the same bytes in Python
otherwise."""
from __future__ import annotations

from typing import Mapping, Optional

from . import native


def csv_columns(data: bytes, kinds: Mapping[str, str], rest: Optional[str] = None):
    """(header, {name: bytearray of float64 or list of str}, rows) of the columns `kinds`
    asks for ('f' numbers, 't' text; `rest` for the others), or None where the C module is
    not built or not wanted (the caller reads in Python). ValueError says what is wrong and
    where."""
    if not native.enabled():
        return None
    return native.read_csv(data, dict(kinds), rest)
