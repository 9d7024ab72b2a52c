"""``python -m planner``: run, plan and list scenarios."""

from __future__ import annotations

import sys

from planner.cli import main

sys.exit(main())
