"""Ships csrc/, jit/ and trace_templates/ inside the wheel as package data.

They live at the top of the repository (the layout the design brief fixes); the wheel carries a copy
under flashkda_ext/_data/ so that JIT builds work from an installed wheel, not only from a checkout.
flashkda_ext/paths.py looks in _data/ first and falls back to the checkout.
"""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

DATA_DIRS = ("csrc", "jit", "trace_templates")


class BuildPyWithData(build_py):
    def run(self):
        super().run()
        root = Path(__file__).resolve().parent
        dest = Path(self.build_lib) / "flashkda_ext" / "_data"
        for name in DATA_DIRS:
            target = dest / name
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(root / name, target,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.o"))


setup(cmdclass={"build_py": BuildPyWithData})
