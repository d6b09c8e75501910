"""Builds lowprec's quantization kernel (plain C, no torch headers) at install time.

The kernel is optional: when no C compiler is available the build continues without it and
lowprec uses its plain-torch path, which gives the same bits (only slower).
"""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as err:  # no compiler: fall back to the plain-torch path
            print(f"lowprec: kernel not built ({err}); using the plain-torch path", file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as err:
            print(f"lowprec: kernel not built ({err}); using the plain-torch path", file=sys.stderr)


# The kernel's C files, one job each (csrc/lp_common.h lists them), built into one library; the
# binding (numerics/kernel/) has a module per file. Tests that build it per instruction set
# compile every *.c of this folder (tests/numerics/test_kernel_paths.py).
CSRC = "src/lowprec/numerics/csrc"
SOURCES = [f"{CSRC}/{name}.c" for name in ("quantize", "block", "accumulate", "optimizer",
                                           "recurrent", "fexp", "module")]

setup(
    ext_modules=[
        Extension(
            "lowprec.numerics._qkernel",
            sources=SOURCES,
            depends=[f"{CSRC}/lp_common.h"],  # #included by every source
            # No -ffast-math: the kernel relies on exact IEEE multiplication and subnormals.
            extra_compile_args=["-O3", "-fno-trapping-math", "-std=gnu11", "-fopenmp", "-ffp-contract=off",
                                "-fno-math-errno"],
            # libgomp.so.1 resolves to the copy torch loads, so both share one thread pool
            extra_link_args=["-lpthread", "-fopenmp"],
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
