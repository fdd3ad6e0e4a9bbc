// The console's script: one EventSource per page (the stream its <body data-stream> names), the machine
// actions, and nothing else. Vanilla JS: a page needs a dozen DOM updates, not a framework.
"use strict";

function setState(el, state) {
  el.className = el.className.replace(/\bs-[a-z]+/g, "").trim() + " s-" + state;
  if (el.dataset.text) el.textContent = state;
  if (el.id === "state") enableActions(state);
}

// a machine's buttons: each enabled only in the states where its action does something (its data-when)
function enableActions(state) {
  document.querySelectorAll(".actions button[data-action]").forEach((b) => {
    b.disabled = !(b.dataset.when || "").split(" ").includes(state);
  });
}

function onMachine(ev) {
  const found = document.querySelectorAll('[data-machine="' + ev.id + '"]');
  const isState = ev.type === "transition" || ev.type === "exit";
  if (isState) {
    found.forEach((el) => {
      if (ev.status === "destroyed" && el.classList.contains("m")) el.remove();
      else setState(el, ev.status);
    });
  }
  if (isState && found.length === 0 && ev.status !== "destroyed") {
    const box = document.querySelector('[data-worker="' + ev.worker_id + '"] .machines');
    if (box) {  // a machine new to the fleet page
      const a = document.createElement("a");
      a.className = "m s-" + ev.status;
      a.dataset.machine = ev.id;
      a.href = ev.href;
      box.appendChild(a);
    }
  }
  const timeline = document.querySelector('[data-machine-timeline="' + ev.id + '"]');
  if (timeline) timeline.insertAdjacentHTML("beforeend", ev.html);
  refreshLive();
}

function onWorkers(workers) {
  for (const w of workers) {
    const box = document.querySelector('[data-worker="' + w.id + '"]');
    if (!box) continue;
    box.className = "worker w-" + w.status;
    for (const [kind, pair, unit] of [["cpu", w.cpu, ""], ["mem", w.mem, " MB"]]) {
      const bar = box.querySelector('[data-bar="' + kind + '"]');
      if (!bar) continue;
      const share = pair[1] ? pair[0] / pair[1] : 0;
      bar.querySelector("rect").setAttribute("width", Math.min(100, share * 100).toFixed(0));
      bar.querySelector("em").textContent = kind + " " + pair[0] + "/" + pair[1] + unit;
    }
  }
  document.querySelectorAll('[data-live^="/"][data-on="tick"]').forEach(refresh);
}

function onLog(line) {
  const logs = document.getElementById("logs");
  if (!logs) return;
  const stick = logs.scrollTop + logs.clientHeight >= logs.scrollHeight - 4;
  logs.insertAdjacentHTML("beforeend", line.html);
  while (logs.childElementCount > 500) logs.firstElementChild.remove();
  if (stick) logs.scrollTop = logs.scrollHeight;
}

// sections drawn by the server (releases, deploy progress, jobs): fetched again, at most every 300 ms
let pending = null;
function refreshLive() {
  if (pending) return;
  pending = setTimeout(() => {
    pending = null;
    // a section names the path it is fetched from; <body data-live="1"> only says the stream is open (it was
    // fetched as a path too: GET /ui/apps/1, a 404 on every change)
    document.querySelectorAll('[data-live^="/"]:not([data-on])').forEach(refresh);
  }, 300);
}

async function refresh(el) {
  const reply = await fetch(el.dataset.live, { credentials: "same-origin" });
  if (reply.ok) el.innerHTML = await reply.text();
}

function connect() {
  const url = document.body.dataset.stream;
  if (!url) return;
  const status = document.getElementById("live-status");
  const source = new EventSource(url);
  source.addEventListener("hello", () => { status.textContent = "live"; document.body.dataset.live = "1"; });
  source.addEventListener("machine", (m) => onMachine(JSON.parse(m.data)));
  source.addEventListener("workers", (m) => onWorkers(JSON.parse(m.data)));
  source.addEventListener("log", (m) => onLog(JSON.parse(m.data)));
  source.addEventListener("job", () => refreshLive());
  source.addEventListener("release", () => refreshLive());
  source.addEventListener("reload", () => location.reload());
  source.onerror = () => { status.textContent = "reconnecting…"; document.body.dataset.live = ""; };
}

// the anti-CSRF token of this page's session, which the server put in the page: every action sends it back
function csrfToken() {
  const meta = document.querySelector('meta[name="fauxmad-csrf"]');
  return meta ? meta.content : "";
}

async function act(button) {
  const box = button.closest(".actions");
  const action = button.dataset.action;
  const outcome = document.getElementById("outcome");
  if (action === "destroy" && !confirm("Destroy machine " + box.dataset.id + "? This cannot be undone.")) return;
  const query = action === "destroy" ? "?force=true" : "";
  const url = "/ui/apps/" + encodeURIComponent(box.dataset.app) + "/machines/" + encodeURIComponent(box.dataset.id)
    + "/" + action + query;
  outcome.textContent = action + "…";
  outcome.className = "";
  box.querySelectorAll("button").forEach((b) => (b.disabled = true));
  try {
    const reply = await fetch(url, {
      method: "POST", credentials: "same-origin", body: "{}",
      headers: { "Content-Type": "application/json", "X-Fauxmad-Csrf": csrfToken() },
    });
    const body = await reply.json().catch(() => ({}));
    if (reply.ok) {
      outcome.textContent = action + ": done, the machine is " + body.state;
      setState(document.getElementById("state"), body.state);
    } else {
      outcome.textContent = action + " refused (" + reply.status + "): " + (body.error || reply.statusText);
      outcome.className = "error";
    }
  } catch (err) {
    outcome.textContent = action + " failed: " + err;
    outcome.className = "error";
  } finally {
    enableActions(document.getElementById("state").textContent);
  }
}

// a machine square's tooltip, made when hovered: "ID APP STATE" from its link and its class
document.addEventListener("mouseover", (ev) => {
  const chip = ev.target.closest && ev.target.closest("a.m[data-machine]");
  if (!chip) return;
  const app = decodeURIComponent(chip.getAttribute("href").split("/")[3] || "");
  const state = (chip.className.match(/\bs-([a-z]+)/) || ["", ""])[1];
  chip.title = chip.dataset.machine + " " + app + " " + state;
});

document.addEventListener("click", (ev) => {
  const button = ev.target.closest(".actions button[data-action]");
  if (button) act(button);
});
connect();
