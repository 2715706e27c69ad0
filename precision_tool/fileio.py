"""Small file helpers every layer uses: atomic writes and JSON reads with one-line errors."""
from __future__ import annotations

import json
import os
import tempfile


def write_atomic(path: str, write, durable: bool = True) -> None:
    """Call write(binary file) on a temporary file beside `path`, then rename it into place:
    the file appears whole or not at all (durable: fsync'd first, surviving a power cut)."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".part",
                               dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_text_atomic(path: str, text: str, durable: bool = True) -> None:
    write_atomic(path, lambda f: f.write(text.encode("utf-8")), durable)


def load_json(path, error, what: str):
    """The parsed JSON of a file; unreadable or malformed files raise `error` in one line."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{what} {path} is not valid JSON: {e}") from None
    except RecursionError:
        raise error(f"{what} {path} is nested too deeply to be read") from None
