/* Overview: headline figures for the chosen window and live charts fed by the socket. */
(function () {
  "use strict";
  const B = window.Baton;
  const PIPES = [["p-md", "P-MD", "#2563eb"], ["p-rld-md", "P-RLD-MD", "#dc2626"], ["rld-only", "RLD only", "#9333ea"]];
  const PCT = [["P50", [1, 0]], ["P90", [6, 3]], ["P99", [2, 2]]];
  let windowName = "1m";
  const labels = { "1m": "last minute", "5m": "last 5 minutes", "1h": "last hour" };
  const charts = {};
  let wanLinks = null;

  function set(name, text) { document.querySelectorAll('[data-metric="' + name + '"]').forEach((el) => { el.textContent = text; }); }

  function headline(snap) {
    const w = snap.windows[windowName];
    const ttft = w.ttft.all || {};
    const models = Object.keys(w.sla_met);
    set("rps", B.num(w.rps)); set("requests", w.requests + " requests");
    set("goodput_rps", B.num(w.goodput_rps));
    set("sla", models.length ? models.map((m) => m + (w.sla_met[m] ? " meets SLA" : " misses SLA")).join(", ") : "SLA: no traffic");
    set("ttft", B.secs(ttft.p90) + " / " + B.secs(ttft.p99)); set("ttft_p50", "P50 " + B.secs(ttft.p50));
    set("kv_wait", B.secs(((w.kv_wait || {}).all || {}).p90));
    set("max_gap", "prefill P90 " + B.secs(((w.prefill || {}).all || {}).p90) + " · stall P99 " + B.secs(((w.max_gap || {}).all || {}).p99));
    set("tpot", B.secs((w.tpot.all || {}).p50)); set("e2e", "E2E P90 " + B.secs((w.e2e.all || {}).p90));
    set("cost", B.num(snap.fleet.cost_per_hour, 2) + B.NBSP + snap.fleet.currency);
    set("unpriced", snap.fleet.unpriced_instances.length ? snap.fleet.unpriced_instances.length + " running without a price" : "");
    set("bcr", w.bcr === null ? "–" : B.num(w.bcr, 4));
    // No decoded tokens in the window (idle, or only one-token answers): no share, not 0 / 100.
    const decoded = (w.tokens.rld || 0) + (w.tokens.md || 0);
    set("share", decoded && w.rld_share !== null ? B.pct(w.rld_share) + " / " + B.pct(w.md_share) : "–");
    set("tokens", decoded ? w.tokens.rld + " RLD · " + w.tokens.md + " MD tokens" : "no tokens decoded");
    set("cache", B.pct(w.cache_hit_rate));
    const links = Object.entries(w.wan);
    set("wan", links.length ? "WAN " + links.map(([k, v]) => k + " " + B.pct(v.utilisation)).join(", ") : "WAN idle");
    queue(snap.queue);
  }

  /* The gateway's overload queue in this process: waiting now, then how it went so far. */
  function queue(q) {
    if (!q) return;
    set("queue", String(q.waiting + q.at_prefill));
    const parts = [q.waiting + " at the gateway", q.at_prefill + " in a prefill queue"];
    if (q.queued_total) parts.push("mean wait " + B.secs(q.mean_wait_s));
    if (q.timed_out_total || q.refused_total) parts.push(q.timed_out_total + " timed out · " + q.refused_total + " refused");
    set("queue_detail", parts.join(" · "));
  }

  /* The fleet in one card whatever its size: running of all instances, then the other states
     with instances in them, and how many run an emulated engine. */
  const OTHER_STATES = ["pending", "starting", "draining", "drained", "stopped", "unavailable", "failed"];
  function instances(snap) {
    const all = snap.fleet.instances || [];
    const count = {};
    let emulated = 0;
    all.forEach((i) => { count[i.actual_state] = (count[i.actual_state] || 0) + 1; if (i.engine === "emulated") emulated += 1; });
    set("instances", (count.running || 0) + " / " + all.length);
    const parts = OTHER_STATES.filter((s) => count[s]).map((s) => count[s] + " " + s);
    if (emulated) parts.push(emulated + " emulated");
    set("instance_states", all.length ? (parts.length ? parts.join(" · ") : "all running") : "no instances");
  }

  function ttftValues(p) {
    const out = [];
    PIPES.forEach(([key]) => PCT.forEach((_, i) => { const v = p.ttft[key]; out.push(v ? v[i] : null); }));
    return out;
  }

  /* The TTFT chart's legend: colour = pipeline, line style = percentile (9 lines, 6 keys). */
  function ttftLegend(root) {
    if (!root) return;
    const NS = "http://www.w3.org/2000/svg";
    function item(label, color, dash) {
      const span = document.createElement("span");
      span.className = "key";
      const svg = document.createElementNS(NS, "svg");
      svg.setAttribute("width", "28"); svg.setAttribute("height", "10");
      const line = document.createElementNS(NS, "line");
      line.setAttribute("x1", "1"); line.setAttribute("x2", "27"); line.setAttribute("y1", "5"); line.setAttribute("y2", "5");
      line.setAttribute("stroke", color); line.setAttribute("stroke-width", "2");
      if (dash && dash[1]) line.setAttribute("stroke-dasharray", dash.join(" "));
      svg.appendChild(line);
      span.appendChild(svg);
      span.appendChild(document.createTextNode(label));
      return span;
    }
    PIPES.forEach(([key, label, color]) => { const s = item(label, color, null); s.dataset.pipeline = key; root.appendChild(s); });
    const sep = document.createElement("span"); sep.className = "sep"; root.appendChild(sep);
    PCT.forEach(([label, dash]) => { const s = item(label, "#334155", dash); s.dataset.percentile = label; root.appendChild(s); });
  }

  function makeCharts(links) {
    const el = (id) => document.getElementById(id);
    const ttftSeries = [];
    PIPES.forEach(([, label, color]) => PCT.forEach(([pl, dash]) => ttftSeries.push({ label: label + " " + pl, stroke: color, dash })));
    charts.ttft = B.liveChart(el("chart-ttft"), ttftSeries, { legend: false });
    ttftLegend(el("legend-ttft"));
    // Goodput is drawn first (filled), requests/s dashed on top: equal when every request meets
    // its SLA, and both stay visible.
    const rpsSeries = [{ label: "goodput", stroke: "#16a34a", fill: "rgba(22,163,74,.10)", width: 2.5 }, { label: "requests/s", stroke: "#334155", dash: [6, 4], width: 1.5 }];
    charts.rps = B.liveChart(el("chart-rps"), rpsSeries);
    charts.share = B.liveChart(el("chart-share"), [{ label: "RLD %", stroke: "#dc2626" }, { label: "MD %", stroke: "#2563eb" }], { y: { range: [0, 100] } });
    charts.bcr = B.liveChart(el("chart-bcr"), [{ label: "BCR", stroke: "#0d9488" }]);
    const colors = ["#ea580c", "#7c3aed", "#0891b2", "#be123c"];
    wanLinks = links;
    charts.wan = B.liveChart(el("chart-wan"), links.map((l, i) => ({ label: l + " %", stroke: colors[i % colors.length] })), { y: { range: [0, 100] } });
    charts.day = B.liveChart(el("chart-day"), rpsSeries, { cap: 1440 });
  }

  function feed(p) {
    const t = p.t;
    charts.ttft.push(t, ttftValues(p));
    charts.rps.push(t, [p.goodput_rps, p.rps]);
    charts.share.push(t, [p.rld_share === null ? null : p.rld_share * 100, p.md_share === null ? null : p.md_share * 100]);
    charts.bcr.push(t, [p.bcr]);
    charts.wan.push(t, wanLinks.map((l) => (p.wan[l] === undefined || p.wan[l] === null ? 0 : p.wan[l] * 100)));
  }

  let pendingHistory = null;
  B.on("history", (msg) => { if (msg.scale === "live") pendingHistory = msg.points; });
  B.on("snapshot", (snap) => {
    if (!charts.ttft) {
      makeCharts(snap.fleet.links.map((l) => l.name));
      (pendingHistory || []).forEach(feed);
      pendingHistory = null;
      loadDay();
    }
    headline(snap);
    instances(snap);
    feed(snap.point);
  });

  async function loadDay() {
    try {
      const res = await fetch("/telemetry/history/?scale=day", { credentials: "same-origin" });
      const body = await res.json();
      charts.day.reset(body.points.map((p) => [p.t, [p.goodput_rps, p.rps]]));
    } catch (err) { console.warn("day history unavailable", err); }
  }
  setInterval(() => { if (charts.day) loadDay(); }, 60000);

  document.querySelectorAll("#window-select button").forEach((btn) => btn.addEventListener("click", () => {
    windowName = btn.dataset.window;
    document.querySelectorAll("#window-select button").forEach((b) => b.classList.toggle("on", b === btn));
    document.getElementById("window-label").textContent = labels[windowName];
    if (B.last) headline(B.last);
  }));
})();
