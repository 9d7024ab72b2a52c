"""Benchmarks of the emulated engine on live agents (docs/emulation.md)."""
