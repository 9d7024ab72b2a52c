"""Browser test at scale: 64 nodes and 128 instances (tests/frontend/fleet_scale.py) on a real
server. The fleet page stays short and its topology legible; a group's drill-down keeps the
operator actions; the overview does not grow. Screenshots go to var/screens/ (git-ignored).

No wall-clock assertions: every wait is for a state of the page."""

from __future__ import annotations

import pytest

from tests.frontend import fleet_scale
from tests.frontend.test_browser import (
    ROOT,
    browser_page,
    login,
    need_browser,
    serving,
    wait_js,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]
SCREENS = ROOT / "var" / "screens"
MAX_PAGE_PX = 1600
MIN_FONT_PX = 11
DECLARE = "from tests.frontend import fleet_scale; print(fleet_scale.declare())"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The big fleet, with the embedded beat off: nothing reconciles its states meanwhile."""
    need_browser()

    def seed(run):
        assert "'instances': 128" in run("shell", "-c", DECLARE)

    with serving(tmp_path_factory.mktemp("browser-scale"), seed, BATON_EMBEDDED_BEAT="0") as s:
        yield s


@pytest.fixture
def page(server):
    with browser_page() as p:
        yield p


# The smallest text of the topology as drawn on screen: its font size times the SVG's scale.
SMALLEST_FONT = """() => {
  const svg = document.getElementById('topology');
  const scale = svg.getBoundingClientRect().width / svg.viewBox.baseVal.width;
  const sizes = [...svg.querySelectorAll('text, tspan')]
    .filter((t) => t.textContent.trim() && t.getBBox().width > 0)
    .map((t) => parseFloat(getComputedStyle(t).fontSize) * scale);
  return Math.min(...sizes);
}"""
PAGE_HEIGHT = "document.documentElement.scrollHeight"


def agg(page, group: str, name: str) -> str:
    return page.locator(f'#groups tr[data-group="{group}"] [data-agg="{name}"]').inner_text()


def test_the_fleet_page_at_scale_is_short_and_legible(server, page):
    base = server["base"]
    SCREENS.mkdir(parents=True, exist_ok=True)
    login(page, base)
    page.goto(base + "/fleet/")
    page.wait_for_selector("body[data-ws=open]")
    wait_js(page, "Number(document.body.dataset.snapshots || 0) >= 1")
    # the live recount (fleet.js, from the snapshot) agrees with the page as served
    expected = fleet_scale.expected()
    assert agg(page, "||", "instances") == "128"
    assert agg(page, "||", "nodes") == "64"
    md_b = expected[("dc-b", "main_decode", "gpu-b")]
    assert agg(page, "dc-b|main_decode|gpu-b", "load") == (
        f"{md_b['running']}/{md_b['max_running']}"
    )
    emulated = page.locator('#topology g[data-group="dc-b|main_decode|gpu-a"] .emu')
    assert emulated.text_content() == "12 emulated · "
    assert page.locator('#groups tr[data-group="dc-b|main_decode|gpu-a"] .badge').is_visible()
    assert page.locator('#groups tr[data-group="dc-b|main_decode|gpu-b"] .badge').is_hidden()
    assert (agg(page, "||", "cost"), agg(page, "||", "unpriced")) == ("736.40 USD", "10 unpriced")
    assert page.locator('#groups th[data-col="unavailable"]').is_hidden()
    assert page.locator("svg#topology g.grp").count() == 8
    assert page.locator("#instances").count() == 0

    height = page.evaluate(PAGE_HEIGHT)
    smallest = page.evaluate(SMALLEST_FONT)
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(SCREENS / "fleet-128-instances.png"), full_page=True)
    assert height < MAX_PAGE_PX, height
    assert smallest >= MIN_FONT_PX, smallest

    # a group of the topology opens its drill-down: its instances a page at a time, with the
    # operator's actions
    page.locator('#topology g[data-group="dc-b|main_decode|gpu-b"]').click()
    page.wait_for_url("**/fleet/?*gpu_type=gpu-b*")
    page.wait_for_selector("#drill #instances tbody tr")
    assert page.locator("#drill-count").inner_text() == "40"
    assert page.locator("#instances tbody tr").count() == 20
    assert "page 1 of 2" in page.locator("#drill .pager").inner_text()
    assert page.evaluate(PAGE_HEIGHT) < MAX_PAGE_PX + 1000  # the drill-down adds one page
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(SCREENS / "fleet-128-drill-down.png"), full_page=True)
    page.locator("#instances button[data-action=drain]").first.click()
    wait_js(page, "document.getElementById('action-result').textContent.length > 0")
    assert "drain requested" in page.locator("#action-result").inner_text()

    # an emulated group's drill-down says so on every row
    page.goto(base + "/fleet/?datacenter=dc-b&role=main_decode&gpu_type=gpu-a")
    page.wait_for_selector("#drill #instances tbody tr")
    assert page.locator("#instances tbody tr .badge.emulated").count() == 12
    assert page.console_errors == []


def test_the_overview_at_scale_stays_the_same_size(server, page):
    base = server["base"]
    SCREENS.mkdir(parents=True, exist_ok=True)
    login(page, base)
    page.wait_for_selector("body[data-ws=open]")
    wait_js(page, "Number(document.body.dataset.snapshots || 0) >= 1")
    wait_js(page, "document.querySelector('[data-metric=cost]').textContent !== '–'")
    height = page.evaluate(PAGE_HEIGHT)
    page.screenshot(path=str(SCREENS / "overview-128-instances.png"), full_page=True)
    assert height < MAX_PAGE_PX, height
    # running instances of dc-a x gpu-b have no price: counted, not listed
    assert page.locator('[data-metric="unpriced"]').inner_text() == "10 running without a price"
    # the fleet's instances in one card: counts, never a list
    assert page.locator('[data-metric="instances"]').inner_text() == "91 / 128"
    assert page.locator('[data-metric="instance_states"]').inner_text() == (
        "14 starting · 9 draining · 14 failed · 16 emulated"
    )
    assert page.console_errors == []
