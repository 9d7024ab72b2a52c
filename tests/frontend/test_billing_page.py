"""Browser test of the Billing page: seeded statements, usage and fleet cost, drawn by headless
Debian Chromium (Playwright driver, never a downloaded browser) under the page's strict CSP.

Screenshots: test-artifacts/billing-page.png (last month, closed statements, a full month of
days) and test-artifacts/billing-page-current.png (this month, open statements).
"""

from __future__ import annotations

import pytest

from tests.frontend.test_browser import ARTIFACTS, login, page, server, wait_js  # noqa: F401

pytestmark = [pytest.mark.browser, pytest.mark.slow]

# Run in `manage.py shell`: three tenants, two priced models (a mid-month list price change
# and a contract price), usage on every day of last month and this month so far, the demo
# fleet running since before last month (one instance stopped part-way through it), last
# month's statements closed and this month's rated.
SEED = r"""
from datetime import timedelta
from decimal import Decimal as D
from billing import pricing
from billing.models import ModelPrice, Tenant, UsageEntry
from billing.statements import close_statements, month_start, rate_pending
from django.utils import timezone
from fleet.models import FleetEvent, Instance, ServedModel

now = timezone.now()
this = month_start(now)
last = month_start(this - timedelta(days=1))
tiny = ServedModel.objects.get(name="baton-tiny")
big, _ = ServedModel.objects.get_or_create(
    name="baton-big", defaults={"source": "baton-tiny", "num_layers": 4, "kv_bytes_per_token": 4096}
)
def price(model, inp, cached, out, start, end=None, tenant=None):
    pricing.model_price_save(price=ModelPrice(served_model=model, tenant=tenant,
        input_per_mtok=D(inp), cached_input_per_mtok=D(cached), output_per_mtok=D(out),
        currency="USD", effective_from=start, effective_to=end))
tenants = [Tenant.objects.get_or_create(name=n, defaults={"display_name": d})[0]
           for n, d in (("acme", "Acme Corp"), ("globex", "Globex"), ("initech", "Initech"))]
mid = last + timedelta(days=15)
price(tiny, "0.50", "0.05", "1.50", last - timedelta(days=40), mid)
price(tiny, "0.60", "0.06", "1.80", mid)
price(big, "3.00", "0.30", "9.00", last - timedelta(days=40))
price(big, "2.40", "0.24", "7.20", last - timedelta(days=40), tenant=tenants[1])
rows, n = [], 0
day = last
while day < now:
    for t, tenant in enumerate(tenants):
        for k in range(3):
            n += 1
            scale = (1 + t) * (1 + (day.day % 7)) * (k + 1)
            rows.append((UsageEntry(request_id=f"seed-{n}", tenant=tenant,
                model="baton-big" if k == 2 else "baton-tiny",
                prompt_tokens=2_000_000 * scale, cached_tokens=500_000 * scale,
                completion_tokens=400_000 * scale), day + timedelta(hours=3 + 6 * k)))
    day += timedelta(days=1)
UsageEntry.objects.bulk_create([e for e, _ in rows])
for e, when in rows:
    if when < now:
        UsageEntry.objects.filter(request_id=e.request_id).update(created_at=when)
    else:
        UsageEntry.objects.filter(request_id=e.request_id).delete()
for i, inst in enumerate(Instance.objects.order_by("pk")):
    ev = FleetEvent.objects.create(instance=inst, kind="instance.state", message="seed",
                                   data={"previous": "starting", "new": "running"})
    FleetEvent.objects.filter(pk=ev.pk).update(created_at=last - timedelta(days=3))
    if i == 1:  # the relay stopped for the second half of last month, back this month
        for when, prev, new in ((mid, "running", "stopped"), (this, "stopped", "running")):
            ev = FleetEvent.objects.create(instance=inst, kind="instance.state", message="seed",
                                           data={"previous": prev, "new": new})
            FleetEvent.objects.filter(pk=ev.pk).update(created_at=when)
    Instance.objects.filter(pk=inst.pk).update(actual_state="running")
rate_pending()
close_statements()
print("seeded", n)
"""


@pytest.fixture(scope="module")
def seeded(server):  # noqa: F811
    out = server["run"]("shell", "-c", SEED)
    assert "seeded" in out
    return server


def _check_page(page, name: str) -> dict:  # noqa: F811
    wait_js(page, "document.body.dataset.billingCharts === 'ready'")
    page.wait_for_timeout(300)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)
    return page.evaluate(
        """() => {
          const box = (id) => { const r = document.getElementById(id).getBoundingClientRect();
                                return [r.left, r.top, r.right, r.bottom]; };
          const wider = [...document.querySelectorAll('section.card, .billing-grid .card')]
            .filter((el) => el.scrollWidth > el.clientWidth + 1).map((el) => el.id || el.className);
          return {
            spend: document.getElementById('chart-spend').dataset.drawn,
            margin: document.getElementById('chart-margin').dataset.drawn,
            canvases: document.querySelectorAll('#chart-spend canvas, #chart-margin canvas').length,
            tenants: document.querySelectorAll('#tenant-spend tbody tr').length,
            models: [...document.querySelectorAll(
              '#model-margin table:first-of-type tbody tr td:first-child')]
              .map((td) => td.textContent),
            statements: document.querySelectorAll('details.statement').length,
            boxes: [box('chart-spend'), box('chart-margin')],
            overflowing: wider,
            pageWidth: document.documentElement.scrollWidth,
          };
        }"""
    )


def test_billing_page_draws_statements_charts_and_margin(seeded, page):  # noqa: F811
    base = seeded["base"]
    login(page, base)
    page.goto(base + "/billing/")
    current = _check_page(page, "billing-page-current.png")
    assert current["spend"] == "chart" and current["canvases"] == 2
    assert current["tenants"] == 3
    period = page.evaluate("document.getElementById('billing-period').textContent")
    # Last month: closed statements, a chart over the whole month.
    page.click(".period a:first-child")
    page.wait_for_url(lambda url: "period=" in url)
    state = _check_page(page, "billing-page.png")
    assert state["spend"] == "chart" and state["margin"] == "chart"
    assert state["canvases"] == 2
    assert state["tenants"] == 3
    assert state["models"] == ["baton-big", "baton-tiny"]
    assert state["statements"] == 3
    # The two charts sit side by side without overlapping; nothing is wider than its card.
    (l1, t1, r1, b1), (l2, t2, r2, b2) = state["boxes"]
    assert r1 <= l2 or b1 <= t2
    assert state["overflowing"] == [] and state["pageWidth"] <= 1366
    # A statement expands to its lines; the page has no CSP violations.
    page.click("details.statement summary")
    assert page.evaluate("document.querySelector('details.statement').open")
    lines = "document.querySelectorAll('details.statement[open] tbody tr').length"
    assert page.evaluate(lines) >= 2
    page.evaluate("window.scrollTo(0, 0)")  # else the sticky header lands mid-screenshot
    page.screenshot(path=str(ARTIFACTS / "billing-page-statement.png"), full_page=True)
    csp = [e for e in page.console_errors if "Content Security Policy" in e]
    assert not csp, page.console_errors
    assert period != page.evaluate("document.getElementById('billing-period').textContent")
    # The usage detail page of one request.
    page.goto(base + "/billing/usage/seed-1/")
    assert "Price in force" in page.content()
