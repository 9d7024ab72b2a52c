"""Browser tests: headless Debian Chromium (Playwright driver) against a real uvicorn server.

Skipped only when /usr/bin/chromium (or playwright) is missing and CI is not "true"; in CI a
missing browser fails. Screenshots go to test-artifacts/.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = os.environ.get("BATON_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PASSWORD = "browser-operator-pw"

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def _missing() -> str | None:
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        return f"{CHROMIUM} is missing (apt-get install -y chromium)"
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "the playwright package is not installed"
    return None


@contextmanager
def serving(var: Path, seed: Callable[[Callable[..., str]], object], **env_extra: str):
    """A migrated database in `var`, filled by `seed(run)` (``run("seed_demo")``), an operator
    ``ops``, and uvicorn serving it; yields ``{"base": URL, "run": manage.py runner}``."""
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL"}} | {
        "BATON_VAR_DIR": str(var),
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        **env_extra,
    }
    manage = [sys.executable, str(ROOT / "manage.py")]

    def run(*args: str) -> str:
        out = subprocess.run(
            [*manage, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, f"{args}: {out.stderr[-2000:]}"
        return out.stdout

    run("migrate", "--noinput")
    seed(run)
    run("baton_user", "ops", "--role", "operator", "--password", PASSWORD)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The server keeps its own handle on the log; ours closes once it has started.
    with open(var / "uvicorn.log", "wb") as log:
        proc = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "uvicorn"),
                "controlplane.asgi:application",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(base + "/healthz", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("uvicorn did not start: " + (var / "uvicorn.log").read_text()[-2000:])
            time.sleep(0.3)
    try:
        yield {"base": base, "run": run}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def need_browser() -> None:
    """Skip (fail in CI) when Chromium or playwright is missing."""
    reason = _missing()
    if reason:
        if os.environ.get("CI", "") == "true":
            pytest.fail(f"browser tests need Chromium in CI: {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    need_browser()
    with serving(tmp_path_factory.mktemp("browser-var"), lambda run: run("seed_demo")) as s:
        yield s


@pytest.fixture
def page(server):
    with browser_page() as p:
        yield p


@contextmanager
def browser_page():
    """A page of headless Chromium at 1366x800; ``page.console_errors`` collects its errors."""
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(viewport={"width": 1366, "height": 800})
        page = context.new_page()
        page.set_default_timeout(60_000)
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.console_errors = errors  # type: ignore[attr-defined]
        yield page
        context.close()
        browser.close()


def wait_js(page, expression: str, arg=None, timeout_s: float = 60.0) -> None:
    """Wait until `expression` is truthy in the page. Playwright's wait_for_function compiles
    the expression inside the page, which the UI's Content-Security-Policy (no eval) refuses;
    page.evaluate goes through the DevTools protocol, which the policy does not cover."""
    deadline = time.monotonic() + timeout_s
    while not (page.evaluate(expression) if arg is None else page.evaluate(expression, arg)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not true within {timeout_s} s: {expression}")
        page.wait_for_timeout(100)


def login(page, base: str) -> None:
    page.goto(base + "/")
    assert "/login/" in page.url
    page.fill("input[name=username]", "ops")
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(base + "/")


def metric(page, name: str) -> str:
    return page.locator(f'[data-metric="{name}"]').first.inner_text()


def test_overview_goes_live_and_moves_with_traffic(server, page):
    base = server["base"]
    login(page, base)
    page.wait_for_selector("body[data-ws=open]")
    wait_js(page, "Number(document.body.dataset.snapshots || 0) >= 1")
    assert page.locator("#chart-ttft .uplot").count() == 1
    before = metric(page, "requests")
    page.screenshot(path=str(ARTIFACTS / "overview-before-traffic.png"), full_page=True)

    server["run"]("telemetry_synthetic", "--count", "300", "--seed", "11")
    wait_js(
        page,
        "(b) => document.querySelector('[data-metric=requests]').textContent !== b",
        arg=before,
    )
    wait_js(page, "document.querySelector('[data-metric=rps]').textContent !== '0.00'")
    assert metric(page, "requests") == "300 requests"
    assert metric(page, "ttft") != "– / –"
    assert "%" in metric(page, "share")
    page.screenshot(path=str(ARTIFACTS / "overview-after-traffic.png"), full_page=True)
    assert page.console_errors == []


def test_fleet_page_shows_the_topology_and_live_state(server, page):
    base = server["base"]
    login(page, base)
    page.goto(base + "/fleet/")
    page.wait_for_selector("body[data-ws=open]")
    wait_js(page, "Number(document.body.dataset.snapshots || 0) >= 1")
    svg = page.locator("svg#topology")
    assert svg.locator("g.dc").count() == 2
    assert svg.locator("g.link").count() == 1
    assert svg.locator("g.grp").count() == 3  # one group per (datacenter, role, GPU type)
    assert "Gbit/s" in svg.locator("g.link").text_content()
    assert page.locator("#instances button[data-action=drain]").count() == 3
    page.locator("#instances button[data-action=drain]").first.click()
    wait_js(page, "document.getElementById('action-result').textContent.length > 0")
    assert "drain requested" in page.locator("#action-result").inner_text()
    page.screenshot(path=str(ARTIFACTS / "fleet.png"), full_page=True)
    page.goto(base + "/requests/?pipeline=p-rld-md")
    assert page.locator("#request-log tbody tr").count() >= 1
    page.screenshot(path=str(ARTIFACTS / "requests.png"), full_page=True)
    assert page.console_errors == []


def shot(page, name: str) -> None:
    page.evaluate("window.scrollTo(0, 0)")  # the sticky header stays at the top of the shot
    page.screenshot(path=str(ARTIFACTS / f"walk-{name}.png"), full_page=True)


def test_walk_overview_requests_detail_and_fleet_edit(server, page):
    """An operator's walk: overview -> request log -> one request's timeline -> add a WAN link
    through the fleet form (first with an error) -> the link on the topology."""
    base = server["base"]
    server["run"]("telemetry_synthetic", "--count", "120", "--seed", "21")
    login(page, base)
    page.wait_for_selector("body[data-ws=open]")
    wait_js(page, "Number(document.body.dataset.snapshots || 0) >= 1")
    wait_js(page, "document.querySelector('[data-metric=ttft]').textContent !== '– / –'")
    # value and unit never part: no-break spaces; the TTFT legend names the line styles
    assert "\u00a0" in metric(page, "ttft")
    legend = page.locator("#legend-ttft")
    assert legend.locator("[data-percentile]").all_inner_texts() == ["P50", "P90", "P99"]
    assert legend.locator("[data-percentile=P90] line").get_attribute("stroke-dasharray")
    assert page.request.get(base + "/favicon.ico").status == 200
    shot(page, "1-overview")

    page.click("header nav a:has-text('Requests')")
    page.wait_for_selector("#request-log tbody tr")
    page.select_option("#request-filters select[name=pipeline]", "p-rld-md")
    page.click("#request-filters button[type=submit]")
    page.wait_for_url("**/requests/?*pipeline=p-rld-md*")
    first = page.locator("#request-log tbody tr").first.locator("td").nth(1).locator("a").first
    rid = first.inner_text()
    assert rid.startswith("syn-") and len(rid) == 24  # the whole id
    row_h = page.evaluate(
        "Math.max(...[...document.querySelectorAll('#request-log tbody tr')]"
        ".map((r) => r.getBoundingClientRect().height))"
    )
    assert row_h < 60, row_h  # the reason no longer makes rows tall
    shot(page, "2-requests")
    page.evaluate("document.querySelector('section.card .scroll').scrollLeft = 1e6")
    page.locator("section.card .scroll").screenshot(
        path=str(ARTIFACTS / "walk-2b-requests-right.png")
    )
    page.evaluate("document.querySelector('section.card .scroll').scrollLeft = 0")

    first.click()
    page.wait_for_url(f"{base}/requests/{rid}/")
    page.wait_for_selector("svg.timeline")
    assert page.locator("#request-id").inner_text() == rid
    lanes = page.locator("svg.timeline g.lane").evaluate_all(
        "(gs) => gs.map((g) => g.getAttribute('data-lane'))"
    )
    assert lanes[:4] == ["P prefill", "KV intra-DC", "KV WAN", "RLD decode"]
    assert "to the user" in lanes
    assert page.locator("#decision .reason-full").inner_text().startswith("[synthetic]")
    assert page.locator("#tokens-by-role").inner_text().startswith("P 1 + RLD ")
    shot(page, "3-request-detail")

    page.goto(base + "/fleet/")
    page.click("#fleet-config-link")
    page.wait_for_url(base + "/fleet/config/")
    page.click("#add-link")
    page.wait_for_selector("#fleet-form")
    # an error first: a link from dc-b to itself, shown on its field
    page.select_option("select[name=from_datacenter]", label="dc-b (city-b)")
    page.select_option("select[name=to_datacenter]", label="dc-b (city-b)")
    page.fill("input[name=bandwidth_gbps]", "0.06")
    page.fill("input[name=rtt_ms]", "42")
    page.click("#fleet-form button[type=submit]")
    page.wait_for_selector("#to_datacenter-errors")
    assert "different datacenters" in page.locator("#to_datacenter-errors").inner_text()
    assert page.locator("input[name=bandwidth_gbps]").input_value() == "0.06"  # kept
    shot(page, "4-link-form-error")
    page.select_option("select[name=to_datacenter]", label="dc-a (city-a)")
    page.click("#fleet-form button[type=submit]")
    page.wait_for_url(base + "/fleet/config/#links")
    assert "added" in page.locator(".messages").inner_text()
    assert page.locator('#links tr[data-link="dc-b->dc-a"]').count() == 1
    shot(page, "5-fleet-config")

    page.goto(base + "/fleet/")
    page.wait_for_selector("body[data-ws=open]")
    new = page.locator('svg#topology g.link[data-link="dc-b->dc-a"]')
    assert new.count() == 1
    assert "0.06 Gbit/s" in new.text_content()
    assert page.locator('#links tr[data-link="dc-b->dc-a"]').count() == 1
    shot(page, "6-fleet-topology")
    # the one refused form answered 400 (as the API does); nothing else failed
    assert [e for e in page.console_errors if "400 (Bad Request)" not in e] == []


def test_a_sizing_run_started_on_the_planner_page_shows_its_answer(server, page):
    """The /planner/ sizing form (operator): tiny-size with the scenario's rate and SLA runs in
    seconds; the page follows the run and shows the cheapest fleet's table."""
    base = server["base"]
    login(page, base)
    page.goto(base + "/planner/")
    page.locator("#size-form button[type=submit]").click()
    page.wait_for_selector("#size-cheapest tbody tr", timeout=120_000)
    rows = page.locator("#size-cheapest tbody tr")
    assert rows.count() >= 2  # a pool per role
    assert "Cheapest fleet" in page.locator("#size-answer").inner_text()
    page.locator("#sizing").screenshot(path=str(ARTIFACTS / "planner-sizing.png"))
