"""Exceptions of precision_tool.

Every error a user can cause is one of these, with a one-line message that names the op,
placeholder or file involved and what was expected versus given.
"""


class PrecisionToolError(Exception):
    """Base of every error the package raises on purpose."""


class GraphError(PrecisionToolError, ValueError):
    """A graph cannot be built as asked: shape/dtype mismatch, bad attribute, unknown input."""


class GraphFormatError(PrecisionToolError, ValueError):
    """A serialised graph cannot be loaded: malformed JSON, unknown op type, cycle."""


class FeedError(PrecisionToolError, ValueError):
    """A feed is missing, names no placeholder, or has the wrong shape or dtype."""


class FetchError(PrecisionToolError, KeyError):
    """A fetch names no tensor or op of the graph."""

    def __str__(self):  # KeyError would print the message quoted
        return str(self.args[0]) if self.args else ""


class ExecutionError(PrecisionToolError, RuntimeError):
    """A kernel failed at run time; the message names the op."""


class WorkspaceError(PrecisionToolError, ValueError):
    """A workspace, run, step or file that is missing or unreadable."""
