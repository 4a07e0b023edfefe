"""The wheel (the image's ``pip install .``) holds every room: pyproject.toml lists the
packages one by one, so a new folder left off the list would be missing from the image
while an editable install still finds it."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_folder_of_python_code_is_a_listed_package():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for top, package in setuptools["package-dir"].items():
        base = ROOT / package
        for source in base.rglob("*.py"):
            parts = source.parent.relative_to(base).parts
            if "__pycache__" not in parts:
                found.add(".".join((top, *parts)))
    assert found - listed == set(), "folders of code missing from [tool.setuptools] packages"
    data = setuptools.get("package-data", {})
    assert listed - found <= set(data), "listed packages with neither code nor data"
