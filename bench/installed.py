"""The package as an install leaves it, for the whole-process timings: its modules' bytecode
compiled, as pip compiles it when it installs a wheel. An editable install writes it on the
first import instead, unless PYTHONDONTWRITEBYTECODE is set (as on some CI machines), where
every process would compile each module it imports from source again: that measures a
compile, not a start-up (the peers, installed by pip, never pay it)."""
import compileall
import os


def compile_bytecode() -> None:
    import precision_tool
    compileall.compile_dir(os.path.dirname(precision_tool.__file__), quiet=1)
