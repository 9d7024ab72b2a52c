/* Billing: spend and tokens per day, revenue vs provider cost per day (uPlot), from the
   page's JSON data block (no inline script: the page's CSP forbids it). */
(function () {
  "use strict";
  const B = window.Baton;
  const source = document.getElementById("billing-daily");
  if (!source) return;
  const data = JSON.parse(source.textContent);
  const xs = data.days.map((d) => Date.parse(d + "T00:00:00Z") / 1000);

  function compact(v) {
    if (v === null || v === undefined) return "";
    const a = Math.abs(v);
    if (a >= 1e9) return (v / 1e9).toFixed(1) + "G";
    if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (a >= 1e3) return (v / 1e3).toFixed(1) + "k";
    return B.num(v, a >= 10 || v === 0 ? 0 : 2);
  }

  function draw(el, series, columns, axes) {
    if (!el) return null;
    if (!xs.length) {
      el.innerHTML = '<div class="chart-empty">No usage or cost in this period yet.</div>';
      el.dataset.drawn = "empty";
      return null;
    }
    const width = () => Math.max(260, el.clientWidth || 400);
    const chart = new uPlot({
      width: width(), height: 220,
      series: [{}].concat(series),
      axes: axes,
      scales: { x: { time: true, range: (u, min, max) => [min - 43200, max + 43200] } },
      legend: { live: false },
    }, [xs].concat(columns), el);
    window.addEventListener("resize", () => chart.setSize({ width: width(), height: 220 }));
    el.dataset.drawn = "chart";
    return chart;
  }

  const bars = uPlot.paths && uPlot.paths.bars ? uPlot.paths.bars({ size: [0.6, 40] }) : undefined;
  // Whole days only: finer ticks would repeat a day's label.
  const dayAxis = {
    space: 44, incrs: [86400, 2 * 86400, 3 * 86400, 7 * 86400, 14 * 86400],
    values: (u, ticks) => ticks.map((t) => new Date(t * 1000).toISOString().slice(5, 10)),
  };
  const money = (u, ticks) => ticks.map(compact);
  window.BillingCharts = {
    spend: draw(document.getElementById("chart-spend"), [
      { label: "spend", stroke: "#2563eb", fill: "rgba(37,99,235,.15)", width: 2, paths: bars, scale: "money" },
      { label: "tokens", stroke: "#ea580c", width: 2, scale: "tokens", points: { show: true } },
    ], [data.spend, data.tokens], [
      dayAxis,
      { scale: "money", size: 60, values: money },
      { scale: "tokens", side: 1, size: 60, grid: { show: false }, values: (u, t) => t.map(compact) },
    ]),
    margin: draw(document.getElementById("chart-margin"), [
      { label: "revenue", stroke: "#16a34a", width: 2, points: { show: true } },
      { label: "provider cost", stroke: "#dc2626", width: 2, points: { show: true } },
    ], [data.spend, data.cost], [dayAxis, { size: 60, values: money }]),
  };
  document.body.dataset.billingCharts = "ready";
})();
