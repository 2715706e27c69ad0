"""The build of the one C module: everything else is in setup.cfg.

precision_tool._reduce fuses the statistics and comparison reductions into one pass over
memory, and writes a dump's files and reads CSV without the GIL; its sources are in
precision_tool/kernels/c/, a file per concern. It is optional: where no C compiler is at
hand the install still succeeds and the numpy code that defines every quantity runs instead
(slower on large tensors).
"""
import glob

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "precision_tool._reduce", sorted(glob.glob("precision_tool/kernels/c/*.c")),
    depends=["precision_tool/kernels/c/kernels.h"],
    # vectorised reductions without -ffast-math: nan and inf keep their meaning; the files
    # share their functions with each other, not with the process
    extra_compile_args=["-O3", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math",
                        "-fvisibility=hidden"],
    optional=True)])
