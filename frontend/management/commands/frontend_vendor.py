"""Copy the npm-installed browser assets (uPlot) into frontend/static/frontend/vendor/."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

ASSETS = {"uplot": ["dist/uPlot.iife.min.js", "dist/uPlot.min.css"]}


class Command(BaseCommand):
    help = "Copy uPlot from node_modules (run `npm ci` first) into the app's static vendor folder."

    def handle(self, *args, **options):
        root = Path(settings.BASE_DIR)
        target = root / "frontend" / "static" / "frontend" / "vendor"
        target.mkdir(parents=True, exist_ok=True)
        pinned = json.loads((root / "package.json").read_text())["dependencies"]
        for package, files in ASSETS.items():
            source = root / "node_modules" / package
            if not source.is_dir():
                raise CommandError(f"{source} is missing: run `npm ci` in {root} first")
            version = json.loads((source / "package.json").read_text())["version"]
            if version != pinned[package]:
                raise CommandError(
                    f"{package} {version} installed, package.json pins "
                    f"{pinned[package]}: run `npm ci`"
                )
            for name in files:
                shutil.copy2(source / name, target / Path(name).name)
                self.stdout.write(f"copied {package} {version} {name}")
