"""Baton node agents: the processes that run on inference nodes and host the PyTorch engine."""
