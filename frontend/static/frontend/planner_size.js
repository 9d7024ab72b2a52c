/* Planner page, sizing section: operators start a sizing run (REST API, session + CSRF), the
   page follows it (queued -> running -> done / failed, with the search's progress), then shows
   its answer (?size=<id>). Without JavaScript the form posts to /planner/size/ instead. */
(function () {
  "use strict";
  const B = window.Baton;
  const form = document.getElementById("size-form");
  const statusEl = document.getElementById("size-status");
  if (!statusEl) return;

  function say(text, isError) {
    statusEl.textContent = text;
    statusEl.className = "small" + (isError ? " error" : "");
  }
  const optional = (v) => (v.trim() === "" ? null : Number(v));

  function describe(run) {
    const progress = run.progress_total ? " (" + run.progress_done + "/" + run.progress_total + " simulations" +
      (run.progress_note ? "; " + run.progress_note : "") + ")" : "";
    if (run.status === "failed") return "Sizing #" + run.id + " failed: " + run.error;
    return "Sizing #" + run.id + ": " + run.status + progress;
  }

  async function follow(id) {
    for (;;) {
      const res = await fetch("/api/v1/plans/sizing/" + id + "/", { credentials: "same-origin" });
      if (!res.ok) { say("Sizing #" + id + ": could not read it (" + res.status + ")", true); return; }
      const run = await res.json();
      say(describe(run), run.status === "failed");
      if (run.status === "done" || run.status === "failed") {
        window.location.assign("?size=" + run.id + "#sizing");  // the page renders the answer
        return;
      }
      await new Promise((resolve) => setTimeout(resolve, 1000));
    }
  }

  if (form) form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const button = form.querySelector("button[type=submit]");
    const f = form.elements;
    const body = {
      scenario: f.scenario.value,
      rps: optional(f.rps.value),
      p90: optional(f.p90.value),
      p99: optional(f.p99.value),
      from_db: f.from_db.checked,
    };
    button.disabled = true;
    say("Sizing… (without a worker the request waits for the whole search)");
    try {
      const res = await fetch("/api/v1/plans/sizing/", {
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

  // A run still going when the page loaded: follow it.
  const params = new URLSearchParams(window.location.search);
  const shown = document.getElementById("size-shown-status");
  if (params.get("size") && shown && /queued|running/.test(shown.textContent)) follow(params.get("size"));
})();
