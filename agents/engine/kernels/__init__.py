"""C++ kernels of the engine, built on the machine that runs them (agents/engine/skinny.py)."""
