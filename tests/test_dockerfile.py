"""Every top-level package of the project is installed (pyproject.toml) and copied into the image
(docker/Dockerfile): a package missing there imports fine from a checkout and fails only once
installed or in the image (``plans``, a Django app in INSTALLED_APPS, was missing from both)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_SHIPPED = {"tests"}


def _packages() -> set[str]:
    return {
        p.name for p in ROOT.iterdir() if (p / "__init__.py").exists() and p.name not in NOT_SHIPPED
    }


def test_pyproject_installs_every_top_level_package():
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    included = {p.removesuffix("*") for p in find["find"]["include"]}
    assert not _packages() - included, f"pyproject.toml includes no {_packages() - included}"


def test_the_image_copies_every_top_level_package():
    text = (ROOT / "docker/Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\w+) \./\1$", text, re.M))
    assert not _packages() - copied, f"docker/Dockerfile copies no {_packages() - copied}"
