"""table: CSV files as named columns. The definition (the csv module, strict) is
checked against hand-worked cases and Python's float(); the C reader against the
definition on random hostile bytes, value for value and error for error."""
import re
from decimal import Decimal

import numpy as np
import pytest

from precision_tool.kernels import native
from precision_tool import table
from precision_tool.table import Table, TableError

needs_c = pytest.mark.skipif(native._reduce is None, reason="the C module is not built")


def both(monkeypatch, data: bytes, kinds: dict, rest=None):
    """(definition's result or error text, C's result or error text)."""
    def run(numpy_only):
        if numpy_only:
            monkeypatch.setenv("PRECISION_TOOL_NUMPY_ONLY", "1")
        else:
            monkeypatch.delenv("PRECISION_TOOL_NUMPY_ONLY", raising=False)
        try:
            return table.read_csv(data, kinds, rest)
        except TableError as e:
            return str(e)
    return run(True), run(False)


def same(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    if a.columns != b.columns or len(a) != len(b):
        return False
    for name in a.columns:
        x, y = a[name], b[name]
        if x.dtype != y.dtype:
            return False
        if x.dtype == object:
            if list(x) != list(y):
                return False
        elif not (np.array_equal(x, y, equal_nan=True) and
                  np.array_equal(np.signbit(x), np.signbit(y))):
            return False
    return True


def definition(data: bytes, kinds: dict):
    try:
        return table._read_csv(data, kinds)
    except TableError as e:
        return str(e)


# -- the definition ------------------------------------------------------------------------
def test_quoted_fields_blank_lines_and_line_ends():
    data = ('\ufeffname,value\r\n\r\n"a, ""b""",1.5\n"two\nlines",-inf\rlast,\n'
            ).encode("utf-8")
    t = definition(data, {"name": "t", "value": "f"})
    assert list(t["name"]) == ['a, "b"', "two\nlines", "last"]
    v = t["value"]
    assert v[0] == 1.5 and v[1] == -np.inf and np.isnan(v[2])
    assert len(t) == 3 and t.columns == ["name", "value"]


def test_the_rest_of_the_columns_take_the_kind_asked_for_them(monkeypatch):
    data = b"a,b,c\n1,x,2\n3,y,nan\n"
    for got in both(monkeypatch, data, {"a": "f"}, rest="t"):
        assert got.columns == ["a", "b", "c"] and got["c"].tolist() == ["2", "nan"]
        assert got["a"].tolist() == [1.0, 3.0]
    for got in both(monkeypatch, data, {"b": "t"}, rest="f"):
        assert got["c"][0] == 2.0 and np.isnan(got["c"][1]) and got["b"].tolist() == ["x", "y"]
    with pytest.raises(ValueError, match="kind 'x'"):
        table.read_csv(data, {}, rest="x")


def test_columns_not_asked_for_are_not_read_and_absent_ones_are_not_there():
    t = definition(b"a,b,c\n1,\xff\xfe,3\n", {"a": "f", "c": "t", "zzz": "f"})
    assert t.columns == ["a", "c"] and list(t["c"]) == ["3"] and "zzz" not in t


def test_a_table_without_the_columns_asked_still_counts_its_rows():
    assert len(definition(b"a\n1\n2\n\n3\n", {})) == 3


@pytest.mark.parametrize("data,error", [
    (b"", "no header line"),
    (b"\n\r\n", "no header line"),
    (b"a,a\n1,2\n", "the header names 'a' twice"),
    (b"a,b\n1,2\n3\n", "line 3: 1 field(s), the header has 2"),
    (b"a,b\n1,2,3\n", "line 2: 3 field(s), the header has 2"),
    (b'a,b\n"1,2\n', "line 2: a quoted field is not closed"),
    (b'a,b\n"1"x,2\n', "line 2: a closing quote is followed by more text"),
    (b'a,b\n1,"2"\n\n1,nope\n', "line 4, column b: not a number"),
    (b"a,b\n1,2\n3, 4\n", "line 3, column b: not a number"),
    (b"a,b\n1,1_000\n", "line 2, column b: not a number"),
    (b"a,b\n1,0x10\n", "line 2, column b: not a number"),
    (b"a,b\n1,\xff\n", "line 2, column b: not UTF-8 text"),
    (b"a,\xff\n1,2\n", "the header is not UTF-8"),
])
def test_what_is_not_a_table_is_an_error_that_says_where(data, error):
    kinds = {"a": "f", "b": "t" if error.endswith("UTF-8 text") else "f"}
    assert definition(data, kinds) == error


def test_the_number_grammar():
    good = ["0", "-0", "+1", "1.", ".5", "1e5", "1E-5", "-.5e+3", "nan", "NaN", "-inf",
            "Infinity", "+INF", "00012.50"]
    bad = ["", " 1", "1 ", "1e", "e5", ".", "-", "1.2.3", "1e5.0", "infinit", "nan1", "٣",
           "0x1p3", "1_0", "+-1"]
    for text in good:
        assert table.NUMBER.fullmatch(text), text
    for text in bad:
        assert not table.NUMBER.fullmatch(text), text


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="kind"):
        table.read_csv(b"a\n1\n", {"a": "x"})


def test_a_table_of_unequal_columns_is_refused():
    with pytest.raises(ValueError, match="unequal"):
        Table({"a": np.zeros(2), "b": np.zeros(3)})


# -- C against the definition --------------------------------------------------------------
@needs_c
def test_c_reads_what_the_definition_reads_on_random_hostile_bytes(monkeypatch):
    rng = np.random.default_rng(7)
    pieces = [b"a", b"1", b"2.5", b"-", b"e", b".", b",", b'"', b'""', b"\n", b"\r", b"\r\n",
              b"nan", b"inf", b"\xc3\xa9", b"\xff", b" ", b"\x00", b"x,y"]
    kinds_list = [{"x": "f", "y": "t"}, {"x": "t", "y": "f"}, {"x": "f"}, {}]
    disagree = []
    for case in range(3000):
        header = [b"x,y", b'"x",y', b"y,x,z", b"x"][case % 4]
        body = b"".join(pieces[i] for i in rng.integers(0, len(pieces), rng.integers(0, 30)))
        data = header + b"\n" + body
        kinds = kinds_list[case % len(kinds_list)]
        rest = [None, "t", "f"][case % 3]          # the columns kinds does not name
        got = both(monkeypatch, data, kinds, rest)
        if not same(*got):
            disagree.append((data, kinds, rest, got))
    assert not disagree, disagree[:3]


@needs_c
def test_c_parses_numbers_exactly_as_float_does(monkeypatch):
    rng = np.random.default_rng(3)
    values = rng.standard_normal(20000) * 10.0 ** rng.integers(-320, 300, 20000)
    texts = [repr(float(v)) for v in values]
    texts += [f"{v:.19e}" for v in values[:5000]] + [f"{v:.25f}" for v in values[:2000]]
    # doubles' midpoints written out, the cases a fast path gets wrong
    for v in rng.random(3000) * 10.0 ** rng.integers(-8, 8, 3000):
        mid = (Decimal(float(v)) + Decimal(float(np.nextafter(v, np.inf)))) / 2
        texts += [f"{mid:.{d}e}" for d in (16, 17, 18, 19, 25)]
    texts += ["4.9e-324", "2.4703282292062328e-324", "1.7976931348623157e308", "1e309",
              "-0.0", "0e999", "123456789012345678901234567890", ".000000000000000000000001"]
    data = ("x\n" + "\n".join(texts) + "\n").encode()
    monkeypatch.delenv("PRECISION_TOOL_NUMPY_ONLY", raising=False)
    got = table.read_csv(data, {"x": "f"})["x"]
    want = np.array([float(t) for t in texts])
    wrong = np.flatnonzero(~((got == want) | (np.isnan(got) & np.isnan(want)))
                           | (np.signbit(got) != np.signbit(want)))
    assert not len(wrong), [texts[i] for i in wrong[:5]]


@needs_c
def test_c_reads_a_compare_result_as_the_definition_does(monkeypatch, tmp_path):
    lines = ["Index,OpType,NPUDump,CosineSimilarity,Verdict"]
    for i in range(3000):
        lines.append(f'{i},MatMul,"enc/layer_{i % 7}/mm, ""q""",{1 - i * 1e-7!r},'
                     f'{"pass" if i % 3 else "fail"}')
    data = ("\n".join(lines) + "\n").encode()
    kinds = {"Index": "f", "OpType": "t", "NPUDump": "t", "CosineSimilarity": "f", "Verdict": "t"}
    a, b = both(monkeypatch, data, kinds)
    assert same(a, b) and len(a) == 3000
    assert a["NPUDump"][8] == 'enc/layer_1/mm, "q"'


# -- a compare result read through it -----------------------------------------------------
RESULT = ("Index,OpType,NPUDump,TensorIndex,CosineSimilarity,Verdict\n"
          "0,MatMul,mm,mm:output:0,0.5,fail\n"
          '1,Softmax,"a,b",a:output:0,,pass\n')


@pytest.mark.parametrize("text,error", [
    (RESULT, None),
    (RESULT.replace("0.5", "0.5x"), "line 2, column CosineSimilarity: not a number"),
    (RESULT.replace("\n1,", "\n1.5,"), "an Index that is not a whole number"),
    (RESULT.replace(",fail\n", ",fail,extra\n"), "line 2: 7 field(s), the header has 6"),
    (RESULT.replace("Verdict", "Verdikt"), "no Verdict column"),
])
def test_read_result_reads_a_table_or_says_what_is_wrong(tmp_path, text, error):
    from precision_tool.analysis import read_result
    from precision_tool.dump import WorkspaceError
    path = tmp_path / "result.csv"
    path.write_text(text)
    if error is None:
        t = read_result(str(path))
        assert t["Index"].dtype == np.int64 and list(t["NPUDump"]) == ["mm", "a,b"]
        assert t["CosineSimilarity"][0] == 0.5 and np.isnan(t["CosineSimilarity"][1])
        return
    with pytest.raises(WorkspaceError, match=re.escape(error)):
        read_result(str(path))


def test_an_origin_with_an_input_not_compared_says_so():
    """The root cause names an op whose compared inputs match and whose outputs do not; an
    input that could not be compared (its file missing) is named with it, since the
    divergence may come in through it, and the summary says why that input has no cosine."""
    from precision_tool.analysis import root_cause, summarize

    def col(*v):
        out = np.empty(len(v), dtype=object)
        out[:] = v
        return out
    reason = "unreadable: tensor file x.npy is missing"
    t = Table({"Index": np.arange(4), "OpType": col("Exp", "Exp", "Sum", "Sum"),
               "NPUDump": col("e", "e", "s", "s"),
               "TensorIndex": col("e:input:0", "e:output:0", "s:input:0", "s:output:0"),
               "CosineSimilarity": np.array([1.0, np.nan, np.nan, 0.5]),
               "CompareFailReason": col("", reason, reason, ""),
               "Verdict": col("pass", "error", "error", "fail")})
    origin = root_cause(t).first_origin
    assert origin.op_name == "s" and origin.unseen_inputs == ["s:input:0"]
    (op,) = summarize(t)
    assert op.input_notes == [reason] and op.output_notes == [""]


def test_rows_become_columns_and_csv_as_pandas_makes_them():
    """Table.from_rows infers each column's kind as pandas.DataFrame(rows) does, and
    to_csv writes the bytes DataFrame.to_csv(index=False) writes, on awkward values:
    nan, infinities, -0.0, huge and tiny numbers, None, quotes, commas, line breaks,
    unicode, a key some rows lack; read back, every value is what was written."""
    pd = pytest.importorskip("pandas")
    rows = [{"i": 1, "f": 0.1 + 0.2, "s": 'a,"b"', "m": 1, "u": "名前\n2"},
            {"i": -7, "f": float("nan"), "s": None, "m": 2.5, "u": "x"},
            {"i": 2**53, "f": -0.0, "s": "", "u": "😀"},
            {"i": 0, "f": float("-inf"), "s": "plain", "m": 1e-300, "u": "\r"},
            {"i": 3, "f": 1e16, "s": "nan", "m": float("inf"), "u": ""}]
    columns = ["i", "f", "s", "m", "u", "absent"]
    t = Table.from_rows(rows, columns)
    frame = pd.DataFrame(rows, columns=columns)
    assert {k: t[k].dtype.kind for k in columns} == \
        {"i": "i", "f": "f", "s": "O", "m": "f", "u": "O", "absent": "f"}
    text = t.to_csv()
    assert text.replace('"\r"', "\r") == frame.to_csv(index=False)    # pandas leaves \r bare
    back = table.read_csv(text.encode(), {"i": "f", "f": "f", "m": "f", "s": "t", "u": "t"})
    np.testing.assert_array_equal(back["i"], t["i"].astype(float))
    np.testing.assert_array_equal(back["f"], t["f"])
    assert np.signbit(back["f"][2]) and back["s"].tolist() == ['a,"b"', "", "", "plain", "nan"]
    assert back["u"].tolist() == [r["u"] for r in rows]
    assert t.take([3, 0]).records()[1]["s"] == 'a,"b"' and t.take([]).records() == []
    f = t.to_frame()
    f.loc[0, "s"] = "changed"
    assert t["s"][0] == 'a,"b"'


def test_a_field_is_quoted_as_the_csv_module_quotes_it():
    import csv
    import io
    rng = np.random.default_rng(5)
    alphabet = list('ab ,"\r\n\t;\'名😀') + [""]
    for _ in range(2000):
        text = "".join(rng.choice(alphabet, size=int(rng.integers(0, 8))))
        out = io.StringIO()
        csv.writer(out).writerow([text, "x"])         # two fields: a lone "" is quoted alone
        assert table.csv_field(text) + ",x\r\n" == out.getvalue(), repr(text)
