"""Overview fixes that need no browser: the favicon, the TTFT legend's slot, the chart order."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.contrib.auth.models import User

STATIC = Path(__file__).resolve().parents[2] / "frontend" / "static" / "frontend"


def test_the_favicon_is_served(client, db):
    response = client.get("/favicon.ico")
    assert response.status_code == 200
    assert response["Content-Type"] == "image/svg+xml"
    assert b"<svg" in response.content


@pytest.mark.django_db
def test_pages_name_the_icon_and_the_ttft_legend(client):
    client.force_login(User.objects.create_user("ovo", password="x-pw-1234"))
    html = client.get("/").content.decode()
    assert 'rel="icon" type="image/svg+xml" href="/static/frontend/favicon.svg"' in html
    assert 'id="legend-ttft"' in html


def test_the_scripts_keep_units_with_values_and_requests_visible_over_goodput():
    baton = (STATIC / "baton.js").read_text()
    overview = (STATIC / "overview.js").read_text()
    assert 'NBSP + "s"' in baton and 'NBSP + "ms"' in baton
    # requests/s is drawn after (over) goodput, dashed
    goodput = overview.index('label: "goodput"')
    rps = overview.index('label: "requests/s"')
    assert goodput < rps and "dash: [6, 4]" in overview[rps - 80 : rps + 80]
    assert "charts.rps.push(t, [p.goodput_rps, p.rps])" in overview
    # an idle window shows no share rather than 0 / 100
    assert '"no tokens decoded"' in overview
