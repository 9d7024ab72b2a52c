"""Unit tests of the live PDD benchmark (bench/pdd): no processes, no models."""
