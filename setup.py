"""The build of the one C module: everything else is in setup.cfg.

precision_tool._reduce fuses the statistics and comparison reductions into one pass over
memory. It is optional: where no C compiler is at hand the install still succeeds and the
numpy code that defines every quantity runs instead (slower on large tensors).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "precision_tool._reduce", ["precision_tool/_reduce.c"],
    # vectorised reductions without -ffast-math: nan and inf keep their meaning
    extra_compile_args=["-O3", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math"],
    optional=True)])
