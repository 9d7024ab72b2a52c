"""The fleet page at scale: 64 nodes and 128 instances are summarised by datacenter x role x
GPU type, exactly; a group's drill-down lists exactly its instances, a page at a time; no page
grows a row per instance outside the drill-down; emulated engines are labelled."""

from __future__ import annotations

from decimal import Decimal
from html.parser import HTMLParser

import pytest
from django.contrib.auth.models import Group, User

from tests.frontend import fleet_scale

VOID = {"input", "br", "meta", "link", "img", "hr", "col", "source", "wbr"}


class Node:
    def __init__(self, tag: str, attrs: dict[str, str | None], parent: Node | None):
        self.tag, self.attrs, self.parent = tag, attrs, parent
        self.children: list[Node | str] = []

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def iter(self):
        yield self
        for c in self.children:
            if isinstance(c, Node):
                yield from c.iter()

    def find_all(self, tag: str | None = None, **attrs: str | bool) -> list[Node]:
        out = []
        for n in self.iter():
            if tag is not None and n.tag != tag:
                continue
            ok = True
            for k, v in attrs.items():
                k = k.rstrip("_").replace("_", "-")  # class_ -> class, data_x -> data-x
                ok = ok and (k in n.attrs if v is True else n.attrs.get(k) == v)
            if ok:
                out.append(n)
        return out

    def find(self, tag: str | None = None, **attrs: str | bool) -> Node | None:
        found = self.find_all(tag, **attrs)
        return found[0] if found else None

    def agg(self) -> dict[str, str]:
        """``data-agg`` name -> text of the elements under this one (states keyed by state)."""
        out = {}
        for n in self.iter():
            name = n.attrs.get("data-agg")
            if name == "state":
                out["state:" + str(n.attrs["data-state"])] = n.text().strip()
            elif name:
                out[name] = n.text().strip()
        return out


class Tree(HTMLParser):
    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.root = Node("#root", {}, None)
        self.cur = self.root
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        node = Node(tag, dict(attrs), self.cur)
        self.cur.children.append(node)
        if tag not in VOID:
            self.cur = node

    def handle_startendtag(self, tag, attrs):
        self.cur.children.append(Node(tag, dict(attrs), self.cur))

    def handle_endtag(self, tag):
        n = self.cur
        while n is not None and n.tag != tag:
            n = n.parent
        if n is not None and n.parent is not None:
            self.cur = n.parent

    def handle_data(self, data):
        self.cur.children.append(data)


def parse(response) -> Node:
    assert response.status_code == 200
    return Tree(response.content.decode()).root


@pytest.fixture
def operator(db):
    user = User.objects.create_user("olga", password="pw-operator-1")
    user.groups.add(Group.objects.get_or_create(name="operator")[0])
    return user


@pytest.fixture
def viewer(db):
    user = User.objects.create_user("vic", password="pw-viewer-1")
    user.groups.add(Group.objects.get_or_create(name="viewer")[0])
    return user


@pytest.fixture
def big_fleet(db):
    made = fleet_scale.declare()
    assert made == {"nodes": 64, "instances": 128}
    return fleet_scale.expected()


def key(dc: str, role: str, gpu: str) -> str:
    return f"{dc}|{role}|{gpu}"


def cost_text(cost: Decimal, priced: bool) -> str:
    return f"{cost:.2f} USD" if priced else "–"


def test_the_plan_covers_what_the_page_must_handle():
    exp = fleet_scale.expected()
    assert sum(g["instances"] for g in exp.values()) == 128
    assert sum(g["nodes"] for g in exp.values()) == 64
    assert {k[0] for k in exp} == {"dc-a", "dc-b"} and {k[2] for k in exp} == {"gpu-a", "gpu-b"}
    assert {k[1] for k in exp} == {"prefill", "relay_decode", "main_decode"}
    # a known mix: a few failed, starting and draining, 16 emulated, one node offline
    states = sum((g["states"] for g in exp.values()), start=type(exp[next(iter(exp))]["states"])())
    assert states == {"running": 91, "failed": 14, "starting": 14, "draining": 9}
    assert sum(g["emulated"] for g in exp.values()) == 16
    assert sum(g["offline"] for g in exp.values()) == 1


def test_the_fleet_page_counts_every_group_exactly(client, operator, big_fleet):
    client.force_login(operator)
    page = parse(client.get("/fleet/"))
    table = page.find("table", id="groups")
    rows = {tr.attrs["data-group"]: tr for tr in table.find("tbody").find_all("tr")}
    assert set(rows) == {key(*k) for k in big_fleet}
    for (dc, role, gpu), exp in big_fleet.items():
        got = rows[key(dc, role, gpu)].agg()
        assert got["instances"] == str(exp["instances"]), (dc, role, gpu)
        assert got["nodes"] == str(exp["nodes"])
        assert got["gpus"] == str(exp["gpus"])
        assert got["emulated"] == str(exp["emulated"])
        for state in ("running", "pending", "starting", "draining", "failed", "unavailable"):
            assert got["state:" + state] == str(exp["states"][state]), (dc, role, gpu, state)
        assert got["load"] == f"{exp['running']}/{exp['max_running']}"
        assert got["queued"] == str(exp["queued"])
        priced = (dc, gpu) in fleet_scale.PRICES
        assert got["cost"] == cost_text(exp["cost"], priced), (dc, role, gpu)
        unpriced = rows[key(dc, role, gpu)].find(data_agg="unpriced")
        assert ("hidden" in unpriced.attrs) == priced
        assert got["unpriced"] == f"{0 if priced else exp['states']['running']} unpriced"
        badge = rows[key(dc, role, gpu)].find(data_agg="emulated-badge")
        assert ("hidden" in badge.attrs) == (exp["emulated"] == 0)
    # the one offline node is counted on its group's row
    assert "1 offline" in rows[key("dc-b", "main_decode", "gpu-b")].text()
    # a few exact figures, written out
    md_b = rows[key("dc-b", "main_decode", "gpu-b")].agg()
    assert (md_b["instances"], md_b["nodes"], md_b["state:failed"]) == ("40", "20", "5")
    assert md_b["cost"] == "280.00 USD"  # 28 running x 4 GPUs x 2.50
    assert rows[key("dc-a", "main_decode", "gpu-b")].agg()["cost"] == "–"
    assert rows[key("dc-a", "main_decode", "gpu-b")].agg()["unpriced"] == "5 unpriced"

    # totals: one per role, one per GPU type, the whole fleet
    totals = {tr.attrs["data-group"]: tr.agg() for tr in table.find("tfoot").find_all("tr")}
    assert list(totals) == [
        "|prefill|",
        "|relay_decode|",
        "|main_decode|",
        "||gpu-a",
        "||gpu-b",
        "||",
    ]
    assert totals["|prefill|"]["instances"] == "44"
    assert totals["|relay_decode|"]["instances"] == "24"
    assert totals["|main_decode|"]["instances"] == "60"
    assert totals["||gpu-a"]["instances"] == "60" and totals["||gpu-b"]["instances"] == "68"
    fleet = totals["||"]
    assert (fleet["instances"], fleet["nodes"], fleet["gpus"]) == ("128", "64", "512")
    assert (fleet["state:running"], fleet["state:failed"], fleet["state:starting"]) == (
        "91",
        "14",
        "14",
    )
    assert fleet["state:draining"] == "9" and fleet["emulated"] == "16"
    assert (fleet["cost"], fleet["unpriced"]) == ("736.40 USD", "10 unpriced")
    # states no instance is in are left out of the table; the others are shown
    hidden = {
        th.attrs["data-col"] for th in table.find("thead").find_all("th") if "hidden" in th.attrs
    }
    assert hidden == {"pending", "drained", "stopped", "unavailable"}

    # the topology draws the same groups, one row each, inside their datacenter
    svg = page.find("svg", id="topology")
    drawn = {g.attrs["data-group"]: g for g in svg.find_all("g", data_group=True)}
    assert set(drawn) == set(rows)
    for (dc, role, gpu), exp in big_fleet.items():
        g = drawn[key(dc, role, gpu)]
        box = g
        while box.attrs.get("class") != "dc":
            box = box.parent
        assert box.attrs["data-dc"] == dc
        got = g.agg()
        assert got["instances"] == str(exp["instances"]) and got["nodes"] == str(exp["nodes"])
        assert got["emulated-text"] == (f"{exp['emulated']} emulated ·" if exp["emulated"] else "")
        states = " · ".join(
            f"{exp['states'][s]} {s}"
            for s in ("running", "starting", "draining", "failed")
            if exp["states"][s]
        )
        assert got["states"] == states
        widths = {
            r.attrs["data-seg"]: float(r.attrs["width"]) for r in g.find_all("rect", data_seg=True)
        }
        bar = float(g.find(data_agg="bar").attrs["data-w"])
        assert widths["failed"] == pytest.approx(
            bar * exp["states"]["failed"] / exp["instances"], abs=0.1
        )

    # no row per instance anywhere: no instance list, no per-instance element
    assert page.find("table", id="instances") is None and page.find(id="drill") is None
    assert page.find_all(data_instance=True) == []
    assert len(page.find_all("tr")) < 30
    assert "dc-b-md-gpu-b-01" not in str(client.get("/fleet/").content)


def group_ids(dc: str, role: str, gpu: str, **extra) -> set[int]:
    from fleet.models import Instance

    qs = Instance.objects.filter(node__datacenter__name=dc, role=role, node__gpu_type__model=gpu)
    return set(qs.filter(**extra).values_list("pk", flat=True))


def drill(client, query: str) -> tuple[Node, list[Node]]:
    page = parse(client.get("/fleet/?" + query))
    section = page.find("section", id="drill")
    assert section is not None
    return section, section.find("table", id="instances").find("tbody").find_all("tr")


def test_the_drill_down_lists_exactly_the_groups_instances(client, operator, big_fleet):
    client.force_login(operator)
    q = "datacenter=dc-b&role=main_decode&gpu_type=gpu-b"
    section, rows = drill(client, q)
    assert section.find("b", id="drill-count").text() == "40"
    assert len(rows) == 20  # a page at a time
    seen = {int(r.attrs["data-instance"]) for r in rows}
    assert all(len(r.find_all("button", data_action="drain")) == 1 for r in rows)
    assert all(len(r.find_all("button", data_action="start")) == 1 for r in rows)
    pager = section.find("nav")
    assert "page 1 of 2" in pager.text()
    _, rows2 = drill(client, q + "&page=2")
    seen2 = {int(r.attrs["data-instance"]) for r in rows2}
    assert len(rows2) == 20 and not seen & seen2
    assert seen | seen2 == group_ids("dc-b", "main_decode", "gpu-b")
    # its nodes: all 20, the offline one marked
    chips = section.find(id="drill-nodes").find_all("span", class_=True)
    hosts = [c for c in chips if "chip" in c.attrs["class"].split()]
    assert len(hosts) == 20
    offline = [c for c in hosts if "node-offline" in c.attrs["class"]]
    assert [c.text().split()[0] for c in offline] == [fleet_scale.OFFLINE_NODE]
    # the group's row in the summary is marked as the one open
    page = parse(client.get("/fleet/?" + q))
    picked = [tr for tr in page.find_all("tr") if "picked" in tr.attrs.get("class", "").split()]
    assert [tr.attrs["data-group"] for tr in picked] == ["dc-b|main_decode|gpu-b"]


def test_a_drill_down_by_state_and_by_engine(client, operator, big_fleet):
    client.force_login(operator)
    _, rows = drill(client, "datacenter=dc-a&role=prefill&gpu_type=gpu-a&state=failed")
    ids = {int(r.attrs["data-instance"]) for r in rows}
    assert ids == group_ids("dc-a", "prefill", "gpu-a", actual_state="failed")
    assert len(ids) == 3
    # an emulated group: every row says so; a mixed group, only its emulated instances
    _, rows = drill(client, "datacenter=dc-b&role=main_decode&gpu_type=gpu-a")
    assert len(rows) == 12
    assert all(r.attrs["data-engine"] == "emulated" for r in rows)
    assert all(r.find(data_field="engine").text().strip() == "emulated" for r in rows)
    section, rows = drill(client, "datacenter=dc-a&role=prefill&gpu_type=gpu-b")
    assert len(rows) == 8
    assert (
        sorted(r.find(data_field="engine").text().strip() for r in rows)
        == [""] * 4 + ["emulated"] * 4
    )
    assert "4 emulated" in section.text()
    _, rows = drill(client, "datacenter=dc-a&role=prefill&gpu_type=gpu-b&engine=emulated")
    assert len(rows) == 4 and all(r.attrs["data-engine"] == "emulated" for r in rows)


def test_the_instance_page_names_its_engine(client, viewer, big_fleet):
    from fleet.models import Instance

    client.force_login(viewer)
    emulated = Instance.objects.filter(node__hostname="dc-b-md-gpu-a-01").first()
    page = parse(client.get(f"/fleet/instances/{emulated.pk}/"))
    assert page.find(id="engine").text().strip() == "emulated"
    assert page.find(id="engine").find(class_="badge emulated") is not None
    torch = Instance.objects.filter(node__hostname="dc-b-md-gpu-b-01").first()
    page = parse(client.get(f"/fleet/instances/{torch.pk}/"))
    assert page.find(id="engine").text().strip() == "torch"


def test_partial_filters_totals_and_errors(client, viewer, big_fleet):
    client.force_login(viewer)
    section, rows = drill(client, "role=relay_decode")
    assert section.find("b", id="drill-count").text() == "24"
    assert len(rows) == 20
    assert section.find_all("button") == []  # viewers get no actions
    section, rows = drill(client, "all=1&page=7")
    assert section.find("b", id="drill-count").text() == "128"
    assert len(rows) == 8  # the last page
    assert section.find(id="drill-close") is not None
    section, rows = drill(client, "role=bogus")
    assert "No instances match" in rows[0].text()
    assert "role" in section.text()


def test_a_small_fleet_is_listed_whole_with_its_actions(client, operator, fleet):
    client.force_login(operator)
    page = parse(client.get("/fleet/"))
    section = page.find("section", id="drill")
    assert section.find("h2").text() == "All instances"
    rows = section.find("table", id="instances").find("tbody").find_all("tr")
    assert {int(r.attrs["data-instance"]) for r in rows} == {
        fleet[k].pk for k in ("prefill", "relay", "main")
    }
    assert len(section.find_all("button", data_action="drain")) == 3
    assert section.find(id="drill-close") is None  # nothing to close: no filter
    # totals that would repeat a row are left out: per role (one group each), not gpu-a's
    totals = [tr.attrs["data-group"] for tr in page.find("tfoot").find_all("tr")]
    assert totals == ["||gpu-a", "||"]
    # no emulated instance: no engine column, no badge (today's agents send no engine kind)
    assert "hidden" in page.find("th", data_col="emulated").attrs
    assert section.find_all(class_="badge emulated") == []


def test_the_overview_does_not_grow_with_the_fleet(client, operator, fleet):
    from fleet.models import Instance

    client.force_login(operator)
    small = client.get("/").content.decode()
    Instance.objects.all().delete()
    fleet_scale_free = len(client.get("/").content.decode())
    assert abs(len(small) - fleet_scale_free) < 200  # nothing per instance on the page


def test_the_overview_at_scale_names_no_instance(client, operator, big_fleet):
    client.force_login(operator)
    html = client.get("/").content.decode()
    assert "data-instance" not in html and "dc-a-p-gpu-a-01" not in html
    assert html.count("<tr") < 10


@pytest.mark.parametrize(
    ("report", "node_report", "kind"),
    [
        ({}, None, "torch"),
        (None, None, "torch"),
        ({"engine": "emulated"}, None, "emulated"),
        ({"engine": "Torch"}, None, "torch"),
        ({"engine": {"tokens_computed": 3, "busy_s": 1.0}}, None, "torch"),  # today's stats
        ({"engine": {"kind": "emulated", "busy_s": 1.0}}, None, "emulated"),
        ({"engine_kind": "emulated"}, None, "emulated"),
        ({"engine": 7}, None, "torch"),
        ({}, {"engine_options": {"engine": "emulated"}}, "emulated"),
        ({"engine": "torch"}, {"engine_options": {"engine": "emulated"}}, "torch"),
        ({}, {"engine_options": "odd"}, "torch"),
        # the agent's own field, next to its stats object
        ({"engine_kind": "emulated", "engine": {"busy_s": 2.0}}, None, "emulated"),
        ({"engine_kind": "torch", "engine": {"busy_s": 2.0}}, None, "torch"),
    ],
)
def test_engine_kind_is_read_defensively(report, node_report, kind):
    from frontend.telemetry.fleet import engine_kind

    assert engine_kind(report, node_report) == kind


def test_engine_kind_before_any_heartbeat_follows_the_served_models_source():
    from frontend.telemetry.fleet import engine_kind

    assert engine_kind({}, None, "profile:paper-dsv4") == "emulated"
    assert engine_kind({}, None, "baton-tiny") == "torch"
    assert engine_kind({"engine_kind": "torch"}, None, "profile:paper-dsv4") == "torch"


def test_the_snapshot_carries_each_instances_engine(big_fleet):
    from frontend.telemetry.fleet import fleet_state

    engines = [i["engine"] for i in fleet_state().instances]
    assert engines.count("emulated") == 16 and engines.count("torch") == 112


def test_an_empty_fleet_and_an_empty_datacenter(client, operator, db):
    from fleet.models import Datacenter

    client.force_login(operator)
    page = parse(client.get("/fleet/"))
    assert "No instances yet." in page.find("table", id="groups").text()
    assert page.find("tfoot") is None and page.find(id="drill") is None
    Datacenter.objects.create(name="dc-z", region="city-z")
    page = parse(client.get("/fleet/"))
    box = page.find("g", data_dc="dc-z")
    assert "no instances" in box.text() and "0 instances · 0 nodes" in box.text()


def test_four_datacenters_draw_as_two_linked_pairs_one_pair_a_row(db):
    from fleet.models import Datacenter, WANLink
    from frontend.selectors import topology_layout

    dcs = {n: Datacenter.objects.create(name=n, region=n) for n in ("a", "b", "c", "d")}
    WANLink.objects.create(
        from_datacenter=dcs["c"], to_datacenter=dcs["d"], bandwidth_gbps=1, rtt_ms=1
    )
    WANLink.objects.create(
        from_datacenter=dcs["a"], to_datacenter=dcs["b"], bandwidth_gbps=1, rtt_ms=1
    )
    layout = topology_layout([])
    where = {b["dc"].name: (b["x"], b["y"]) for b in layout["boxes"]}
    assert where["c"][1] == where["d"][1] and where["a"][1] == where["b"][1]
    assert where["c"][1] != where["a"][1]
    assert where["c"][0] < where["d"][0] and where["a"][0] < where["b"][0]
    assert all(link["y1"] == link["y2"] for link in layout["links"])  # each link within its row
