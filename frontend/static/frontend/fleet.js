/* Fleet and instance pages: live state and load from snapshots, instant state changes from
   fleet pushes, and the operators' start / drain buttons (REST API, session + CSRF). */
(function () {
  "use strict";
  const B = window.Baton;

  function setState(id, state, desired) {
    document.querySelectorAll('[data-instance="' + id + '"]').forEach((el) => {
      el.querySelectorAll('[data-field="state"]').forEach((s) => {
        if (s.tagName === "tspan") s.textContent = state;
        else s.innerHTML = '<span class="state state-' + state + '">' + state + "</span>";
      });
      if (desired) el.querySelectorAll('[data-field="desired"]').forEach((d) => { d.textContent = desired; });
      if (el.tagName === "g") el.setAttribute("class", el.getAttribute("class").replace(/state-\S+/, "state-" + state));
    });
  }

  function setLoad(inst) {
    const l = inst.load || {};
    document.querySelectorAll('[data-instance="' + inst.id + '"]').forEach((el) => {
      const load = el.querySelector('[data-field="load"]');
      if (load) {
        const u = l.utilisation === null || l.utilisation === undefined ? null : l.utilisation;
        load.querySelector("span").style.width = (u === null ? 0 : Math.min(100, u * 100)) + "%";
        load.querySelector(".small").textContent = l.running === null || l.running === undefined ? "–" : l.running + "/" + l.max_running;
      }
      const put = (f, v) => el.querySelectorAll('[data-field="' + f + '"]').forEach((c) => { c.textContent = v; });
      put("queued", l.queued === null || l.queued === undefined ? "–" : String(l.queued));
      put("kv", B.pct(l.kv_usage));
      put("running", l.running === null || l.running === undefined ? "–" : l.running + " / " + l.max_running);
      put("cache", B.pct(l.cache_hit_rate));
    });
  }

  /* Groups (datacenter x role x GPU type; an empty part means any) recounted from the
     snapshot's instances: the topology's rows and the summary table's rows and totals. */
  const dataEl = document.getElementById("fleet-data");
  const FLEET = dataEl ? JSON.parse(dataEl.textContent) : { states: [], prices: {} };

  function groupStats(el, instances) {
    const dc = el.dataset.dc, role = el.dataset.role, gpu = el.dataset.gpu;
    const s = { instances: 0, gpus: 0, nodes: new Set(), emulated: 0, states: {}, running: 0, max: 0, reporting: 0, queued: 0, kvSum: 0, kvN: 0, cost: 0, currencies: new Set(), unpriced: 0 };
    instances.forEach((i) => {
      if ((dc && i.datacenter !== dc) || (role && i.role !== role) || (gpu && i.gpu_type !== gpu)) return;
      const l = i.load || {};
      s.instances += 1; s.gpus += i.gpu_count || 0; s.nodes.add(i.node_id);
      if (i.engine === "emulated") s.emulated += 1;
      s.states[i.actual_state] = (s.states[i.actual_state] || 0) + 1;
      if (l.running !== null && l.running !== undefined) { s.reporting += 1; s.running += l.running; s.max += l.max_running || 0; }
      s.queued += l.queued || 0;
      if (l.kv_usage !== null && l.kv_usage !== undefined) { s.kvSum += l.kv_usage; s.kvN += 1; }
      const price = FLEET.prices[i.datacenter + "|" + i.gpu_type];
      if (price) s.currencies.add(price[1]);
      if (i.actual_state === "running") {
        if (price) s.cost += (i.gpu_count || 0) * price[0]; else s.unpriced += 1;
      }
    });
    return s;
  }

  function setGroup(el, s) {
    const put = (name, v) => el.querySelectorAll('[data-agg="' + name + '"]').forEach((c) => { c.textContent = v; });
    put("instances", String(s.instances)); put("nodes", String(s.nodes.size)); put("gpus", String(s.gpus));
    put("emulated", String(s.emulated));
    put("emulated-text", s.emulated ? s.emulated + " emulated · " : "");
    el.querySelectorAll('[data-agg="emulated-badge"]').forEach((b) => { b.hidden = !s.emulated; });
    el.querySelectorAll('[data-agg="state"]').forEach((c) => {
      const n = s.states[c.dataset.state] || 0;
      c.textContent = String(n); c.classList.toggle("zero", !n);
    });
    const parts = FLEET.states.filter((st) => s.states[st]).map((st) => s.states[st] + " " + st);
    put("states", parts.length ? parts.join(" · ") : "no instances");
    const load = s.reporting ? s.running + "/" + s.max : "–";
    const kv = s.kvN ? B.pct(s.kvSum / s.kvN) : "–";
    put("load", load); put("queued", String(s.queued)); put("kv", kv);
    put("load-text", "load " + load + " · KV " + kv);
    el.querySelectorAll('[data-agg="meter"]').forEach((m) => { m.style.width = (s.max ? Math.min(100, (100 * s.running) / s.max) : 0) + "%"; });
    const cur = Array.from(s.currencies).sort().join(",");
    put("cost", cur ? B.num(s.cost, 2) + " " + cur : "–");
    put("unpriced", s.unpriced + " unpriced");
    el.querySelectorAll('[data-agg="unpriced"]').forEach((u) => { u.hidden = !s.unpriced; });
    el.querySelectorAll('[data-agg="bar"]').forEach((bar) => {
      let x = Number(bar.dataset.x);
      const w = Number(bar.dataset.w), total = Math.max(1, s.instances);
      bar.querySelectorAll("rect[data-seg]").forEach((r) => {
        const sw = (w * (s.states[r.dataset.seg] || 0)) / total;
        r.setAttribute("x", x.toFixed(1)); r.setAttribute("width", sw.toFixed(1)); x += sw;
      });
    });
  }

  function setGroups(instances) {
    document.querySelectorAll("[data-group]").forEach((el) => setGroup(el, groupStats(el, instances)));
    // a state column shows once any instance is in that state; the engine column once any
    // instance runs an emulated engine
    const show = (col, any) => document.querySelectorAll('[data-col="' + col + '"]').forEach((c) => { c.hidden = !any; });
    FLEET.states.forEach((st) => show(st, st === "running" || instances.some((i) => i.actual_state === st)));
    show("emulated", instances.some((i) => i.engine === "emulated"));
  }

  B.on("snapshot", (snap) => {
    document.querySelectorAll('[data-metric="cost"]').forEach((el) => { el.textContent = B.num(snap.fleet.cost_per_hour, 2) + " " + snap.fleet.currency; });
    snap.fleet.instances.forEach((inst) => { setState(inst.id, inst.actual_state, inst.desired_state); setLoad(inst); });
    if (dataEl) setGroups(snap.fleet.instances);
    snap.fleet.links.forEach((link) => {
      document.querySelectorAll('[data-link="' + link.name + '"]').forEach((el) => {
        const util = link.utilisation === undefined || link.utilisation === null ? 0 : link.utilisation;
        el.querySelectorAll('[data-field="gbps"]').forEach((c) => { c.textContent = B.num(link.gbps || 0, 3) + " Gbit/s"; });
        el.querySelectorAll('[data-field="util"]').forEach((c) => { c.textContent = B.pct(util); });
        el.querySelectorAll('[data-field="status"]').forEach((c) => { c.innerHTML = '<span class="state status-' + link.status + '">' + link.status + "</span>"; });
        if (el.tagName === "g") el.setAttribute("class", "link status-" + link.status);
      });
      document.querySelectorAll('[data-link-util="' + link.name + '"]').forEach((t) => {
        t.textContent = link.status + " · " + B.pct(link.utilisation || 0) + " used";
      });
    });
  });

  B.on("fleet_change", (msg) => {
    const c = msg.change;
    if (c.type === "instance" && c.actual_state) setState(c.id, c.actual_state, c.desired_state);
  });

  document.querySelectorAll("button[data-action]").forEach((btn) => btn.addEventListener("click", async () => {
    const out = document.getElementById("action-result");
    btn.disabled = true;
    try {
      const r = await B.instanceAction(btn.dataset.action, btn.dataset.id);
      if (out) out.textContent = r.ok
        ? "Instance " + btn.dataset.id + ": " + btn.dataset.action + " requested (desired " + (r.body.desired_state || "?") + ")."
        : "Instance " + btn.dataset.id + ": " + btn.dataset.action + " refused (" + r.status + ") " + (r.body.detail || "");
      if (r.ok && r.body.desired_state) setState(btn.dataset.id, r.body.actual_state || "", r.body.desired_state);
    } finally { btn.disabled = false; }
  }));
})();
