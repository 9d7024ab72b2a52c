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


def test_the_agents_web_process_runs_the_images_server_options_on_its_own_port():
    """compose's ``agent-api`` (the agents' API apart from the gateway, docs/operations.md)
    repeats the image's uvicorn command: the same connection limits, another port."""
    import json

    import yaml

    text = (ROOT / "docker/Dockerfile").read_text()
    cmd = json.loads(re.search(r"^CMD (\[.*?\])$", text, re.M | re.S).group(1).replace("\\\n", ""))
    compose = yaml.safe_load((ROOT / "docker/compose.yml").read_text())
    agent_api = compose["services"]["agent-api"]

    def options(argv: list[str]) -> dict[str, str]:
        return dict(zip(argv[2::2], argv[3::2], strict=False))

    image, own = options(cmd), options(agent_api["command"])
    assert (own.pop("--port"), image.pop("--port")) == ("8001", "8000")
    own.pop("--workers"), image.pop("--workers")
    assert own == image and agent_api["ports"] == ["8001:8001"]
