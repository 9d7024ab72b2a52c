"""Tenants, API keys, rate limits and the usage ledger."""
