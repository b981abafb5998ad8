"""Build flared, compiling every Cython module in flared/_fast.

    python setup.py build_ext --inplace            # normal build
    FLARED_CYTHON_ANNOTATE=1 python setup.py ...    # also write annotated HTML
    FLARED_CYTHON_DEBUG=1 python setup.py ...       # bounds/wraparound checks on, -O0 -g
"""

import glob
import os
import shutil
import sys
import sysconfig

from setuptools import Extension, setup


def _require_compiler() -> None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None and shutil.which("cc") is None and shutil.which("gcc") is None:
        sys.exit(
            f"flared: no C compiler found (looked for {cc!r}, cc, gcc). "
            "flared/_fast is Cython and needs one: install gcc (e.g. apt-get install gcc) and retry."
        )


def _extensions():
    from Cython.Build import cythonize
    import numpy

    debug = os.environ.get("FLARED_CYTHON_DEBUG") == "1"
    annotate = os.environ.get("FLARED_CYTHON_ANNOTATE") == "1"
    compile_args = ["-O0", "-g"] if debug else ["-O3"]
    sources = sorted(glob.glob(os.path.join("flared", "_fast", "*.pyx")))
    # C headers included by the modules (linear_kernel.h): a change to one rebuilds them.
    headers = sorted(glob.glob(os.path.join("flared", "_fast", "*.h")))
    # linear.pyx, attention.pyx, decode.pyx, delta.pyx, race.pyx, penalties.pyx and gguf.pyx thread their work with OpenMP; on Linux that
    # is gcc's libgomp, the runtime torch ships, so they share one pool. Elsewhere the loops run on one thread.
    openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
    extra_args = {"linear": openmp, "attention": openmp, "decode": openmp, "delta": openmp, "race": openmp,
                  "penalties": openmp, "gguf": openmp}
    exts = []
    for src in sources:
        name = os.path.splitext(os.path.basename(src))[0]
        exts.append(Extension(
            "flared._fast." + name,
            [src],
            include_dirs=[numpy.get_include()],
            extra_compile_args=compile_args + extra_args.get(name, []),
            extra_link_args=extra_args.get(name, []),
            depends=headers,
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        ))
    directives = {
        "language_level": "3",
        "boundscheck": debug,
        "wraparound": debug,
        "initializedcheck": debug,
        "cdivision": True,
        "embedsignature": True,
    }
    return cythonize(exts, compiler_directives=directives, annotate=annotate, quiet=True)


_require_compiler()
setup(ext_modules=_extensions())
