"""Fault injection against a real local fleet: `python -m bench.chaos` / `make chaos`."""
