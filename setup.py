"""Build pipesgd: setuptools hands the compiled part to CMake (CMakeLists.txt)."""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Configure and build CMakeLists.txt, placing the module where setuptools expects it."""

    def build_extension(self, ext: Extension) -> None:
        import mpi4py
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(os.environ.get("PIPESGD_BUILD_DIR", ROOT / "build" / "cmake"))
        build_dir.mkdir(parents=True, exist_ok=True)
        config = os.environ.get("PIPESGD_BUILD_TYPE", "Release")
        args = [
            f"-DCMAKE_BUILD_TYPE={config}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DMPI4PY_INCLUDE_DIR={mpi4py.get_include()}",
        ]
        subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build_dir), *args], check=True)
        jobs = str(os.cpu_count() or 2)
        subprocess.run(
            ["cmake", "--build", str(build_dir), "--target", "_C", "-j", jobs], check=True
        )


setup(
    name="pipesgd",
    version="0.1.0",
    description="Pipelined SGD and pipeline parallelism over MPI with a compiled ring-AllReduce",
    packages=find_packages(include=["pipesgd", "pipesgd.*"]),
    python_requires=">=3.10",
    install_requires=["numpy>=1.24", "mpi4py>=4.0", "torch>=2.2,<3"],
    extras_require={
        "train": ["tqdm", "scikit-learn", "matplotlib"],
        "dev": ["pytest", "pytest-timeout", "ruff"],
    },
    ext_modules=[CMakeExtension("pipesgd._C")],
    cmdclass={"build_ext": CMakeBuild},
    entry_points={"console_scripts": ["pipesgd=pipesgd.cli:main"]},
    zip_safe=False,
)
