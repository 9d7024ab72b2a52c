"""Billing benchmark: a month of 1,000,000 usage entries on PostgreSQL rated into statements."""
