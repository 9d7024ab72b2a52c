"""What every part of Baton shares, with no Django and no torch: the agents' wire stats as
typed records (`pdd.stats`). The gateway reads P's `done` event through it."""
