"""The wheel holds every library package: a package left out of `setup.py` would import fine from a checkout and
fail only for users who `pip install` it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

from tests.architecture.import_graph import LIBRARY_ROOTS, REPO


def test_wheel_contains_every_library_package(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    for root in LIBRARY_ROOTS:  # a copy, so that the build writes no build/ or egg-info into the checkout
        shutil.copytree(REPO / root, src / root, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("jaxinfer-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = sorted(p.parent.relative_to(REPO).as_posix() for root in LIBRARY_ROOTS
                      for p in (REPO / root).rglob("__init__.py"))
    assert len(packages) > 10  # the walk found the tree
    missing = [p for p in packages if f"{p}/__init__.py" not in names]
    assert missing == []
    modules = sorted(p.relative_to(REPO).as_posix() for root in LIBRARY_ROOTS for p in (REPO / root).rglob("*.py"))
    assert [m for m in modules if m not in names] == []
    sources = sorted(p.relative_to(REPO).as_posix() for root in LIBRARY_ROOTS for pattern in ("*.cc", "*.h")
                     for p in (REPO / root).rglob(pattern))
    assert sources and [s for s in sources if s not in names] == []  # native kernels build from their source
