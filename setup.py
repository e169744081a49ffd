"""Builds the C++ extensions: the DCI index ``icecache.dci._dci``, MagicPIG's host step
``icecache.core.kernels._magicpig_host`` and the host side of the decode step's hand-off channel
``icecache.core._host_channel`` (no CUDA: its driver calls are made from Python); everything else is in
pyproject.toml.

The module also holds IceCache's decode step (icecache/method/src/): the step calls the index's searches and
inserts on raw buffers, so it is compiled against the index's sources into the same module rather than a second
one that would need the index's C++ types across a module boundary.

Flags are portable on purpose (no -march=native): the hot kernels carry their own x86-64-v3 clone that is picked at
run time, so a wheel built on one host runs on any x86-64 host. Works with build isolation (pip fetches pybind11) and
without it (`python setup.py build_ext --inplace` on a host that has pybind11 installed and no registry access).
"""

from __future__ import annotations

import sys
from glob import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

openmp = ["-fopenmp"] if sys.platform != "darwin" else ["-Xpreprocessor", "-fopenmp"]

ext_modules = [
    Pybind11Extension(
        "icecache.dci._dci",
        sorted(glob("icecache/dci/src/*.cpp")) + sorted(glob("icecache/method/src/*.cpp")),
        include_dirs=["icecache/dci/src"],
        depends=sorted(glob("icecache/dci/src/*.hpp")),  # a header's change rebuilds the module too
        cxx_std=17,
        extra_compile_args=["-O3", "-fno-math-errno", *openmp],
        extra_link_args=openmp if sys.platform != "darwin" else ["-lomp"],
    ),
    # MagicPIG's host step (baselines/magicpig.py): its row kernels carry their own AVX2 and AVX-512 clones.
    Pybind11Extension(
        "icecache.core.kernels._magicpig_host",
        ["icecache/core/kernels/src/magicpig_host.cpp"],
        cxx_std=17,
        extra_compile_args=["-O3", "-fno-math-errno", *openmp],
        extra_link_args=openmp if sys.platform != "darwin" else ["-lomp"],
    ),
    Pybind11Extension(
        "icecache.core._host_channel",
        sorted(glob("icecache/core/src/*.cpp")),
        cxx_std=17,
        extra_compile_args=["-O2", "-pthread"],
        extra_link_args=["-pthread"],
    ),
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
