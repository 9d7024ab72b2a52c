/* Planner page: operators queue a plan (REST API, session + CSRF), then the page follows the
   run (queued -> running -> done / failed) and shows its best configurations. */
(function () {
  "use strict";
  const B = window.Baton;
  const form = document.getElementById("plan-form");
  const statusEl = document.getElementById("plan-status");

  function esc(v) {
    return String(v).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  }
  function say(text, isError) {
    statusEl.textContent = text;
    statusEl.className = "small" + (isError ? " error" : "");
  }
  const counts = (text) => text.split(",").map((s) => s.trim()).filter(Boolean).map(Number);

  function render(run) {
    document.getElementById("plan-result-title").textContent = "plan #" + run.id + " · " + run.scenario;
    const rows = (run.results || []).map((r, i) => {
      const n = r.nodes, g = r.gpus, ttft = r.summary && r.summary.ttft_s ? r.summary.ttft_s.p90 : null;
      return "<tr><td>" + (i + 1) + "</td>" +
        '<td title="' + g.prefill + ' GPUs">' + n.prefill + "</td>" +
        '<td title="' + g.relay_decode + ' GPUs">' + n.relay_decode + "</td>" +
        '<td title="' + g.main_decode + ' GPUs">' + n.main_decode + "</td>" +
        "<td>" + B.num(r.goodput_rps, 2) + "</td><td>" + B.num(r.cost_per_hour, 2) + " " + esc(run.currency) + "</td>" +
        "<td>" + B.num(r.bcr, 4) + "</td><td>" + B.num(ttft, 2) + "</td></tr>";
    });
    const empty = run.status === "failed" ? "Failed: " + esc(run.error) : "No servable configuration.";
    document.querySelector("#plan-results tbody").innerHTML =
      rows.join("") || '<tr><td colspan="8" class="muted">' + empty + "</td></tr>";
    document.getElementById("plan-notes").innerHTML = (run.notes || []).map((t) => "<li>" + esc(t) + "</li>").join("");
  }

  function describe(run) {
    const progress = run.progress_total ? " (" + run.progress_done + "/" + run.progress_total + " configurations)" : "";
    if (run.status === "failed") return "Plan #" + run.id + " failed: " + run.error;
    return "Plan #" + run.id + ": " + run.status + progress;
  }

  async function follow(id) {
    for (;;) {
      const res = await fetch("/api/v1/plans/" + id + "/", { credentials: "same-origin" });
      if (!res.ok) { say("Plan #" + id + ": could not read it (" + res.status + ")", true); return; }
      const run = await res.json();
      say(describe(run), run.status === "failed");
      if (run.status === "done" || run.status === "failed") { render(run); return; }
      await new Promise((resolve) => setTimeout(resolve, 1000));
    }
  }

  if (form) form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const button = form.querySelector("button[type=submit]");
    const f = form.elements;
    const body = {
      scenario: f.scenario.value,
      prefill_counts: counts(f.prefill_counts.value),
      relay_counts: counts(f.relay_counts.value),
      main_counts: counts(f.main_counts.value),
      top: Number(f.top.value),
    };
    button.disabled = true;
    say("Planning… (without a worker the request waits for the whole search)");
    try {
      const res = await fetch("/api/v1/plans/", {
        method: "POST", credentials: "same-origin",
        headers: { "X-CSRFToken": B.csrf(), "Content-Type": "application/json" },
        body: JSON.stringify(body),
      });
      let out = {}; try { out = await res.json(); } catch (e) { /* empty body */ }
      if (!res.ok) {
        const why = Object.entries(out).map(([k, v]) => k + ": " + (Array.isArray(v) ? v.join(" ") : JSON.stringify(v)));
        say("Refused (" + res.status + ") " + why.join("; "), true);
        return;
      }
      await follow(out.id);
    } catch (err) {
      say("Request failed: " + err, true);
    } finally { button.disabled = false; }
  });

  document.querySelectorAll("button[data-plan]").forEach((btn) => btn.addEventListener("click", () => follow(btn.dataset.plan)));
})();
