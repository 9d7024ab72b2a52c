"""The autopilot on a live emulated fleet: the rate doubles, the automatic mode resizes it
(``python -m bench.autopilot``; the rule in bench/autopilot/run.py's docstring)."""
