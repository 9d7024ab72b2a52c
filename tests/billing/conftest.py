import pytest

# The shared fixtures of the billing tests, for the modules that do not define them.
from tests.billing.test_costs_and_margin import fleet, ledger  # noqa: F401
from tests.billing.test_pricing_and_statements import (  # noqa: F401
    acme,
    acme_key,
    big,
    globex,
    january,
    tiny,
)


@pytest.fixture(autouse=True)
def _fresh_margin_cache():
    """Each test starts without cached margin reports (billing.margin caches live ones)."""
    from billing.margin import clear_cache

    clear_cache()
    yield
