"""The layers import downwards only (README's Layout): a module may import its
own layer and those below, never one above — module-level imports and those inside
functions alike. Entry points (__main__ modules) run on top of everything."""
import ast
import os

import precision_tool

ROOT = os.path.dirname(precision_tool.__file__)
# lowest first; equal numbers are one layer
LAYERS = {"errors": 0, "fileio": 0, "collector": 0, "version": 0, "_reduce": 0, "numerics": 1, "kernels": 1, "table": 1,
          "graph": 2, "ops": 3, "graph_files": 4, "train": 4, "nn": 5, "data": 5, "models": 6,
          "runtime": 7, "dump": 8, "onnx": 8, "trainer": 9, "torch": 9, "analysis": 10, "report": 11,
          "cli": 12}


def _unit(module: str) -> str:
    """The layer a module of the package belongs to: its first component."""
    return module.split(".")[1] if module.count(".") else module


def _imports(path: str, package: str):
    """(line, module) of every precision_tool import in the file, relative ones resolved."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                if node.module:
                    yield node.lineno, ".".join(base + [node.module])
                else:
                    for alias in node.names:
                        yield node.lineno, ".".join(base + [alias.name])
            elif node.module and node.module.split(".")[0] == "precision_tool":
                yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "precision_tool":
                    yield node.lineno, alias.name


def test_no_layer_imports_one_above_it():
    wrong, unknown = [], []
    for dirpath, _, files in os.walk(ROOT):
        for name in files:
            if not name.endswith(".py") or name == "__main__.py":
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, ROOT)
            me = rel.split(os.sep)[0].removesuffix(".py")
            if me == "__init__":             # the package's face: it re-exports every layer
                continue
            below = os.path.relpath(dirpath, ROOT)
            package = "precision_tool" + ("" if below == "." else "." + below.replace(os.sep, "."))
            for line, module in [*_imports(path, package), *_lazy_imports(path, package)]:
                other = _unit(module)
                if other == "__init__" or module == "precision_tool":
                    continue
                if me not in LAYERS or other not in LAYERS:
                    unknown.append(f"{rel}:{line} {module}")
                elif LAYERS[other] > LAYERS[me]:
                    wrong.append(f"{rel}:{line} ({me}) imports {module} ({other})")
    assert not unknown, f"modules missing from the layer order: {unknown}"
    assert not wrong, "\n".join(wrong)


def _lazy_imports(path: str, package: str):
    """(line, module) of every module a lazy registry names (PEP 562 packages: dicts of
    module names that importlib.import_module(f".{name}", __name__) loads when a name is first
    asked for), resolved as that call resolves them, where such a module exists: what the
    registries load is held to the layers as plain imports are."""
    text = open(path, encoding="utf-8").read()
    if "importlib.import_module" not in text:
        return
    for node in ast.parse(text).body:
        if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Dict):
            continue
        for const in ast.walk(node.value):
            if not (isinstance(const, ast.Constant) and isinstance(const.value, str)
                    and const.value.replace(".", "").replace("_", "").isalnum()):
                continue
            name = "." + const.value
            level = len(name) - len(name.lstrip("."))
            parts = package.split(".")
            module = ".".join(parts[:len(parts) - level + 1] + [name.lstrip(".")])
            where = os.path.join(os.path.dirname(ROOT), *module.split("."))
            if os.path.isfile(where + ".py") or os.path.isdir(where):
                yield const.lineno, module


def test_the_check_sees_what_a_lazy_registry_loads(tmp_path):
    """A registry naming a module above its layer is found like an import of it."""
    path = tmp_path / "__init__.py"
    path.write_text("import importlib\n_WHERE = {'Thing': '.analysis.autocheck', "
                    "'Other': 'layout'}\n\n\ndef __getattr__(name):\n"
                    "    return importlib.import_module(f'.{_WHERE[name]}', __name__)\n")
    found = [m for _, m in _lazy_imports(str(path), "precision_tool.dump")]
    assert found == ["precision_tool.analysis.autocheck", "precision_tool.dump.layout"]
    real = [m for _, m in _lazy_imports(os.path.join(ROOT, "analysis", "__init__.py"),
                                        "precision_tool.analysis")]
    assert "precision_tool.analysis.replays.fusion_bisect" in real and len(real) >= 15


def _imports_the_c_module(path: str) -> bool:
    """Whether the file imports the C module (_reduce) or its Python face (kernels.native)."""
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.ImportFrom):
            names = {(node.module or "").split(".")[-1]} | {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            names = {a.name.split(".")[-1] for a in node.names}
        else:
            continue
        if names & {"native", "_reduce"}:
            return True
    return False


def test_only_the_kernels_package_asks_for_the_c_module(tmp_path):
    """Statistics, rounding, compare totals and dump writing go through
    precision_tool.kernels, which alone decides whether C loops or numpy compute them: no
    module outside it imports the C module or its Python face."""
    callers = []
    for dirpath, _, files in os.walk(ROOT):
        for name in files:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
            if name.endswith(".py") and not rel.startswith("kernels/") and \
                    _imports_the_c_module(path):
                callers.append(rel)
    assert callers == []
    planted = tmp_path / "planted.py"           # the check sees one
    planted.write_text("from ..kernels import native\n")
    assert _imports_the_c_module(str(planted))


def test_the_check_sees_a_wrong_import(tmp_path):
    """The walk resolves relative imports: a planted upward import is found."""
    path = tmp_path / "bad.py"
    path.write_text("from ..analysis import auto_check\nfrom . import layout\n")
    found = [m for _, m in _imports(str(path), "precision_tool.dump")]
    assert found == ["precision_tool.analysis", "precision_tool.dump.layout"]
    assert LAYERS[_unit(found[0])] > LAYERS["dump"]


def test_importing_the_package_leaves_the_heavy_parts_unloaded():
    """`import precision_tool` brings neither pandas nor the trainer: they come with the
    commands that use them (PEP 562 attributes)."""
    import subprocess
    import sys
    code = ("import sys, precision_tool as pt; print('pandas' in sys.modules, "
            "'precision_tool.trainer' in sys.modules); pt.Model; print('precision_tool.trainer' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False", "True"], out.stderr


def test_the_precision_rules_have_one_owner():
    """The modes and what they mean live in runtime.npu.policy; SessionConfig checks a mode
    against it; the command line asks the config (and the analysis its results), never the
    policy, and no module but the policy defines mode_of or a table of modes."""
    from precision_tool.runtime import SessionConfig
    from precision_tool.runtime.config import ConfigError
    for bad in ({"precision_mode": "fp8"}, {"amp_level": "O5"}):
        try:
            SessionConfig(**bad)
        except ConfigError as e:
            assert "must be one of" in str(e)
        else:
            raise AssertionError(f"SessionConfig took {bad}")
    assert SessionConfig(amp_level="O2").effective_mode == "O2"
    assert SessionConfig(precision_mode="force_fp16").effective_mode == "force_fp16"
    cli_importers, definers, from_dicts = [], [], []
    for dirpath, _, files in os.walk(ROOT):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
            below = os.path.relpath(dirpath, ROOT)
            package = "precision_tool" + ("" if below == "." else "." + below.replace(os.sep, "."))
            if rel.startswith("cli/") and any(m == "precision_tool.runtime.npu.policy"
                                              for _, m in _imports(path, package)):
                cli_importers.append(rel)
            text = open(path, encoding="utf-8").read()
            if rel != "runtime/npu/policy.py" and ("def mode_of" in text or
                                                   "PRECISION_MODES = (" in text):
                definers.append(rel)
            if rel.startswith("analysis/") and "mode_of(" in text:
                from_dicts.append(rel)   # analysis reads Run.config / SessionConfig, typed
    assert cli_importers == [] and definers == [] and from_dicts == []


def test_replaying_work_makes_its_sessions_through_the_bundle():
    """Every analysis that replays a dumped step (checks, impact, repair, the step replay,
    fusion bisection) gets its sessions from Bundle.session and runs them with its
    start/run_step: no module of analysis builds a Session of its own."""
    own = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "analysis")):
        for name in files:
            if name.endswith(".py"):
                text = open(os.path.join(dirpath, name), encoding="utf-8").read()
                if "Session(" in text.replace("SessionConfig(", ""):
                    own.append(name)
    assert own == []
