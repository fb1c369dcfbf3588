/* stemdeck-watch queue page.
 *
 * Static, no build step, nothing from the internet. The page is opened with a one-time code in
 * the URL fragment (#code=…, what `stemdeck-watch open` and the tray launch: a browser's command
 * line is visible to every local user, so it never carries the token) and trades it once for
 * the token (POST /api/token); #token=… is taken as it is. The token is kept in sessionStorage so
 * a reload works, removed from the visible address, and sent as `Authorization: Bearer …` on
 * every call (never as a cookie). The page lives on the one event stream GET /api/queue/events, read with
 * fetch() and a reader because EventSource cannot send an Authorization header.
 *
 * The DOM is updated in place (one element per job, keyed by id), so a frame does not take the
 * keyboard focus away; when an element has to move or go, focus is put back.
 */
"use strict";

(function () {
  const TOKEN_KEY = "stemdeck-watch.token";
  const RECENT_LIMIT = 15;
  const MAX_NOTICES = 4;
  const BACKOFF_MIN_MS = 500;
  const BACKOFF_MAX_MS = 10000;
  const SILENCE_LIMIT_MS = 75000; // no byte (not even a keep-alive) for this long: reconnect
  const FINAL = new Set(["done", "failed", "cancelled"]);
  const STAGES = {
    queued: "Queued",
    downloading: "Downloading",
    decoding: "Decoding",
    separating: "Separating",
    publishing: "Publishing",
    done: "Done",
    failed: "Failed",
    cancelled: "Cancelled",
  };
  const PAUSE_WORDS = {
    user: "Paused by you.",
    restore: "Restored after a restart — press Start.",
    folder: "Paused by a PAUSE file in the inbox.",
    disk: "Paused: the disk is almost full.",
    inbox: "Paused: the inbox's share cannot be reached — it goes on when the share answers.",
    outbox: "Paused: the outbox's share cannot be reached — stems wait until it answers.",
  };

  const $ = (id) => document.getElementById(id);
  let token = null;
  let current = null; // the last status object
  let queueIds = []; // the queue order as shown

  // ------------------------------------------------------------------ token

  /** The token: from #token=…, traded for #code=…, or kept from before in this tab. A code
   * that cannot be traded (used, expired) is an Error whose message says so. */
  async function readToken() {
    let found = null;
    const hash = location.hash.replace(/^#/, "");
    if (hash) {
      const params = new URLSearchParams(hash);
      history.replaceState(null, "", location.pathname + location.search);
      if (params.get("code")) found = await tradeCode(params.get("code"));
      else if (params.has("token")) found = params.get("token") || null;
      try {
        if (found) sessionStorage.setItem(TOKEN_KEY, found);
      } catch (e) { /* storage disabled: the token lives only in this page */ }
    }
    if (!found) {
      try { found = sessionStorage.getItem(TOKEN_KEY); } catch (e) { found = null; }
    }
    return found || null;
  }

  async function tradeCode(code) {
    let response;
    try {
      response = await fetch("/api/token", {
        method: "POST", cache: "no-store", credentials: "same-origin",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ code: code }),
      });
    } catch (e) {
      throw new Error("Could not reach the service to open this page.");
    }
    let data = null;
    try { data = await response.json(); } catch (e) { data = null; }
    if (!response.ok || !data || typeof data.token !== "string") {
      throw new Error(data && data.error ? data.error : "The service answered " + response.status + ".");
    }
    return data.token;
  }

  function forgetToken() {
    try { sessionStorage.removeItem(TOKEN_KEY); } catch (e) { /* nothing stored */ }
  }

  /** The token's header; none for a device that signed in (its session cookie is sent). */
  function authHeaders(extra) {
    return Object.assign(token ? { Authorization: "Bearer " + token } : {}, extra || {});
  }

  /** Whether this browser signed in (its cookie cannot be read by the page, only used). */
  async function signedIn() {
    try {
      const response = await fetch("/api/queue", { cache: "no-store", credentials: "same-origin" });
      return response.ok;
    } catch (e) {
      return false;
    }
  }

  // ------------------------------------------------------------------ small DOM helpers

  function setText(el, text) {
    if (el.textContent !== text) el.textContent = text;
  }

  function setAttr(el, name, value) {
    if (value === null || value === undefined || value === false) {
      if (el.hasAttribute(name)) el.removeAttribute(name);
    } else if (el.getAttribute(name) !== String(value)) {
      el.setAttribute(name, String(value));
    }
  }

  function show(el, visible) {
    if (el.hidden === visible) el.hidden = !visible;
  }

  function make(tag, props, children) {
    const el = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (key === "text") el.textContent = value;
      else if (key === "className") el.className = value;
      else el.setAttribute(key, value);
    }
    for (const child of children || []) el.appendChild(child);
    return el;
  }

  function percent(progress) {
    return Math.floor(Math.max(0, Math.min(1, Number(progress) || 0)) * 100) + "%";
  }

  function when(seconds) {
    if (!seconds) return "";
    const date = new Date(seconds * 1000);
    const today = new Date();
    const sameDay = date.toDateString() === today.toDateString();
    const time = date.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
    return sameDay ? time : date.toLocaleDateString([], { month: "short", day: "numeric" }) + " " + time;
  }

  /** "14:05" (today) or "Tue 14:05": when an estimate says a song starts or finishes. */
  function clockAt(seconds) {
    const date = new Date(seconds * 1000);
    const time = date.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
    return date.toDateString() === new Date().toDateString() ? time
      : date.toLocaleDateString([], { weekday: "short" }) + " " + time;
  }

  /** "45 s", "3:07", "1 h 05 min": how long something takes. */
  function span(seconds) {
    const s = Math.max(0, Math.round(Number(seconds) || 0));
    if (s < 60) return s + " s";
    if (s < 3600) return Math.floor(s / 60) + ":" + String(s % 60).padStart(2, "0");
    return Math.floor(s / 3600) + " h " + String(Math.round((s % 3600) / 60)).padStart(2, "0") + " min";
  }

  function etaOf(id) {
    const eta = current && current.eta;
    return eta && eta.jobs ? eta.jobs[id] || null : null;
  }

  /** What the queue heading says: "3 songs, done around 14:20". */
  function etaWords(eta) {
    if (!eta || !eta.songs) return "";
    const songs = eta.songs === 1 ? "1 song" : eta.songs + " songs";
    if (eta.finish) return songs + ", done around " + clockAt(eta.finish);
    if (eta.measured && eta.seconds !== null && eta.seconds !== undefined) {
      return songs + ", about " + span(eta.seconds) + " of work" + (eta.paused ? " once started" : "");
    }
    return songs + " — the first song measures how long they take";
  }

  function shortPath(path) {
    const outbox = current && current.folders && current.folders.outbox;
    if (path && outbox && path.startsWith(outbox + "/")) return "outbox/" + path.slice(outbox.length + 1);
    if (path && outbox && path.startsWith(outbox + "\\")) return "outbox\\" + path.slice(outbox.length + 1);
    return path || "";
  }

  // ------------------------------------------------------------------ notices

  function notice(message) {
    const area = $("notices");
    for (const existing of area.querySelectorAll(".notice")) {
      if (existing.dataset.message === message) existing.remove();
    }
    const item = make("div", { className: "notice", "data-message": message }, [
      make("span", { className: "notice-text", text: message }),
      make("button", { type: "button", "data-action": "dismiss", "aria-label": "Dismiss: " + message,
        text: "Dismiss" }),
    ]);
    area.appendChild(item);
    while (area.children.length > MAX_NOTICES) area.firstElementChild.remove();
  }

  function dismiss(button) {
    const item = button.closest(".notice");
    if (!item) return;
    const next = item.nextElementSibling || item.previousElementSibling;
    item.remove();
    const target = next ? next.querySelector("button") : $("pause-toggle");
    if (target && !target.disabled) target.focus();
  }

  // ------------------------------------------------------------------ connection state

  function setConnection(state, text) {
    const el = $("connection");
    setAttr(el, "data-state", state);
    setText(el, text);
    document.body.dataset.connection = state;
  }

  // ------------------------------------------------------------------ focus keeping

  function rememberFocus() {
    const el = document.activeElement;
    if (!el || el === document.body) return null;
    const item = el.closest("[data-job-id]");
    const list = el.closest("ol, ul");
    return {
      el,
      action: el.dataset ? el.dataset.action : undefined,
      jobId: item ? item.dataset.jobId : undefined,
      list,
      index: list && item ? Array.prototype.indexOf.call(list.children, item) : -1,
    };
  }

  function restoreFocus(saved) {
    if (!saved) return;
    const active = document.activeElement;
    if (active && active !== document.body && active !== saved.el) return; // focus moved on purpose
    if (saved.el.isConnected && !saved.el.closest("[hidden]")) {
      if (active !== saved.el) saved.el.focus({ preventScroll: true });
      return;
    }
    // The element went away (its song started, finished or was cancelled): stay nearby.
    let target = null;
    if (saved.list && saved.list.isConnected) {
      const items = saved.list.children;
      if (items.length) {
        const item = items[Math.min(Math.max(saved.index, 0), items.length - 1)];
        target = (saved.action && item.querySelector('[data-action="' + saved.action + '"]'))
          || item.querySelector("button");
      }
      if (!target) target = saved.list.id === "queue" ? $("queue-heading") : $("recent-heading");
    }
    if (target) target.focus({ preventScroll: true });
  }

  // ------------------------------------------------------------------ rendering

  function syncList(list, jobs, create, update) {
    const existing = new Map();
    for (const child of Array.from(list.children)) existing.set(child.dataset.jobId, child);
    const wanted = jobs.map((job, index) => {
      let el = existing.get(job.id);
      if (el) existing.delete(job.id);
      else el = create(job);
      update(el, job, index, jobs.length);
      return el;
    });
    for (const stale of existing.values()) stale.remove();
    wanted.forEach((el, index) => {
      const here = list.children[index] || null;
      if (here !== el) list.insertBefore(el, here);
    });
  }

  function createQueueItem(job) {
    return make("li", { className: "item queued", "data-job-id": job.id, draggable: "true" }, [
      make("span", { className: "handle", "aria-hidden": "true", text: "⠿" }),
      make("span", { className: "pos", "aria-hidden": "true" }),
      make("span", { className: "item-main" }, [
        make("span", { className: "name" }),
        make("span", { className: "meta" }),
      ]),
      make("span", { className: "buttons" }, [
        make("button", { type: "button", className: "icon", "data-action": "move-up", text: "▲" }),
        make("button", { type: "button", className: "icon", "data-action": "move-down", text: "▼" }),
        make("button", { type: "button", "data-action": "cancel", text: "Cancel" }),
      ]),
    ]);
  }

  function updateQueueItem(li, job, index, count) {
    setText(li.querySelector(".pos"), String(index + 1));
    setText(li.querySelector(".name"), job.name);
    setAttr(li, "title", job.source);
    const expected = etaOf(job.id);
    setText(li.querySelector(".meta"), [job.preset ? "preset " + job.preset : "",
                                        playlistText(job), attemptText(job),
                                        expected && expected.finish ? "starts ~" + clockAt(expected.start)
                                          + ", done ~" + clockAt(expected.finish) : ""]
      .filter(Boolean).join(" · "));
    setAttr(li, "data-finish", expected && expected.finish ? String(expected.finish) : null);
    setAttr(li.querySelector(".meta"), "title", faultsText(job) || null);
    const up = li.querySelector('[data-action="move-up"]');
    const down = li.querySelector('[data-action="move-down"]');
    setAttr(up, "aria-label", "Move " + job.name + " up");
    setAttr(down, "aria-label", "Move " + job.name + " down");
    // aria-disabled rather than disabled: a disabled button drops the keyboard focus
    setAttr(up, "aria-disabled", index === 0 ? "true" : null);
    setAttr(down, "aria-disabled", index === count - 1 ? "true" : null);
    setAttr(li.querySelector('[data-action="cancel"]'), "aria-label", "Cancel " + job.name);
  }

  // "2/3 of My List" for a playlist entry, "playlist · 3 entries" for the playlist link
  function playlistText(job) {
    const ref = job.playlist;
    if (!ref) return "";
    if (ref.entry) return ref.entry + "/" + ref.entries + " of " + ref.name;
    return "playlist · " + ref.entries + " entries";
  }

  // "attempt 2" for a song the machine cut off before (the worker died, stalled, ran out of
  // memory); each earlier attempt's reason in faultsText, for a tooltip
  function attemptText(job) {
    const faults = job.faults || [];
    return faults.length ? "attempt " + (faults.length + 1) : "";
  }

  // "vocals: bs_roformer_viperx_1297; drums, bass, other: htdemucs_ft" where a recipe's
  // models make the song's stems; "" where one model makes them all
  function madeByText(job) {
    const byModel = new Map();
    for (const [stem, model] of Object.entries(job.made_by || {})) {
      if (!byModel.has(model)) byModel.set(model, []);
      byModel.get(model).push(stem);
    }
    if (byModel.size < 2) return "";
    return Array.from(byModel, ([model, stems]) => stems.join(", ") + ": " + model).join("; ");
  }

  function faultsText(job) {
    return (job.faults || []).map((fault, n) => "attempt " + (n + 1) + ": " + fault.reason).join("\n");
  }

  function createRecentItem(job) {
    return make("li", { className: "item recent", "data-job-id": job.id }, [
      make("span", { className: "badge" }),
      make("span", { className: "item-main" }, [
        make("span", { className: "name" }),
        make("span", { className: "detail" }),
      ]),
      make("span", { className: "time" }),
      make("span", { className: "buttons" }),
    ]);
  }

  function updateRecentItem(li, job) {
    setAttr(li, "data-state", job.state);
    setText(li.querySelector(".badge"), STAGES[job.state] || job.state);
    setText(li.querySelector(".name"), job.name);
    let detail;
    if (job.state === "done") detail = job.output ? "→ " + shortPath(job.output) : "";
    else detail = job.error || (job.state === "cancelled" ? "cancelled" : "");
    const detailEl = li.querySelector(".detail");
    setText(detailEl, detail);
    setAttr(detailEl, "title", job.state === "done"
      ? [job.output, madeByText(job)].filter(Boolean).join("\n") : null);
    const took = current && current.eta && current.eta.took ? current.eta.took[job.id] : undefined;
    setText(li.querySelector(".time"), when(job.finished_at || job.created_at)
      + (took !== undefined && job.state === "done" ? " · took " + span(took) : ""));
    const buttons = li.querySelector(".buttons");
    let listen = buttons.querySelector('[data-action="listen"]');
    const canListen = job.state === "done" && Boolean(job.output) && Boolean(window.StemdeckPlayer);
    if (canListen && !listen) {
      listen = make("button", { type: "button", "data-action": "listen", text: "Listen" });
      buttons.appendChild(listen);
    } else if (!canListen && listen) {
      listen.remove();
      listen = null;
    }
    if (listen) setAttr(listen, "aria-label", "Listen to " + job.name);
    let retry = buttons.querySelector('[data-action="retry"]');
    const canRetry = job.state === "failed" || job.state === "cancelled";
    if (canRetry && !retry) {
      retry = make("button", { type: "button", "data-action": "retry", text: "Retry" });
      buttons.appendChild(retry);
    } else if (!canRetry && retry) {
      retry.remove();
      retry = null;
    }
    if (retry) setAttr(retry, "aria-label", "Retry " + job.name);
  }

  function renderHeader(status) {
    const toggle = $("pause-toggle");
    const paused = Boolean(status.paused);
    setAttr(toggle, "data-action", paused ? "start" : "pause");
    setText(toggle, paused ? "Start" : "Pause");
    toggle.disabled = false;
    const reason = $("pause-reason");
    const words = paused ? (PAUSE_WORDS[status.pause_reason] || "Paused.") : "";
    setText(reason, words);
    setAttr(reason, "data-reason", paused ? (status.pause_reason || "") : null);
    show(reason, paused);
    document.body.dataset.paused = paused ? "true" : "false";
    // the first use of a model: the worker downloads it before the first song moves
    const download = $("download");
    setText(download, status.download ? status.download.text : "");
    show(download, Boolean(status.download));
  }

  function renderRunning(job) {
    const box = $("running");
    show(box, Boolean(job));
    show($("idle"), !job);
    if (!job) {
      setAttr(box, "data-job-id", "");
      return;
    }
    setAttr(box, "data-job-id", job.id);
    setAttr(box, "data-state", job.state);
    setText($("running-name"), job.name);
    const expected = etaOf(job.id);
    setText($("running-stage"), (STAGES[job.state] || job.state) + (job.preset ? " · preset " + job.preset : "") +
                                (job.playlist ? " · " + playlistText(job) : "") +
                                (attemptText(job) ? " · " + attemptText(job) : "") +
                                (madeByText(job) ? " · " + madeByText(job) : "") +
                                (expected && expected.finish ? " · done ~" + clockAt(expected.finish) : ""));
    setAttr($("running-stage"), "title", faultsText(job) || null);
    const bar = $("running-progress");
    const value = Math.max(0, Math.min(1, Number(job.progress) || 0));
    if (Number(bar.value) !== value) bar.value = value;
    setText($("running-percent"), percent(value));
    setAttr($("running-cancel"), "aria-label", "Cancel " + job.name);
  }

  // a song publishing behind the one separating (or, with several workers, separating
  // beside it): still cancellable, so listed under it with its own Cancel
  function createAlsoItem(job) {
    return make("li", { className: "item also", "data-job-id": job.id }, [
      make("span", { className: "badge" }),
      make("span", { className: "item-main" }, [
        make("span", { className: "name" }),
        make("span", { className: "detail" }),
      ]),
      make("span", { className: "buttons" }, [
        make("button", { type: "button", "data-action": "cancel", text: "Cancel" }),
      ]),
    ]);
  }

  function updateAlsoItem(li, job) {
    setAttr(li, "data-state", job.state);
    setText(li.querySelector(".badge"), STAGES[job.state] || job.state);
    setText(li.querySelector(".name"), job.name);
    setText(li.querySelector(".detail"), percent(Math.max(0, Math.min(1, Number(job.progress) || 0))));
    setAttr(li.querySelector('[data-action="cancel"]'), "aria-label", "Cancel " + job.name);
  }

  function renderAlso(active, running) {
    const others = active.filter((job) => !running || job.id !== running.id);
    syncList($("also"), others, createAlsoItem, updateAlsoItem);
    show($("also"), others.length > 0);
  }

  function renderQueue(queued) {
    queueIds = queued.map((job) => job.id);
    syncList($("queue"), queued, createQueueItem, updateQueueItem);
    setText($("queue-count"), String(queued.length));
    show($("queue-empty"), queued.length === 0);
    show($("queue-hint"), queued.length > 1);
    const eta = current && current.eta;
    const words = etaWords(eta);
    const box = $("queue-eta");
    setText(box, words);
    setAttr(box, "data-finish", eta && eta.finish ? String(eta.finish) : null);
    show(box, Boolean(words));
  }

  function renderWaiting(waiting) {
    const count = waiting.length;
    const el = $("waiting");
    setText(el, count === 1 ? "1 more file waits in the inbox until the queue has room."
      : count + " more files wait in the inbox until the queue has room.");
    setAttr(el, "data-count", String(count));
    show(el, count > 0);
  }

  function renderRecent(jobs) {
    const finished = jobs.filter((job) => FINAL.has(job.state))
      .sort((a, b) => (b.finished_at || b.created_at || 0) - (a.finished_at || a.created_at || 0))
      .slice(0, RECENT_LIMIT);
    syncList($("recent"), finished, createRecentItem, updateRecentItem);
    show($("recent-empty"), finished.length === 0);
  }

  function renderFolders(folders) {
    if (!folders) return;
    setText($("folder-inbox"), folders.inbox || "");
    setText($("folder-outbox"), folders.outbox || "");
    show($("folders"), true);
  }

  /** Where the page can be opened from: this computer, and other devices when it listens
   * wider (with the HTTPS certificate's fingerprint to compare with the browser's). */
  function renderReach(service) {
    const reach = service && service.page;
    if (!reach || !reach.local) return;
    const urls = [reach.local].concat(reach.remote || []);
    setText($("reach-urls"), urls.join("  ·  "));
    setText($("reach-fingerprint"), reach.fingerprint ? "certificate SHA-256 " + reach.fingerprint : "");
    show($("reach"), true);
  }

  function renderTitle(status) {
    const job = status.running;
    let title = "stemdeck-watch";
    if (job) title = percent(job.progress) + " " + job.name + " · " + title;
    else if (status.paused) title = "Paused · " + title;
    if (document.title !== title) document.title = title;
  }

  function render(status) {
    current = status;
    const focus = rememberFocus();
    renderHeader(status);
    renderRunning(status.running || null);
    renderAlso(status.active || [], status.running || null);
    renderQueue(status.queued || []);
    renderWaiting(status.waiting || []);
    renderRecent(status.jobs || []);
    renderFolders(status.folders);
    renderReach(status.service);
    renderTitle(status);
    restoreFocus(focus);
    document.body.dataset.loaded = "true";
  }

  // ------------------------------------------------------------------ actions

  async function post(path, body) {
    const init = { method: "POST", headers: authHeaders(), cache: "no-store", credentials: "same-origin" };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    let response;
    try {
      response = await fetch(path, init);
    } catch (e) {
      notice("Could not reach the service (" + (e && e.message ? e.message : "network error") + ").");
      return null;
    }
    let data = null;
    try { data = await response.json(); } catch (e) { data = null; }
    if (!response.ok) {
      const message = data && data.error ? data.error : "The service answered " + response.status + ".";
      if (response.status === 401) refused(message);
      else notice(message);
      return null;
    }
    return data || {};
  }

  function jobPath(id, verb) {
    return "/api/jobs/" + encodeURIComponent(id) + "/" + verb;
  }

  function moveBody(id, direction) {
    const i = queueIds.indexOf(id);
    if (i < 0) return null;
    if (direction === "up") {
      if (i === 0) return null;
      return i === 1 ? { first: true } : { after: queueIds[i - 2] };
    }
    if (i >= queueIds.length - 1) return null;
    return { after: queueIds[i + 1] };
  }

  function move(id, body) {
    if (!body) return;
    post(jobPath(id, "move"), body);
  }

  function onClick(event) {
    const button = event.target.closest("button[data-action]");
    if (!button || button.disabled || button.getAttribute("aria-disabled") === "true") return;
    const action = button.dataset.action;
    const holder = button.closest("[data-job-id]");
    const id = holder ? holder.dataset.jobId : "";
    switch (action) {
      case "pause":
      case "start":
        post("/api/queue/" + action);
        break;
      case "cancel":
        if (id) post(jobPath(id, "cancel"));
        break;
      case "retry":
        if (id) post(jobPath(id, "retry"));
        break;
      case "move-up":
        move(id, moveBody(id, "up"));
        break;
      case "move-down":
        move(id, moveBody(id, "down"));
        break;
      case "dismiss":
        dismiss(button);
        break;
      case "listen":
        if (id) window.StemdeckPlayer.open(id, { headers: authHeaders, notice, refused });
        break;
      default:
        break;
    }
  }

  // ------------------------------------------------------------------ drag and drop

  let dragId = null;

  function clearDropMarks() {
    for (const el of $("queue").querySelectorAll(".drop-before, .drop-after, .dragging")) {
      el.classList.remove("drop-before", "drop-after", "dragging");
    }
  }

  function dropPlace(event) {
    const li = event.target.closest ? event.target.closest("#queue > li[data-job-id]") : null;
    if (li && li.dataset.jobId !== dragId) {
      const box = li.getBoundingClientRect();
      return { li, before: event.clientY < box.top + box.height / 2 };
    }
    return { li: null, before: false };
  }

  /** "after X" (or first) for dropping `id` before or after `target`; null if nothing moves. */
  function dropBody(id, targetId, before) {
    const others = queueIds.filter((other) => other !== id);
    let anchor; // null = first
    if (targetId === null) anchor = others.length ? others[others.length - 1] : null;
    else if (before) {
      const t = others.indexOf(targetId);
      if (t < 0) return null;
      anchor = t === 0 ? null : others[t - 1];
    } else anchor = targetId;
    const i = queueIds.indexOf(id);
    if (i < 0) return null;
    const now = i === 0 ? null : queueIds[i - 1];
    if (anchor === now) return null;
    return anchor === null ? { first: true } : { after: anchor };
  }

  function setUpDragAndDrop() {
    const list = $("queue");
    list.addEventListener("dragstart", (event) => {
      const li = event.target.closest ? event.target.closest("li[data-job-id]") : null;
      if (!li) return;
      dragId = li.dataset.jobId;
      li.classList.add("dragging");
      event.dataTransfer.effectAllowed = "move";
      event.dataTransfer.setData("text/plain", li.querySelector(".name").textContent);
    });
    list.addEventListener("dragover", (event) => {
      if (!dragId) return;
      event.preventDefault();
      event.dataTransfer.dropEffect = "move";
      const place = dropPlace(event);
      for (const el of list.querySelectorAll(".drop-before, .drop-after")) {
        if (el !== place.li) el.classList.remove("drop-before", "drop-after");
      }
      if (place.li) {
        place.li.classList.toggle("drop-before", place.before);
        place.li.classList.toggle("drop-after", !place.before);
      }
    });
    list.addEventListener("dragleave", (event) => {
      if (!list.contains(event.relatedTarget)) {
        for (const el of list.querySelectorAll(".drop-before, .drop-after")) {
          el.classList.remove("drop-before", "drop-after");
        }
      }
    });
    list.addEventListener("drop", (event) => {
      if (!dragId) return;
      event.preventDefault();
      const id = dragId;
      const place = dropPlace(event);
      dragId = null;
      clearDropMarks();
      move(id, dropBody(id, place.li ? place.li.dataset.jobId : null, place.before));
    });
    list.addEventListener("dragend", () => {
      dragId = null;
      clearDropMarks();
    });
  }

  // ------------------------------------------------------------------ the event stream

  let backoff = BACKOFF_MIN_MS;
  let stopped = false;

  /** A parser for text/event-stream: feed it decoded text, it calls onEvent(type, data). */
  function sseParser(onEvent) {
    let buffer = "";
    let data = [];
    let type = "";
    return function feed(text) {
      buffer += text;
      for (;;) {
        const end = buffer.search(/\r\n|\r|\n/);
        if (end < 0) break;
        if (buffer[end] === "\r" && end === buffer.length - 1) break; // maybe \r\n split
        const size = buffer.startsWith("\r\n", end) ? 2 : 1;
        const line = buffer.slice(0, end);
        buffer = buffer.slice(end + size);
        if (line === "") {
          if (data.length) onEvent(type || "message", data.join("\n"));
          data = [];
          type = "";
        } else if (line[0] !== ":") {
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          let value = colon < 0 ? "" : line.slice(colon + 1);
          if (value[0] === " ") value = value.slice(1);
          if (field === "event") type = value;
          else if (field === "data") data.push(value);
        }
      }
    };
  }

  /** Replace the queue with a help text: no token, or the service refused it. */
  function showHelp(title, reason) {
    setText($("help-title"), title);
    setText($("help-reason"), reason || "");
    show($("help-reason"), Boolean(reason));
    show($("no-token"), true);
    for (const id of ["now", "queue-panel", "add-panel", "recent-panel"]) show($(id), false);
    show($("pause-toggle"), false);
    show($("pause-reason"), false);
    document.body.dataset.view = "help";
  }

  function refused(message) {
    if (!token && !stopped) {  // a signed-in device whose session ended: sign in again
      stopped = true;
      location.assign("/signin");
      return;
    }
    if (window.StemdeckPlayer) window.StemdeckPlayer.close();
    stopped = true;
    forgetToken();
    setConnection("refused", "not connected: the token was refused");
    showHelp("The service refused this page's token", message);
  }

  function scheduleReconnect() {
    if (stopped) return;
    setConnection("disconnected", "disconnected — reconnecting…");
    const delay = backoff;
    backoff = Math.min(backoff * 2, BACKOFF_MAX_MS);
    setTimeout(connect, delay);
  }

  async function connect() {
    if (stopped) return;
    if (document.body.dataset.connection !== "disconnected") setConnection("connecting", "connecting…");
    const abort = new AbortController();
    let silence = null;
    const watch = () => {
      clearTimeout(silence);
      silence = setTimeout(() => abort.abort(), SILENCE_LIMIT_MS);
    };
    try {
      watch();
      const response = await fetch("/api/queue/events", {
        headers: authHeaders({ Accept: "text/event-stream" }),
        cache: "no-store",
        credentials: "same-origin",
        signal: abort.signal,
      });
      if (response.status === 401 || response.status === 403) {
        let data = null;
        try { data = await response.json(); } catch (e) { data = null; }
        const message = data && data.error ? data.error : "The service answered " + response.status + ".";
        if (response.status === 401) {
          refused(message);
        } else {
          stopped = true;
          notice(message);
          setConnection("refused", "not connected: refused");
        }
        return;
      }
      if (!response.ok || !response.body) throw new Error("status " + response.status);
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      const feed = sseParser((type, data) => {
        if (type !== "queue" && type !== "message") return;
        let status;
        try { status = JSON.parse(data); } catch (e) { return; }
        backoff = BACKOFF_MIN_MS;
        setConnection("live", "live");
        render(status);
      });
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        watch();
        feed(decoder.decode(value, { stream: true }));
      }
    } catch (e) {
      /* network error, server gone, or silence: reconnect below */
    } finally {
      clearTimeout(silence);
    }
    scheduleReconnect();
  }

  // ------------------------------------------------------------------ start

  async function onHashChange() {
    // A fresh #code=… or #token=… on an open page (the service restarted, `open` ran again):
    // take it, then start over with it.
    const params = new URLSearchParams(location.hash.replace(/^#/, ""));
    if (!params.get("token") && !params.get("code")) return;
    try {
      if (await readToken()) location.reload();
    } catch (e) {
      notice(e.message);
    }
  }

  async function main() {
    document.addEventListener("click", onClick);
    window.addEventListener("hashchange", onHashChange);
    setUpDragAndDrop();
    try {
      token = await readToken();
    } catch (e) {
      stopped = true;
      forgetToken();
      setConnection("refused", "not connected: this page link does not work");
      showHelp("This page link does not work", e.message);
      return;
    }
    if (!token && await signedIn()) {
      show($("signout"), true);
    } else if (!token) {
      stopped = true;
      setConnection("no-token", "not connected: no token");
      showHelp("No access token", "This page needs the service's token, and it has none.");
      return;
    }
    connect();
    if (window.StemdeckAdd) window.StemdeckAdd.start({ headers: authHeaders, notice, refused });
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", main);
  else main();
})();
