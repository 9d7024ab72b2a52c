"""The Django-side helpers every app builds on: env-driven settings helpers, the bounded filters,
JSON safety, roles, the schema's error shapes and the abstract hashed-token model.

Not the project package (`controlplane`, which composes the apps) and no Django app: it has no
models of its own, only the abstract `tokens.HashedToken` the apps' models inherit."""
