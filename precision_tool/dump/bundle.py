"""Replay bundles: everything needed to rerun one dumped step without the training script.

    replay/<step>/graph.json      the original (uncompiled) graph; within a run, a hard link
                                  to the previous bundle's where the file system allows
    replay/<step>/variables.bin   every variable's value at the start of the step
    replay/<step>/feeds.bin       the step's feeds, by placeholder
    replay/<step>/replay.json     session step (it seeds Dropout), the BLAS thread count the
                                  step ran with (OpenBLAS's sums depend on it), fetches,
                                  target, config, and each array's name, dtype, shape and
                                  offset in the .bin

The .bin files are raw bytes read back with np.frombuffer: no op name becomes a path and
nothing is ever unpickled.
"""
from __future__ import annotations

import json
import operator
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Mapping, NamedTuple, Optional

import numpy as np

from ..errors import PrecisionToolError
from ..fileio import load_json, open_regular
from ..graph import Graph, graph_to_json
from .cores import blas_threads_as
from ..kernels.write import contiguous_arrays, pack

if TYPE_CHECKING:          # the runtime loads when a bundle is replayed, not when one is read
    from ..runtime import Session, SessionConfig

BUNDLE_VERSION = 1


class ReplayError(PrecisionToolError, ValueError):
    """A replay bundle that cannot be used (missing, malformed, from another version)."""


def config_dict(session) -> dict:
    """The session's config as replay.json holds it (SessionConfig.to_dict: switch files and
    mixlists inlined; an NPU session's switch as the passes that ran)."""
    ran = set(session.compiled.fusion) if session.target == "npu" else None
    out = session.config.to_dict(fusion_ran=ran)
    if session.target != "npu":          # the golden run has no switch or mixlist to keep
        out.pop("fusion_switch", None)
        out.pop("modify_mixlist", None)
    return out


_DTYPE, _SHAPE = operator.attrgetter("dtype"), operator.attrgetter("shape")


class _Bin(NamedTuple):
    """One .bin file of a bundle, ready to write."""
    key: tuple              # equal from step to step while the arrays' names, dtypes and
                            # shapes are: replay.json's entries for them still hold
    data: object            # the bytes to write (or, without the C module, the arrays)
    arrays: tuple           # the arrays, C-contiguous, for the entries (not kept)


def _bin(arrays: Mapping[str, np.ndarray]) -> _Bin:
    """The arrays as one .bin file holds them. Runs every dumped step over every variable:
    where the C module is built, one call copies them all and reports their shapes (the
    arrays are let go at once, not held until the writer is done with them); the per-array
    work in Python only where that fails (a strided array, not an array)."""
    values = tuple(arrays.values())
    packed = pack(values)
    if packed is not None:
        data, shapes = packed
        return _Bin((tuple(arrays), tuple(map(_DTYPE, values)), shapes), data, values)
    values = tuple(contiguous_arrays(map(np.asarray, values)))
    key = (tuple(arrays), tuple(map(_DTYPE, values)), tuple(map(_SHAPE, values)))
    packed = pack(values)
    return _Bin(key, values if packed is None else packed[0], values)


def _dtype_name(dtype: np.dtype) -> str:
    """How replay.json names a dtype: by its code ('<f4') where that names it, else by its
    name (an extension dtype: bfloat16's code, '<V2', would read back as raw bytes)."""
    return dtype.str if np.dtype(dtype.str) == dtype else dtype.name


def _entries_json(names, arrays) -> str:
    """replay.json's list of the arrays: name, dtype, shape, offset and size in the .bin
    (worked out when the arrays' layout changes, so checked then: numbers only)."""
    entries, offset = [], 0
    for name, a in zip(names, arrays):
        if a.dtype.hasobject:
            raise ReplayError(f"{name!r} holds Python objects; bundles hold numbers only")
        entries.append({"name": name, "dtype": _dtype_name(a.dtype), "shape": list(a.shape),
                        "offset": offset, "nbytes": a.nbytes})
        offset += a.nbytes
    return json.dumps(entries)


class BundleWriter:
    """Writes the replay bundle of each dumped step of a session. Arrays go back to back
    into one raw file each (variables.bin, feeds.bin) and their names, dtypes, shapes and
    offsets into replay.json: one write call per file (a zip per step cost more than the
    step itself), and reading back is np.frombuffer, nothing to unpickle. What is the same
    every step (the graph, the config, the arrays' layout) is encoded once, and the graph is
    written once: later bundles hard-link the previous bundle's graph.json (a directory entry,
    not a new file: an identical 100 KB copy per dumped step otherwise, and creating a file
    is what costs most on a slow file system). Each bundle stays whole on its own: removing
    one leaves the others' links. Where linking fails (no hard links here, the file gone), the
    graph is written."""

    def __init__(self, session):
        self.graph = (graph_to_json(session.graph) + "\n").encode("utf-8")
        self.config = json.dumps(config_dict(session))
        self._head = (None, "", "")                # (fetches, replay.json before and after
                                                   # the session step)
        self._tail = (None, b"")                   # (arrays' keys, the rest of replay.json)
        self._graph_file: Optional[str] = None     # the last bundle's graph.json

    def _meta(self, session, fetch_tensors, fetch_nodes, bins: Dict[str, _Bin],
              blas_threads: Optional[int]) -> tuple:
        """replay.json, in two parts: only the session step and the BLAS thread count change
        from step to step of a training loop; the rest is encoded once for each set of
        fetches and of arrays' names, dtypes and shapes."""
        head_key = (session.target, tuple(fetch_tensors), tuple(fetch_nodes))
        tail_key = tuple(b.key for b in bins.values())
        if self._head[0] != head_key:
            rest = json.dumps({"target": session.target, "fetch_tensors": list(fetch_tensors),
                               "fetch_nodes": list(fetch_nodes)})
            self._head = (head_key, f'{{"version": {BUNDLE_VERSION}, "session_step": ',
                          f", {rest[1:-1]}")
        if self._tail[0] != tail_key:
            entries = "".join(f', "{kind}": {_entries_json(b.key[0], b.arrays)}'
                              for kind, b in bins.items())
            self._tail = (tail_key, f'{entries}, "config": {self.config}}}\n'.encode("utf-8"))
        _, before, after = self._head
        threads = "null" if blas_threads is None else int(blas_threads)
        return f'{before}{int(session.step)}, "blas_threads": {threads}{after}'.encode("utf-8"), \
            self._tail[1]

    def files(self, directory: str, name: str, session, feeds: Dict[str, np.ndarray],
              fetch_tensors, fetch_nodes, blas_threads: Optional[int] = None) -> "BundleFiles":
        """The step's bundle, directory/name (directory ends with a separator), as files to
        write into a partial directory renamed into place when complete: taken now, on the
        training thread, and written by the dump's writer with the step's own files.
        blas_threads: the BLAS thread count the step runs with (None: not known)."""
        bins = {"variables": _bin(session.variables(copy=False)), "feeds": _bin(feeds)}
        path, partial = directory + name, f"{directory}.{name}.partial"
        files = [(f"{partial}{os.sep}{kind}.bin", b.data) for kind, b in bins.items()]
        files.append((f"{partial}{os.sep}replay.json",
                      self._meta(session, fetch_tensors, fetch_nodes, bins, blas_threads)))
        # within a run, graph.json is a hard link to the previous bundle's (which the writer,
        # working in order, has renamed into place by then), or written where that fails
        graph = f"{partial}{os.sep}graph.json"
        link = (self._graph_file or graph, graph, self.graph)
        self._graph_file = f"{path}{os.sep}graph.json"
        return BundleFiles(path, partial, files, link)


class BundleFiles(NamedTuple):
    """One step's bundle, ready to write (see BundleWriter.files)."""
    path: str
    partial: str
    files: list             # (path, bytes or a tuple of buffers) each
    link: tuple             # (graph.json to link to, graph.json, its contents where that fails)


@dataclass
class Bundle:
    path: str
    graph: Graph
    variables: Dict[str, np.ndarray]
    feeds: Dict[str, np.ndarray]
    meta: dict

    def config(self, **overrides) -> SessionConfig:
        from ..runtime import SessionConfig
        return SessionConfig.from_dict(self.meta["config"], **overrides)

    def session(self, target: str, config: Optional[SessionConfig] = None) -> Session:
        """A session of the step's graph on `target`, not yet started (start() puts it where
        the step starts): the one way replaying work makes its sessions. config: default the
        bundle's own on the target it was dumped from, a plain SessionConfig elsewhere."""
        from ..runtime import Session, SessionConfig
        if config is None:
            config = self.config() if target == self.meta["target"] else SessionConfig()
        return Session(self.graph, target=target, config=config)

    def start(self, sess: Session, variables: Optional[Dict[str, np.ndarray]] = None,
              exact: Optional[bool] = None) -> None:
        """Put a session where the step starts: the bundle's variables (or these) loaded,
        exactly by default when it is the target they were dumped from; its step number."""
        sess.load_variables(self.variables if variables is None else variables,
                            exact=sess.target == self.meta["target"] if exact is None else exact)
        sess.step = self.meta["session_step"]

    def run_step(self, sess: Session, extra=(), substitute=None) -> Dict[str, np.ndarray]:
        """One run of the step on a session (its feeds, its fetches and `extra`, with the BLAS
        thread count it ran with: OpenBLAS's sums depend on it): the fetched tensors by name."""
        fetches = list(self.meta["fetch_tensors"]) + list(extra)
        with blas_threads_as(self.meta.get("blas_threads")):
            values = sess.run(fetches + list(self.meta["fetch_nodes"]), dict(self.feeds),
                              substitute=substitute)
        return dict(zip(fetches, values))


def _load_arrays(path: str, entries) -> Dict[str, np.ndarray]:
    try:
        with open_regular(path) as f:
            raw = f.read()
        out = {}
        for e in entries:
            dtype = np.dtype(e["dtype"])
            if dtype.hasobject:
                raise ValueError("object dtype")
            end = e["offset"] + e["nbytes"]
            if e["nbytes"] != dtype.itemsize * int(np.prod(e["shape"])) or end > len(raw):
                raise ValueError(f"{e['name']!r} does not fit the file")
            out[e["name"]] = np.frombuffer(raw, dtype, offset=e["offset"],
                                           count=int(np.prod(e["shape"]))).reshape(e["shape"]).copy()
        return out
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ReplayError(f"replay bundle file {path} is unreadable: {e}") from None


def bundle_fetches(path: str) -> Optional[List[str]]:
    """The ops a bundle's step fetched (their original names), from its replay.json alone;
    None when the step has no readable bundle."""
    try:
        meta = load_json(os.path.join(path, "replay.json"), ReplayError, "replay bundle")
        return [t.rpartition(":")[0] for t in meta["fetch_tensors"]] + list(meta["fetch_nodes"])
    except (ReplayError, TypeError, KeyError, AttributeError):
        return None


def load_bundle(path: str) -> Bundle:
    from ..graph_files import load_graph
    meta = load_json(os.path.join(path, "replay.json"), ReplayError, "replay bundle")
    if not isinstance(meta, dict) or meta.get("version") != BUNDLE_VERSION:
        raise ReplayError(f"replay bundle {path} has an unsupported version")
    threads = meta.get("blas_threads")      # absent from bundles written before it was kept
    if threads is not None and (type(threads) is not int or threads < 1):
        raise ReplayError(f"replay bundle {path}: blas_threads must be a positive integer, "
                          f"not {threads!r}")
    graph = load_graph(os.path.join(path, "graph.json"))
    variables = _load_arrays(os.path.join(path, "variables.bin"), meta["variables"])
    feeds = _load_arrays(os.path.join(path, "feeds.bin"), meta["feeds"])
    return Bundle(path, graph, variables, feeds, meta)


def replay(bundle: Bundle, target: Optional[str] = None, config: Optional[SessionConfig] = None):
    """Rerun the bundle's step on `target` (default: the one it was dumped from). Returns the
    session (its `step` is the dumped step's) and the fetched results."""
    target = target or bundle.meta["target"]
    sess = bundle.session(target, config)
    same = target == bundle.meta["target"] and \
        sess.config.golden_dtype == bundle.meta["config"].get("golden_dtype")
    bundle.start(sess, exact=same)
    fetched = bundle.run_step(sess)
    return sess, [fetched[t] for t in bundle.meta["fetch_tensors"]] + [None] * len(bundle.meta["fetch_nodes"])
