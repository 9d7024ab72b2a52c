/* Baton UI: the dashboard socket, number formatting and chart helpers shared by every page. */
(function () {
  "use strict";
  const listeners = {};
  const status = () => document.getElementById("ws-status");

  function setStatus(state, text) {
    const el = status();
    document.body.dataset.ws = state;
    if (el) { el.className = "ws ws-" + state; el.textContent = text; }
  }

  function on(type, fn) { (listeners[type] = listeners[type] || []).push(fn); }

  function dispatch(msg) {
    if (msg.type === "snapshot") {
      Baton.last = msg;
      Baton.snapshots += 1;
      document.body.dataset.snapshots = String(Baton.snapshots);
    }
    (listeners[msg.type] || []).forEach((fn) => {
      try { fn(msg); } catch (err) { console.warn("handler failed", err); }
    });
  }

  let retry = 500;
  function connect() {
    const proto = location.protocol === "https:" ? "wss" : "ws";
    const ws = new WebSocket(proto + "://" + location.host + "/ws/dashboard/");
    setStatus("connecting", "connecting…");
    ws.onopen = () => { retry = 500; setStatus("open", "live"); };
    ws.onmessage = (ev) => dispatch(JSON.parse(ev.data));
    ws.onclose = (ev) => {
      if (ev.code === 4401) { location.href = "/login/?next=" + encodeURIComponent(location.pathname); return; }
      setStatus("closed", "reconnecting…");
      setTimeout(connect, retry);
      retry = Math.min(retry * 2, 10000);
    };
    Baton.socket = ws;
  }

  function num(v, digits) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    const d = digits === undefined ? (Math.abs(v) >= 100 ? 0 : Math.abs(v) >= 10 ? 1 : 2) : digits;
    return Number(v).toFixed(d);
  }
  function pct(v) { return v === null || v === undefined ? "–" : (v * 100).toFixed(1) + "%"; }
  /* A value and its unit are joined by a no-break space, so a card never wraps between them. */
  const NBSP = "\u00a0";
  function secs(v) { return v === null || v === undefined ? "–" : (v < 1 ? (v * 1000).toFixed(0) + NBSP + "ms" : v.toFixed(2) + NBSP + "s"); }
  function bytes(v) {
    if (!v) return "0 B";
    const u = ["B", "KB", "MB", "GB", "TB"]; let i = 0;
    while (v >= 1000 && i < u.length - 1) { v /= 1000; i++; }
    return v.toFixed(i ? 1 : 0) + " " + u[i];
  }
  function cookie(name) {
    const m = document.cookie.match("(^|;)\\s*" + name + "=([^;]*)");
    return m ? decodeURIComponent(m[2]) : "";
  }
  function csrf() {
    const input = document.querySelector("input[name=csrfmiddlewaretoken]");
    return input ? input.value : cookie("csrftoken");
  }

  /* A rolling uPlot chart keyed by time: push(t, values) replaces a point with the same t. */
  function liveChart(el, series, opts) {
    opts = opts || {};
    const cap = opts.cap || 300;
    const width = () => Math.max(260, el.clientWidth || 400);
    const data = [[]].concat(series.map(() => []));
    const chart = new uPlot({
      width: width(), height: opts.height || 180,
      series: [{}].concat(series.map((s) => Object.assign({ spanGaps: false, width: 1.5 }, s))),
      axes: [{}, { size: 50, values: opts.yValues }],
      scales: { x: { time: true }, y: opts.y || {} },
      // a dashed series gets a dashed legend marker
      legend: { live: false, show: opts.legend !== false, markers: { dash: (u, i) => (u.series[i].dash && u.series[i].dash[1] ? "dashed" : "solid") } },
    }, data, el);
    window.addEventListener("resize", () => chart.setSize({ width: width(), height: opts.height || 180 }));
    return {
      chart,
      push(t, values) {
        const xs = data[0];
        if (xs.length && xs[xs.length - 1] === t) {
          values.forEach((v, i) => { data[i + 1][xs.length - 1] = v; });
        } else {
          xs.push(t); values.forEach((v, i) => data[i + 1].push(v));
          if (xs.length > cap) data.forEach((arr) => arr.shift());
        }
        chart.setData(data);
      },
      reset(rows) {
        data.forEach((arr) => { arr.length = 0; });
        rows.forEach(([t, values]) => { data[0].push(t); values.forEach((v, i) => data[i + 1].push(v)); });
        chart.setData(data);
      },
    };
  }

  async function instanceAction(action, id) {
    const res = await fetch("/api/v1/instances/" + id + "/" + action + "/", {
      method: "POST", credentials: "same-origin",
      headers: { "X-CSRFToken": csrf(), "Content-Type": "application/json" }, body: "{}",
    });
    let body = {}; try { body = await res.json(); } catch (e) { /* empty body */ }
    return { ok: res.ok, status: res.status, body };
  }

  window.Baton = { on, connect, num, pct, secs, bytes, csrf, liveChart, instanceAction, NBSP, last: null, snapshots: 0 };
  document.addEventListener("DOMContentLoaded", () => { if (document.getElementById("ws-status")) connect(); });
})();
