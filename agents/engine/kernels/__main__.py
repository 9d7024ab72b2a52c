"""``python -m agents.engine.kernels build|status``: build the skinny-linear kernel now, or say
whether it loads here (agents/engine/skinny.py)."""

from agents.engine.skinny import main

raise SystemExit(main())
