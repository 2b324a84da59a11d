// trajstore viewer: turn bodies load when a turn is opened; an active session's page follows
// its log (server-sent events) and swaps in the new summary, keeping open turns open.
"use strict";

function loadBody(details) {
  const body = details.querySelector(":scope > .body");
  if (details.dataset.loaded === "yes" || details.dataset.loaded === "loading") return;
  details.dataset.loaded = "loading";
  fetch(details.dataset.body)
    .then((r) => r.text().then((html) => ({ ok: r.ok, html })))
    .then(({ ok, html }) => {
      body.innerHTML = ok ? html : '<p class="bad">could not load this turn</p>';
      details.dataset.loaded = ok ? "yes" : "no";
    })
    .catch(() => { body.textContent = "could not load this turn"; details.dataset.loaded = "no"; });
}

function watchTurns(root) {
  root.querySelectorAll("details.turn").forEach((d) => {
    d.addEventListener("toggle", () => { if (d.open) loadBody(d); });
    if (d.open) loadBody(d);
  });
}

function follow(session) {
  if (session.dataset.active !== "yes" || !window.EventSource) return;
  const source = new EventSource(session.dataset.live);
  let pending = false;
  const refresh = () => {
    if (pending) return;
    pending = true;
    const open = [...session.querySelectorAll("details.turn[open]")].map((d) => d.dataset.turn);
    fetch(session.dataset.summary)
      .then((r) => (r.ok ? r.text() : Promise.reject(r.status)))
      .then((html) => {
        session.innerHTML = html;
        open.forEach((n) => {
          const d = session.querySelector(`details.turn[data-turn="${n}"]`);
          if (d) d.open = true;
        });
        watchTurns(session);
        session.dataset.refreshed = String(Number(session.dataset.refreshed || 0) + 1);
      })
      .finally(() => { pending = false; });
  };
  source.addEventListener("changed", refresh);
  source.addEventListener("finished", () => { source.close(); refresh(); });
}

// Hovering an image's thumbnail lights its placeholder ids in the strip beside it, and back.
function lightImage(event, on) {
  const item = event.target.closest && event.target.closest("[data-image]");
  const row = item && item.closest(".strip-row");
  if (!row) return;
  row.querySelectorAll(`[data-image="${item.dataset.image}"]`)
    .forEach((el) => el.classList.toggle("lit", on));
}

document.addEventListener("mouseover", (e) => lightImage(e, true));
document.addEventListener("mouseout", (e) => lightImage(e, false));

// A link to one turn (`/sessions/ID/requests/R` redirects to `#turn-N`, e.g. from a trace's
// span) opens it.
function openLinkedTurn() {
  const d = location.hash.startsWith("#turn-") && document.getElementById(location.hash.slice(1));
  if (d && d.matches("details.turn")) d.open = true;
}

document.addEventListener("DOMContentLoaded", () => {
  watchTurns(document);
  openLinkedTurn();
  const session = document.getElementById("session");
  if (session) follow(session);
});
