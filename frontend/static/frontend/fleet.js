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

  B.on("snapshot", (snap) => {
    document.querySelectorAll('[data-metric="cost"]').forEach((el) => { el.textContent = B.num(snap.fleet.cost_per_hour, 2) + " " + snap.fleet.currency; });
    snap.fleet.instances.forEach((inst) => { setState(inst.id, inst.actual_state, inst.desired_state); setLoad(inst); });
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
