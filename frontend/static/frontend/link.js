/* WAN link page: bytes per window and a live utilisation chart for this one link. */
(function () {
  "use strict";
  const B = window.Baton;
  const root = document.getElementById("link-detail");
  const name = root.dataset.link;
  let chart = null;
  let pending = [];
  B.on("history", (msg) => { if (msg.scale === "live") pending = msg.points; });
  B.on("snapshot", (snap) => {
    if (!chart) {
      chart = B.liveChart(document.getElementById("chart-link"), [{ label: name + " %", stroke: "#ea580c" }], { y: { range: [0, 100] } });
      pending.forEach((p) => chart.push(p.t, [(p.wan[name] || 0) * 100]));
    }
    chart.push(snap.point.t, [(snap.point.wan[name] || 0) * 100]);
    Object.entries(snap.windows).forEach(([w, s]) => {
      const v = s.wan[name];
      const cell = root.querySelector('[data-window="' + w + '"]');
      if (cell) cell.textContent = v ? B.bytes(v.bytes) + " · " + B.num(v.gbps, 3) + " Gbit/s · " + B.pct(v.utilisation) : "idle";
    });
    const link = snap.fleet.links.find((l) => l.name === name);
    if (link) root.querySelector('[data-field="status"]').innerHTML = '<span class="state status-' + link.status + '">' + link.status + "</span>";
  });
})();
