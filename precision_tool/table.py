"""CSV files read as named numpy columns: a dump's index and a compare's result, read and
written without pandas (a DataFrame is a view made on demand: Table.to_frame).

The definition is the csv module (strict quoting, as the excel dialect writes it) and the
number grammar below; the C module reads the same bytes to the same columns and the same
errors, about ten times as fast (tests/test_table.py checks the two on hostile input). A
command that only summarises a result needs no pandas: a `Table` is what it reads.

The rules, both ways:
- the first non-blank line is the header; a column named twice is an error; blank lines
  are skipped; every other line has as many fields as the header;
- a field may be quoted, a quote within it doubled; a quoted field may hold commas and
  line breaks; after a closing quote comes a comma or the line's end, and a quote must close;
- the lines end in \\n, \\r\\n or \\r; a UTF-8 byte-order mark is skipped;
- a number column ('f') holds float64: an empty field is nan; otherwise a decimal number
  ([+-]digits[.digits][e[+-]digits], or .digits...), nan, inf or infinity (any case,
  signed); anything else is an error;
- a text column ('t') holds str: it must be UTF-8 (the columns not asked for are not read).
"""
from __future__ import annotations

import csv
import io
import re
from typing import Dict, Mapping, Optional

import numpy as np

from .kernels import csv_columns

NUMBER = re.compile(r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
                    r"|(?i:nan|inf|infinity))")


class TableError(ValueError):
    """A CSV file that is not a table of the columns asked for; the message says where
    (`line`: the line of the file it names, when it names one; `detail`: the rest)."""

    @property
    def line(self) -> Optional[int]:
        m = re.match(r"line (\d+)", str(self))
        return int(m.group(1)) if m else None

    @property
    def detail(self) -> str:
        """What is wrong, without the line it is on ("column max: not a number")."""
        return re.sub(r"^line \d+(, |: )", "", str(self))


class Table:
    """Rows of named columns, each a 1-D numpy array (float64 or int64, or object holding
    str). What the analysis reads, as it reads a pandas DataFrame: `name in table`,
    `table[name]` and `len(table)` (the rows); `attrs` holds what it was made from, as a
    DataFrame's does."""

    def __init__(self, columns: Mapping[str, np.ndarray], rows: Optional[int] = None,
                 attrs: Optional[dict] = None):
        self._columns = dict(columns)
        lengths = {len(v) for v in self._columns.values()}
        if rows is None:
            rows = lengths.pop() if lengths else 0
        if lengths - {rows}:
            raise ValueError(f"columns of unequal lengths {sorted(lengths)}")
        self._rows = rows
        self.attrs = dict(attrs or {})

    @classmethod
    def from_rows(cls, rows: list, columns) -> "Table":
        """Rows (dicts) as columns, as pandas.DataFrame(rows, columns=columns) makes them: a
        key a row lacks is nan; a column of ints is int64, of numbers float64 (nan where
        missing), anything else object."""
        return cls({name: _inferred([r.get(name, _NAN) for r in rows]) for name in columns},
                   len(rows))

    def __len__(self) -> int:
        return self._rows

    def __contains__(self, name) -> bool:
        return name in self._columns

    def __getitem__(self, name: str) -> np.ndarray:
        return self._columns[name]

    @property
    def columns(self) -> list:
        return list(self._columns)

    def with_column(self, name: str, values) -> "Table":
        """A table with this column added or replaced."""
        return Table({**self._columns, name: np.asarray(values)}, self._rows, self.attrs)

    def take(self, rows) -> "Table":
        """The rows at these positions, in this order."""
        rows = np.asarray(rows, dtype=np.int64)
        return Table({k: v[rows] for k, v in self._columns.items()}, len(rows), self.attrs)

    def records(self) -> list:
        """The rows as dicts of Python values."""
        names = list(self._columns)
        return [dict(zip(names, values))
                for values in zip(*(self._columns[k].tolist() for k in names))] \
            if names else [{} for _ in range(self._rows)]

    def to_frame(self):
        """The same rows as a pandas DataFrame of its own (attrs included): a change to it
        leaves the table alone (pandas may keep an object array it is given as it is)."""
        import pandas as pd
        frame = pd.DataFrame({k: v.copy() for k, v in self._columns.items()},
                             index=pd.RangeIndex(self._rows))
        frame.attrs.update(self.attrs)
        return frame

    def to_csv(self) -> str:
        """The table as CSV text, as DataFrame.to_csv(index=False) writes it (numbers as
        their shortest round-trip text, nan and None as empty fields, \\n after each row),
        but for a field holding a carriage return: quoted here, as read_csv needs it."""
        lines = [",".join(csv_field(str(name)) for name in self._columns)]
        lines += [",".join(row) for row in zip(*(_csv_values(v) for v in self._columns.values()))]
        return "\n".join(lines) + "\n"


_NAN = float("nan")


def _inferred(values: list) -> np.ndarray:
    kinds = {type(v) for v in values}
    if kinds and kinds <= {int, np.int64}:
        return np.array(values, dtype=np.int64)
    if kinds and kinds <= {int, float, np.int64, np.float64}:
        return np.array(values, dtype=np.float64)
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _csv_values(a: np.ndarray) -> list:
    if a.dtype.kind == "f":
        return ["" if v != v else repr(v) for v in a.tolist()]
    if a.dtype.kind in "iub":
        return [str(v) for v in a.tolist()]
    return ["" if v is None or (isinstance(v, float) and v != v) else csv_field(str(v))
            for v in a.tolist()]




def column(table, name: str, default) -> np.ndarray:
    """A column of a Table or a pandas DataFrame as a numpy array; `default` in every row
    where the table has no such column."""
    if name in table:
        return np.asarray(table[name])
    return np.full(len(table), default, dtype=object if isinstance(default, str) else float)


def numbers(table, name: str) -> np.ndarray:
    """A column as float64: nan where the table has no such column, and where a value is
    not a number (a hand-made table's None or text)."""
    a = column(table, name, np.nan)
    try:
        return a.astype(np.float64)
    except (TypeError, ValueError):
        return np.array([_number(v) for v in a.tolist()], dtype=np.float64)


def _number(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def texts(table, name: str) -> np.ndarray:
    """A column as an object array of str: "" where the table has no such column, where a
    value is missing (None, nan: a DataFrame's empty cell) and where it holds no text at all
    (read as numbers: all empty)."""
    a = column(table, name, "")
    if a.dtype.kind in "fiub":
        return np.full(len(a), "", dtype=object)
    out = np.empty(len(a), dtype=object)
    out[:] = [v if type(v) is str else "" if v is None or v != v else str(v) for v in a.tolist()]
    return out


def factorize(values) -> tuple:
    """(codes, uniques): each value's position among the distinct values, in the order they
    first appear (pandas.factorize's answer; nan is a value like any other)."""
    seen: Dict = {}
    nan_code = None
    codes = []
    for v in values:
        if v != v:                   # nan != nan: one code for all of them
            if nan_code is None:
                nan_code = seen[v] = len(seen)
            codes.append(nan_code)
        else:
            codes.append(seen.setdefault(v, len(seen)))
    uniques = np.empty(len(seen), dtype=object)
    uniques[:] = list(seen)
    return np.array(codes, dtype=np.int64), uniques


def csv_field(text: str) -> str:
    """One field as the csv module writes it (the excel dialect, minimal quoting): quoted
    when it holds a comma, a quote or a line break (\\r included), its quotes doubled."""
    if "," in text or '"' in text or "\n" in text or "\r" in text:
        return '"' + text.replace('"', '""') + '"'
    return text


def read_csv(data: bytes, kinds: Mapping[str, str], rest: Optional[str] = None) -> Table:
    """The columns named in `kinds` ('f': numbers, 't': text) that the file has, and with
    `rest` every other column as that kind, as a Table (a column asked for and absent is
    not in it). TableError says what is wrong and where."""
    for name, kind in [*kinds.items(), *([("rest", rest)] if rest is not None else [])]:
        if kind not in ("f", "t"):
            raise ValueError(f"column {name!r}: kind {kind!r} is not 'f' or 't'")
    try:
        parsed = csv_columns(data, kinds, rest)
    except ValueError as e:
        raise TableError(str(e)) from None
    if parsed is None:          # no C module: the definition itself
        return _read_csv(data, kinds, rest)
    header, found, rows = parsed
    return Table({name: _array(found[name], kinds.get(name, rest)) for name in header
                  if name in found}, rows)


def _array(values, kind: str) -> np.ndarray:
    if kind == "f":
        return np.frombuffer(values, dtype=np.float64)
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _read_csv(data: bytes, kinds: Mapping[str, str], rest: Optional[str] = None) -> Table:
    """The definition: the csv module, strict, over the text decoded with surrogateescape
    (so that bytes that are not UTF-8 are an error only where a text column reads them)."""
    text = bytes(data).decode("utf-8", "surrogateescape").removeprefix("\ufeff")
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    header, line = None, 1
    try:
        for record in reader:
            if record:
                header = record
                break
            line = reader.line_num + 1
    except csv.Error as e:
        raise TableError(_csv_error(line, e)) from None
    if header is None:
        raise TableError("no header line")
    for name in header:
        _utf8(name, "the header is not UTF-8")
    seen = set()
    for name in header:
        if name in seen:
            raise TableError(f"the header names {name!r} twice")
        seen.add(name)
    wanted = [(i, name, kinds.get(name, rest)) for i, name in enumerate(header)
              if name in kinds or rest is not None]
    values: Dict[str, list] = {name: [] for _, name, _ in wanted}
    line, rows = reader.line_num + 1, 0
    try:
        for record in reader:
            if record:
                rows += 1
                if len(record) != len(header):
                    raise TableError(f"line {line}: {len(record)} field(s), the header has "
                                     f"{len(header)}")
                for i, name, kind in wanted:
                    values[name].append(_value(record[i], kind, line, name))
            line = reader.line_num + 1
    except csv.Error as e:
        raise TableError(_csv_error(line, e)) from None
    return Table({name: (np.array(v, dtype=np.float64) if kind == "f" else _array(v, "t"))
                  for (_, name, kind), v in zip(wanted, values.values())}, rows)


def _value(field: str, kind: str, line: int, name: str):
    if kind == "t":
        return _utf8(field, f"line {line}, column {name}: not UTF-8 text")
    if not field:
        return float("nan")
    if NUMBER.fullmatch(field) is None:
        raise TableError(f"line {line}, column {name}: not a number")
    return float(field)


def _utf8(value: str, message: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise TableError(message) from None
    return value


def _csv_error(line: int, e: csv.Error) -> str:
    if "expected after" in str(e):
        return f"line {line}: a closing quote is followed by more text"
    if "unexpected end of data" in str(e):
        return f"line {line}: a quoted field is not closed"
    return f"line {line}: {e}"
