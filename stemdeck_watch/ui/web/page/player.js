/* stemdeck-watch player: a finished song's stems in the page, with mute, solo and volume.
 *
 * Sound comes from one AudioWorklet (player-worklet.js) that mixes every stem from a single
 * frame counter, so the stems stay sample-aligned whatever the network does. This side feeds
 * it: each stem is fetched in chunks by HTTP Range request, a few seconds ahead of the
 * playhead and no further, so a ten-minute song starts as soon as its first chunks are here
 * and memory stays flat. WAV stems are converted to samples here, exactly (16/24/32-bit
 * integer, 32/64-bit float); FLAC and MP3 stems are fetched whole (in Range pieces) and
 * decoded by the browser. The preview picture is the seek bar; the beat grid is an optional
 * click. `window.StemdeckPlayer` is what app.js calls (and what the browser tests read).
 */
"use strict";

(function () {
  const CHUNK_FRAMES = 65536; // ~1.5 s at 44.1 kHz: one Range request per stem and chunk
  const AHEAD = 8; // chunks loaded ahead of the playhead
  const BEHIND = 1; // and kept behind it
  const HEADER_BYTES = 65536; // a WAV header (with any chunks before "data") fits in this
  const WHOLE_PIECE = 1 << 20; // Range pieces of a FLAC/MP3 stem fetched whole
  const MAX_REQUESTS = 4;
  const SEEK_STEP = 5; // seconds: arrow keys on the seek bar
  const SEEK_PAGE = 30; // seconds: Page Up / Page Down
  const MAX_LOGGED = 400;

  const $ = (id) => document.getElementById(id);
  let session = null;

  // ------------------------------------------------------------------ helpers

  function clock(seconds) {
    const s = Math.max(0, Math.floor(seconds || 0));
    const h = Math.floor(s / 3600);
    const m = Math.floor((s % 3600) / 60);
    const rest = String(s % 60).padStart(2, "0");
    return h ? h + ":" + String(m).padStart(2, "0") + ":" + rest : m + ":" + rest;
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

  class Refused extends Error {}

  /** fetch with the token; an Error saying what the service answered when it refused. */
  async function get(s, url, range, signal) {
    const headers = s.env.headers(range ? { Range: range } : {});
    const response = await fetch(url, { headers, cache: "no-store", credentials: "same-origin", signal });
    if (!response.ok) {
      let message = "the service answered " + response.status;
      try {
        const data = await response.json();
        if (data && data.error) message = data.error;
      } catch (e) { /* not JSON */ }
      if (response.status === 401) throw new Refused(message);
      throw new Error(message);
    }
    return response;
  }

  function logRequest(s, stem, response) {
    s.requests.push({ stem, status: response.status, range: response.headers.get("Content-Range") });
    if (s.requests.length > MAX_LOGGED) s.requests.splice(0, s.requests.length - MAX_LOGGED);
  }

  // ------------------------------------------------------------------ WAV

  /** The fmt and data chunks of a WAV file's first bytes; null if it is not one we read. */
  function parseWav(buffer, total) {
    const v = new DataView(buffer);
    const tag4 = (at) => String.fromCharCode(v.getUint8(at), v.getUint8(at + 1), v.getUint8(at + 2), v.getUint8(at + 3));
    if (v.byteLength < 12 || tag4(0) !== "RIFF" || tag4(8) !== "WAVE") return null;
    let fmt = null;
    let at = 12;
    while (at + 8 <= v.byteLength) {
      const id = tag4(at);
      const size = v.getUint32(at + 4, true);
      if (id === "fmt " && at + 24 <= v.byteLength) {
        let format = v.getUint16(at + 8, true);
        if (format === 0xfffe && at + 34 <= v.byteLength) format = v.getUint16(at + 32, true);
        fmt = { format, channels: v.getUint16(at + 10, true), rate: v.getUint32(at + 12, true),
                blockAlign: v.getUint16(at + 20, true), bits: v.getUint16(at + 22, true) };
      } else if (id === "data") {
        if (!fmt) return null;
        const known = (fmt.format === 1 && [8, 16, 24, 32].includes(fmt.bits))
          || (fmt.format === 3 && [32, 64].includes(fmt.bits));
        if (!known || fmt.blockAlign !== fmt.channels * fmt.bits / 8) return null;
        const offset = at + 8;
        const bytes = Math.min(size, Math.max(0, total - offset));
        return Object.assign(fmt, { offset, bytes });
      }
      at += 8 + size + (size & 1);
    }
    return null;
  }

  /** Samples of whole frames as one Float32Array per channel (exact: x / 2^(bits-1)). */
  function wavSamples(buffer, w) {
    const frames = Math.floor(buffer.byteLength / w.blockAlign);
    const ch = w.channels;
    const out = Array.from({ length: ch }, () => new Float32Array(frames));
    if (w.format === 1 && w.bits === 16) {
      const pcm = new Int16Array(buffer, 0, frames * ch);
      for (let f = 0, i = 0; f < frames; f++) for (let c = 0; c < ch; c++) out[c][f] = pcm[i++] / 32768;
      return out;
    }
    const v = new DataView(buffer);
    const bytes = w.bits / 8;
    for (let f = 0; f < frames; f++) {
      for (let c = 0; c < ch; c++) {
        const at = f * w.blockAlign + c * bytes;
        let x;
        if (w.format === 3) x = w.bits === 32 ? v.getFloat32(at, true) : v.getFloat64(at, true);
        else if (w.bits === 24) x = (v.getUint8(at) | (v.getUint8(at + 1) << 8) | (v.getInt8(at + 2) << 16)) / 8388608;
        else if (w.bits === 32) x = v.getInt32(at, true) / 2147483648;
        else x = (v.getUint8(at) - 128) / 128;
        out[c][f] = x;
      }
    }
    return out;
  }

  // ------------------------------------------------------------------ loading

  async function readHeader(s, stem) {
    if (stem.format !== "wav") return null;
    const response = await get(s, stem.url, "bytes=0-" + (HEADER_BYTES - 1), s.abort.signal);
    logRequest(s, stem.name, response);
    const buffer = await response.arrayBuffer();
    const range = response.headers.get("Content-Range");
    const total = range ? Number(range.split("/")[1]) : buffer.byteLength;
    return parseWav(buffer, total);
  }

  async function loadChunk(s, index, k) {
    const stem = s.stems[index];
    const w = stem.wav;
    const first = w.offset + k * CHUNK_FRAMES * w.blockAlign;
    const last = Math.min(w.offset + w.bytes, first + CHUNK_FRAMES * w.blockAlign) - 1;
    const control = new AbortController();
    const abort = () => control.abort();
    s.abort.signal.addEventListener("abort", abort);
    stem.pending.set(k, control);
    s.active++;
    try {
      const response = await get(s, stem.url, "bytes=" + first + "-" + last, control.signal);
      logRequest(s, stem.name, response);
      let buffer = await response.arrayBuffer();
      if (response.status === 200) buffer = buffer.slice(first, last + 1); // Range ignored
      if (s.closed || !stem.pending.has(k)) return;
      const data = wavSamples(buffer, w);
      s.node.port.postMessage({ type: "chunk", stem: index, index: k, data }, data.map((a) => a.buffer));
      stem.loaded.add(k);
    } catch (e) {
      if (!control.signal.aborted) failed(s, stem, e);
    } finally {
      s.abort.signal.removeEventListener("abort", abort);
      if (stem.pending.get(k) === control) stem.pending.delete(k);
      s.active--;
      pump(s);
    }
  }

  /** A FLAC or MP3 stem: fetched whole in Range pieces, decoded by the browser, sent in chunks. */
  async function loadWhole(s, index) {
    const stem = s.stems[index];
    stem.whole = "loading";
    s.active++;
    try {
      const pieces = [];
      let total = Infinity;
      for (let at = 0; at < total; at += WHOLE_PIECE) {
        const response = await get(s, stem.url, "bytes=" + at + "-" + (at + WHOLE_PIECE - 1), s.abort.signal);
        logRequest(s, stem.name, response);
        const buffer = await response.arrayBuffer();
        const range = response.headers.get("Content-Range");
        pieces.push(new Uint8Array(buffer));
        total = range ? Number(range.split("/")[1]) : buffer.byteLength;
        if (response.status === 200) break;
      }
      const bytes = new Uint8Array(pieces.reduce((n, p) => n + p.length, 0));
      let at = 0;
      for (const piece of pieces) { bytes.set(piece, at); at += piece.length; }
      const audio = await s.ctx.decodeAudioData(bytes.buffer);
      if (s.closed) return;
      for (let k = 0; k * CHUNK_FRAMES < audio.length; k++) {
        const data = [];
        for (let c = 0; c < audio.numberOfChannels; c++) {
          data.push(audio.getChannelData(c).slice(k * CHUNK_FRAMES, (k + 1) * CHUNK_FRAMES));
        }
        s.node.port.postMessage({ type: "chunk", stem: index, index: k, data }, data.map((a) => a.buffer));
        stem.loaded.add(k);
      }
      stem.whole = "loaded";
    } catch (e) {
      stem.whole = "failed";
      if (!s.abort.signal.aborted) failed(s, stem, e);
    } finally {
      s.active--;
      pump(s);
    }
  }

  function failed(s, stem, error) {
    if (s.closed) return;
    if (error instanceof Refused) {
      s.env.refused(error.message);
      return;
    }
    const message = "Could not load the " + stem.name + " stem of " + s.info.name + ": " + (error && error.message ? error.message : error);
    s.error = message;
    stem.error = message;
    status(s, message);
    s.env.notice(message);
  }

  /** Ask for the chunks around the playhead that are missing; let go of the others. */
  function pump(s) {
    if (s.closed || !s.ready) return;
    const here = Math.floor(Math.min(s.frame, s.info.frames - 1) / CHUNK_FRAMES);
    const lastChunk = Math.floor(Math.max(0, s.info.frames - 1) / CHUNK_FRAMES);
    const from = Math.max(0, here - BEHIND);
    const to = Math.min(lastChunk, here + AHEAD);
    const wanted = []; // [order, stem, chunk]: the playhead's chunk first, the one behind last
    s.stems.forEach((stem, index) => {
      if (stem.error) return;
      if (!stem.wav) {
        if (!stem.whole) wanted.push([-1, index, -1]);
        return;
      }
      if (stem.window !== from + ":" + to) {
        stem.window = from + ":" + to;
        s.node.port.postMessage({ type: "keep", stem: index, from, to });
        for (const k of Array.from(stem.loaded)) if (k < from || k > to) stem.loaded.delete(k);
        for (const [k, control] of Array.from(stem.pending)) {
          if (k < from || k > to) { stem.pending.delete(k); control.abort(); }
        }
      }
      for (let k = from; k <= to; k++) {
        if (!stem.loaded.has(k) && !stem.pending.has(k)) wanted.push([k < here ? to + 1 : k, index, k]);
      }
    });
    wanted.sort((a, b) => a[0] - b[0] || a[1] - b[1]);
    for (const [order, index, k] of wanted) {
      if (s.active >= MAX_REQUESTS) break;
      if (order < 0) loadWhole(s, index);
      else loadChunk(s, index, k);
    }
  }

  // ------------------------------------------------------------------ the panel

  function status(s, text) {
    const el = $("player-status");
    if (el.textContent !== text) el.textContent = text;
  }

  function render(s) {
    const seconds = s.frame / s.info.samplerate;
    const total = s.info.duration;
    $("player-time").textContent = clock(seconds) + " / " + clock(total);
    const seek = $("player-seek");
    seek.setAttribute("aria-valuenow", String(Math.round(seconds)));
    seek.setAttribute("aria-valuetext", clock(seconds) + " of " + clock(total));
    $("player-playhead").style.left = (total ? Math.min(100, 100 * seconds / total) : 0) + "%";
    const play = $("player-play");
    const label = s.playing ? "Pause" : "Play";
    if (play.textContent !== label) play.textContent = label;
    play.setAttribute("aria-pressed", s.playing ? "true" : "false");
    if (s.error) return;
    if (s.playing && s.stalled) status(s, "Loading…");
    else if (s.ready) status(s, s.playing ? "Playing" : "Ready");
  }

  function buildStems(s) {
    const list = $("player-stems");
    list.textContent = "";
    s.stems.forEach((stem, index) => {
      const volume = make("input", { type: "range", min: "0", max: "1.5", step: "0.05", value: "1",
        "data-stem": String(index), "aria-label": "Volume of " + stem.name });
      list.appendChild(make("li", { className: "stem", "data-stem": String(index), "data-name": stem.name }, [
        make("span", { className: "stem-name", text: stem.name }),
        make("button", { type: "button", className: "mute", "data-player": "mute", "data-stem": String(index),
          "aria-pressed": "false", "aria-label": "Mute " + stem.name, text: "Mute" }),
        make("button", { type: "button", className: "solo", "data-player": "solo", "data-stem": String(index),
          "aria-pressed": "false", "aria-label": "Solo " + stem.name, text: "Solo" }),
        volume,
      ]));
    });
  }

  function applyGains(s) {
    const soloed = s.stems.some((stem) => stem.solo);
    const gains = s.stems.map((stem) => (stem.muted || (soloed && !stem.solo) ? 0 : stem.volume));
    s.node.port.postMessage({ type: "gains", gains });
    s.stems.forEach((stem, index) => {
      const row = $("player-stems").children[index];
      row.querySelector(".mute").setAttribute("aria-pressed", stem.muted ? "true" : "false");
      row.querySelector(".solo").setAttribute("aria-pressed", stem.solo ? "true" : "false");
      row.classList.toggle("silent", gains[index] === 0);
    });
  }

  async function drawPicture(s) {
    const canvas = $("player-picture");
    const g = canvas.getContext("2d");
    const p = s.info.preview;
    if (p) {
      try {
        const response = await get(s, p.url, null, s.abort.signal);
        const bitmap = await createImageBitmap(await response.blob());
        if (s.closed) return;
        canvas.width = p.width - p.left;
        canvas.height = p.height - p.top;
        g.drawImage(bitmap, p.left, p.top, canvas.width, canvas.height, 0, 0, canvas.width, canvas.height);
        canvas.dataset.picture = "preview";
        return;
      } catch (e) {
        if (e instanceof Refused) { s.env.refused(e.message); return; }
      }
    }
    canvas.width = 1090;
    canvas.height = 60;
    g.fillStyle = "#2a2e38";
    g.fillRect(0, 0, canvas.width, canvas.height);
    canvas.dataset.picture = "none";
  }

  async function loadBeats(s) {
    const box = $("player-click");
    box.checked = false;
    box.disabled = true;
    if (!s.info.beats) return;
    try {
      const grid = await (await get(s, s.info.beats, null, s.abort.signal)).json();
      if (s.closed || !grid.beats.length) return;
      s.node.port.postMessage({ type: "beats", frames: grid.beats.map((t) => t * s.info.samplerate) });
      box.disabled = false;
    } catch (e) {
      if (e instanceof Refused) s.env.refused(e.message);
    }
  }

  // ------------------------------------------------------------------ actions

  async function open(jobId, env) {
    close();
    const s = { jobId, env, closed: false, ready: false, frame: 0, playing: false, stalled: false,
                active: 0, requests: [], abort: new AbortController(), error: null, probes: new Map(),
                opener: document.activeElement };
    session = s;
    const panel = $("player");
    panel.hidden = false;
    $("player-name").textContent = "";
    $("player-stems").textContent = "";
    $("player-play").disabled = true;
    status(s, "Loading…");
    panel.scrollIntoView({ block: "nearest" });
    try {
      const response = await get(s, "/api/jobs/" + encodeURIComponent(jobId) + "/player", null, s.abort.signal);
      s.info = await response.json();
      if (s.closed) return;
      $("player-name").textContent = s.info.name;
      $("player-seek").setAttribute("aria-valuemax", String(Math.round(s.info.duration)));
      s.stems = s.info.stems.map((stem) => Object.assign({}, stem, {
        muted: false, solo: false, volume: 1, loaded: new Set(), pending: new Map(),
        wav: null, whole: null, window: "", error: null }));
      s.ctx = new AudioContext({ sampleRate: s.info.samplerate, latencyHint: "playback" });
      await s.ctx.audioWorklet.addModule("/player-worklet.js");
      if (s.closed) return;
      s.node = new AudioWorkletNode(s.ctx, "stemdeck-player", {
        numberOfInputs: 0, numberOfOutputs: 1, outputChannelCount: [2],
        processorOptions: { stems: s.stems.length, frames: s.info.frames, chunkFrames: CHUNK_FRAMES } });
      s.node.port.onmessage = (event) => onMessage(s, event.data);
      s.node.connect(s.ctx.destination);
      buildStems(s);
      drawPicture(s);
      loadBeats(s);
      const headers = await Promise.all(s.stems.map((stem) => readHeader(s, stem)));
      if (s.closed) return;
      headers.forEach((wav, index) => { s.stems[index].wav = wav; });
      s.ready = true;
      $("player-play").disabled = false;
      render(s);
      pump(s);
      $("player-play").focus({ preventScroll: true });
    } catch (e) {
      if (s.closed || s.abort.signal.aborted) return;
      if (e instanceof Refused) { env.refused(e.message); return; }
      s.error = "Could not open the player: " + (e && e.message ? e.message : e);
      status(s, s.error);
      env.notice(s.error);
    }
  }

  function onMessage(s, m) {
    if (s.closed) return;
    if (m.type === "position" || m.type === "ended") {
      s.frame = m.frame;
      if (m.type === "ended") s.playing = false;
      else { s.playing = m.playing; s.stalled = m.stalled; }
      render(s);
      pump(s);
    } else if (m.type === "probe") {
      const resolve = s.probes.get(m.id);
      s.probes.delete(m.id);
      if (resolve) resolve(m.probe);
    }
  }

  function close() {
    const s = session;
    if (!s) return;
    session = null;
    s.closed = true;
    s.abort.abort();
    if (s.ctx) s.ctx.close().catch(() => {});
    for (const resolve of s.probes.values()) resolve(null);
    const panel = $("player");
    const hadFocus = panel.contains(document.activeElement);
    panel.hidden = true;
    $("player-stems").textContent = "";
    if (hadFocus && s.opener && s.opener.isConnected) s.opener.focus({ preventScroll: true });
  }

  function toggle() {
    const s = session;
    if (!s || !s.ready) return;
    s.playing = !s.playing;
    if (s.playing) s.ctx.resume();
    s.node.port.postMessage({ type: s.playing ? "play" : "pause" });
    render(s);
  }

  function seek(seconds) {
    const s = session;
    if (!s || !s.ready) return;
    const frame = Math.max(0, Math.min(s.info.frames, Math.round(seconds * s.info.samplerate)));
    s.frame = frame;
    s.node.port.postMessage({ type: "seek", frame });
    render(s);
    pump(s);
  }

  function seekAt(event) {
    const s = session;
    if (!s || !s.ready) return;
    const box = $("player-picture").getBoundingClientRect();
    const x = Math.max(0, Math.min(1, (event.clientX - box.left) / box.width));
    seek(x * s.info.duration);
  }

  function onClick(event) {
    const button = event.target.closest("button[data-player]");
    const s = session;
    if (!button) return;
    if (button.dataset.player === "close") { close(); return; }
    if (!s || !s.ready) return;
    const stem = s.stems[Number(button.dataset.stem)];
    switch (button.dataset.player) {
      case "play": toggle(); break;
      case "mute": stem.muted = !stem.muted; applyGains(s); break;
      case "solo": stem.solo = !stem.solo; applyGains(s); break;
      default: break;
    }
  }

  function onInput(event) {
    const s = session;
    if (!s || !s.ready) return;
    if (event.target.id === "player-click") {
      s.node.port.postMessage({ type: "click", on: event.target.checked });
    } else if (event.target.type === "range" && event.target.dataset.stem !== undefined) {
      s.stems[Number(event.target.dataset.stem)].volume = Number(event.target.value);
      applyGains(s);
    }
  }

  function onKey(event) {
    const s = session;
    if (!s) return;
    const target = event.target;
    if (event.key === "Escape") { close(); event.preventDefault(); return; }
    if (!s.ready || event.altKey || event.ctrlKey || event.metaKey) return;
    const control = target.closest("button, input, select, textarea");
    if (event.key === "k" || (event.key === " " && !control)) {
      toggle();
      event.preventDefault();
      return;
    }
    if (target.id !== "player-seek") return;
    const now = s.frame / s.info.samplerate;
    const to = { ArrowLeft: now - SEEK_STEP, ArrowDown: now - SEEK_STEP, ArrowRight: now + SEEK_STEP,
                 ArrowUp: now + SEEK_STEP, PageDown: now - SEEK_PAGE, PageUp: now + SEEK_PAGE,
                 Home: 0, End: s.info.duration }[event.key];
    if (to === undefined) return;
    seek(to);
    event.preventDefault();
  }

  function setUp() {
    const panel = $("player");
    if (!panel) return;
    panel.addEventListener("click", onClick);
    panel.addEventListener("input", onInput);
    panel.addEventListener("keydown", onKey);
    const bar = $("player-seek");
    bar.addEventListener("pointerdown", (event) => {
      try {
        bar.setPointerCapture(event.pointerId); // keep seeking while dragged off the bar
      } catch (e) { /* a pointer that is gone already */ }
      seekAt(event);
    });
    bar.addEventListener("pointermove", (event) => {
      if (bar.hasPointerCapture(event.pointerId)) seekAt(event);
    });
  }

  // ------------------------------------------------------------------ for app.js and tests

  window.StemdeckPlayer = {
    open,
    close,
    seek,
    toggle,
    isOpen: () => session !== null,
    /** What the player is doing: position, every stem's chunks and the requests made. */
    state() {
      const s = session;
      if (!s) return null;
      return {
        job: s.jobId, ready: s.ready, playing: s.playing, stalled: s.stalled, error: s.error,
        frame: s.frame, samplerate: s.info ? s.info.samplerate : null,
        contextRate: s.ctx ? s.ctx.sampleRate : null, contextState: s.ctx ? s.ctx.state : null,
        stems: (s.stems || []).map((stem) => ({ name: stem.name, format: stem.format,
          wav: Boolean(stem.wav), loaded: Array.from(stem.loaded).sort((a, b) => a - b),
          whole: stem.whole, muted: stem.muted, solo: stem.solo, volume: stem.volume })),
        requests: s.requests.slice(),
        chunkFrames: CHUNK_FRAMES,
      };
    },
    /** The next quantum the audio thread plays, sample by sample: its first frame, every
     * stem's samples and the mix it sent out. */
    probe() {
      const s = session;
      if (!s || !s.node) return Promise.resolve(null);
      const id = Math.random().toString(36).slice(2);
      return new Promise((resolve) => {
        s.probes.set(id, resolve);
        s.node.port.postMessage({ type: "probe", id });
      });
    },
  };

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", setUp);
  else setUp();
})();
