/* stemdeck-watch queue page: adding songs and links.
 *
 * Songs dropped anywhere on the page (or chosen with the file button) are uploaded one after
 * the other with POST /api/uploads — the file's bytes as they are, streamed by the browser —
 * into the inbox (or a preset's folder), where the service takes them like any file dropped
 * into the folder. A link typed or pasted into the link box (or dragged onto the page from
 * another tab) is added with POST /api/links as a .url file. What the service refuses, and
 * files over the upload limit (refused here, before a byte is sent), are listed with the
 * reason. XMLHttpRequest rather than fetch: it reports upload progress.
 */
"use strict";

(function () {
  const MAX_ROWS = 12;
  const $ = (id) => document.getElementById(id);
  let env = null; // {headers, notice, refused} from app.js
  let limits = null; // GET /api/intake
  const waiting = []; // files not sent yet
  let sending = false;

  function mb(bytes) {
    return (bytes / 1048576).toFixed(1) + " MB";
  }

  function row(name) {
    const list = $("uploads");
    const item = document.createElement("li");
    item.className = "upload";
    const label = document.createElement("span");
    label.className = "upload-name";
    label.textContent = name;
    const state = document.createElement("span");
    state.className = "upload-state";
    item.append(label, state);
    list.prepend(item);
    while (list.children.length > MAX_ROWS) list.lastElementChild.remove();
    return {
      set(kind, text) {
        item.dataset.state = kind;
        state.textContent = text;
      },
    };
  }

  function preset() {
    return $("add-preset").value || "";
  }

  /** Why the service would refuse `file`, said before sending it; null if it would not. */
  function refusal(file) {
    if (!limits) return "the page has not loaded the service's limits yet";
    const dot = file.name.lastIndexOf(".");
    const ext = dot >= 0 ? file.name.slice(dot + 1).toLowerCase() : "";
    if (!limits.extensions.includes(ext)) {
      return "not a song the inbox takes (" + (ext ? "." + ext : "no extension") + "; it takes "
        + limits.extensions.join(", ") + ")";
    }
    if (file.size > limits.max_upload_bytes) {
      return file.name + " has " + mb(file.size) + "; uploads are limited to "
        + Math.round(limits.max_upload_bytes / 1048576) + " MB (api.max_upload_mb) — copy it into the inbox folder instead";
    }
    return null;
  }

  function add(files) {
    for (const file of files) {
      const line = row(file.name);
      const why = refusal(file);
      if (why) line.set("refused", "Refused: " + why);
      else {
        line.set("waiting", "Waiting…");
        waiting.push({ file, line, preset: preset() });
      }
    }
    next();
  }

  function next() {
    if (sending || !waiting.length) return;
    sending = true;
    const { file, line, preset: chosen } = waiting.shift();
    const xhr = new XMLHttpRequest();
    const query = "?name=" + encodeURIComponent(file.name) + (chosen ? "&preset=" + encodeURIComponent(chosen) : "");
    xhr.open("POST", "/api/uploads" + query);
    const headers = env.headers({ "Content-Type": "application/octet-stream" });
    for (const [name, value] of Object.entries(headers)) xhr.setRequestHeader(name, value);
    xhr.upload.onprogress = (event) => {
      if (event.lengthComputable) line.set("sending", "Uploading " + Math.floor(100 * event.loaded / event.total) + "%");
    };
    const done = () => { sending = false; next(); };
    xhr.onload = () => {
      let data = null;
      try { data = JSON.parse(xhr.responseText); } catch (e) { data = null; }
      if (xhr.status === 200 && data) line.set("added", "Added to the inbox as " + data.file);
      else {
        const message = data && data.error ? data.error : "the service answered " + xhr.status;
        line.set("refused", "Refused: " + message);
        if (xhr.status === 401) env.refused(message);
      }
      done();
    };
    xhr.onerror = () => { line.set("refused", "Could not reach the service"); done(); };
    line.set("sending", "Uploading 0%");
    xhr.send(file);
  }

  async function addLink(url) {
    const line = row(url);
    line.set("sending", "Adding…");
    const body = { url };
    if (preset()) body.preset = preset();
    let response;
    let data = null;
    try {
      response = await fetch("/api/links", {
        method: "POST", cache: "no-store", credentials: "same-origin",
        headers: env.headers({ "Content-Type": "application/json" }), body: JSON.stringify(body) });
      data = await response.json();
    } catch (e) {
      line.set("refused", "Could not reach the service");
      return false;
    }
    if (response.ok && data) {
      line.set("added", "Added to the inbox as " + data.file);
      return true;
    }
    const message = data && data.error ? data.error : "the service answered " + response.status;
    line.set("refused", "Refused: " + message);
    if (response.status === 401) env.refused(message);
    return false;
  }

  function hasFiles(event) {
    return event.dataTransfer && Array.from(event.dataTransfer.types || []).includes("Files");
  }

  function hasLink(event) {
    const types = event.dataTransfer ? Array.from(event.dataTransfer.types || []) : [];
    return types.includes("text/uri-list") && !types.includes("Files");
  }

  function setUpDrops() {
    const zone = $("drop-zone");
    let depth = 0;
    document.addEventListener("dragenter", (event) => {
      if (!limits || !(hasFiles(event) || hasLink(event))) return;
      depth++;
      zone.classList.add("active");
    });
    document.addEventListener("dragleave", (event) => {
      if (!limits || !(hasFiles(event) || hasLink(event))) return;
      depth = Math.max(0, depth - 1);
      if (!depth) zone.classList.remove("active");
    });
    document.addEventListener("dragover", (event) => {
      if (!limits || !(hasFiles(event) || hasLink(event))) return;
      event.preventDefault();
      event.dataTransfer.dropEffect = "copy";
    });
    document.addEventListener("drop", (event) => {
      if (!limits || !(hasFiles(event) || hasLink(event))) return;
      event.preventDefault();
      depth = 0;
      zone.classList.remove("active");
      if (hasFiles(event)) add(Array.from(event.dataTransfer.files));
      else {
        const url = (event.dataTransfer.getData("text/uri-list") || "").split(/\r?\n/)
          .find((line) => line && !line.startsWith("#"));
        if (url) addLink(url.trim());
      }
    });
  }

  async function start(environment) {
    env = environment;
    let response;
    try {
      response = await fetch("/api/intake", { headers: env.headers(), cache: "no-store", credentials: "same-origin" });
      if (!response.ok) return;
      limits = await response.json();
    } catch (e) {
      return;
    }
    const select = $("add-preset");
    for (const name of limits.presets) {
      const option = document.createElement("option");
      option.value = name;
      option.textContent = name;
      select.appendChild(option);
    }
    $("preset-row").hidden = limits.presets.length === 0;
    $("link-form").hidden = !limits.links;
    $("add-limit").textContent = "Up to " + Math.round(limits.max_upload_bytes / 1048576) + " MB each.";
    $("add-files").addEventListener("change", (event) => {
      add(Array.from(event.target.files || []));
      event.target.value = "";
    });
    $("link-form").addEventListener("submit", async (event) => {
      event.preventDefault();
      const box = $("link-url");
      const url = box.value.trim();
      if (url && await addLink(url)) box.value = "";
    });
    $("add-panel").hidden = false;
  }

  window.StemdeckAdd = { start };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", setUpDrops);
  else setUpDrops();
})();
