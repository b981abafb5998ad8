"use strict";
// flared's chat page: /v1/chat/completions streamed, as any OpenAI client calls it. No framework, no outside
// assets. parseSSE and streamChat also run under Node (tests/api/test_webui.py); the page code below them only
// runs in a browser.

// Complete server-sent events at the front of `buffer`: [their data fields, the unfinished rest].
function parseSSE(buffer) {
  const events = [];
  const blank = /\r?\n\r?\n/;
  let m;
  while ((m = blank.exec(buffer)) !== null) {
    const block = buffer.slice(0, m.index);
    buffer = buffer.slice(m.index + m[0].length);
    const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:"))
      .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
    if (data) events.push(data);
  }
  return [events, buffer];
}

// One streamed chat completion. onDelta(content, reasoning) for each piece; resolves to {usage, finish}.
async function streamChat({ base = "", apiKey = "", model, messages, temperature, maxTokens, signal }, onDelta) {
  const headers = { "Content-Type": "application/json" };
  if (apiKey) headers["Authorization"] = "Bearer " + apiKey;
  const body = { model, messages, stream: true, stream_options: { include_usage: true } };
  if (temperature !== undefined && temperature !== null && temperature !== "") body.temperature = Number(temperature);
  if (maxTokens) body.max_tokens = Number(maxTokens);
  const resp = await fetch(base + "/v1/chat/completions", {
    method: "POST", headers, body: JSON.stringify(body), signal,
  });
  if (!resp.ok) {
    let message = resp.statusText;
    try { message = (await resp.json()).error.message; } catch (e) { /* not JSON */ }
    throw new Error(`${resp.status}: ${message}`);
  }
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let usage = null;
  let finish = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let events;
    [events, buffer] = parseSSE(buffer);
    for (const data of events) {
      // a stop stops here, not after the events already read
      if (signal && signal.aborted) throw signal.reason || new DOMException("stopped", "AbortError");
      if (data === "[DONE]") return { usage, finish };
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "the stream failed");
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const d = choice.delta || {};
      if (d.content || d.reasoning_content) onDelta(d.content || "", d.reasoning_content || "");
      if (choice.finish_reason) finish = choice.finish_reason;
    }
  }
  return { usage, finish };
}

// An attached file's data URL as OpenAI's content part: an image_url, (data:video/...) vLLM's video_url, or
// (data:audio/...) an input_audio with its base64 and format (the subtype: wav, mpeg as mp3, flac, ogg).
function mediaPart(url) {
  if (url.startsWith("data:video/")) return { type: "video_url", video_url: { url } };
  const m = /^data:audio\/([\w.+-]+)[^,]*;base64,(.*)$/s.exec(url);
  if (!m) return { type: "image_url", image_url: { url } };
  const kind = m[1].toLowerCase();
  const format = { mpeg: "mp3", mp3: "mp3", "x-wav": "wav", wave: "wav", "x-flac": "flac" }[kind] || kind;
  return { type: "input_audio", input_audio: { data: m[2], format } };
}

// A user turn's content: the text alone, or (with attachments: data URLs of images or audio) OpenAI's parts, the
// attachments first.
function userContent(text, images) {
  if (!images || images.length === 0) return text;
  const parts = images.map(mediaPart);
  if (text) parts.push({ type: "text", text });
  return parts;
}

// The attach button for a model card's capabilities: its label, its tooltip and the file types it offers (a model
// may take images, videos and audio all at once: Gemma 4).
function attachKinds(caps) {
  const images = caps.vision ? "image/png,image/jpeg,image/webp" : "";
  const videos = caps.vision && caps.video ? "video/mp4,video/webm,video/quicktime,video/x-matroska" : "";
  const audio = caps.audio ? "audio/wav,audio/x-wav,audio/mpeg,audio/flac,audio/ogg" : "";
  const names = [caps.vision ? "Image" : "", videos ? "video" : "", audio ? "audio" : ""].filter(Boolean);
  const label = names.map((n, i) => (i === 0 ? n[0].toUpperCase() + n.slice(1) : n)).join("/");
  const what = [caps.vision ? "images" : "", videos ? "videos" : "", audio ? "audio clips" : ""].filter(Boolean);
  return { show: names.length > 0, label,
           title: "attach " + what.join(" or ") + " (this model " +
                  (audio ? (caps.vision ? "takes them" : "listens to them") : videos ? "watches them" : "reads them")
                  + ")",
           accept: [images, videos, audio].filter(Boolean).join(",") };
}

if (typeof module !== "undefined") module.exports = { parseSSE, streamChat, userContent, mediaPart, attachKinds };

if (typeof document !== "undefined") {
  const $ = (id) => document.getElementById(id);
  const log = $("log"), input = $("input"), send = $("send"), stop = $("stop"), status = $("status");
  const settings = ["system", "temperature", "max-tokens", "api-key"];
  for (const id of settings) {  // kept in the browser between visits
    const saved = localStorage.getItem("flared." + id);
    if (saved !== null) $(id).value = saved;
    $(id).addEventListener("change", () => localStorage.setItem("flared." + id, $(id).value));
  }
  let history = [];
  let model = null;
  let running = null;
  let images = [];  // data URLs (images and videos, or an audio model's clips) attached to the next message
  const attached = $("attached"), pick = $("pick");

  // An attachment shown: an image, or a clip's or a video's player (with a button that takes it off).
  function media(url, label) {
    const video = url.startsWith("data:video/");
    if (!video && !url.startsWith("data:audio/")) {
      const img = document.createElement("img");
      img.src = url;
      img.alt = label;
      return img;
    }
    const player = document.createElement(video ? "video" : "audio");
    player.controls = true;
    player.src = url;
    player.title = label;
    return player;
  }

  function showAttached() {
    attached.textContent = "";
    images.forEach((url, i) => {
      const item = media(url, "attachment " + (i + 1));
      const drop = () => { images.splice(i, 1); showAttached(); };
      if (item.tagName === "IMG") {
        item.addEventListener("click", drop);
        attached.appendChild(item);
      } else {
        const off = document.createElement("button");
        off.textContent = "×";
        off.title = "take this one off";
        off.addEventListener("click", drop);
        attached.append(item, off);
      }
    });
  }

  pick.addEventListener("change", async () => {
    for (const file of pick.files) {
      images.push(await new Promise((resolve, reject) => {
        const reader = new FileReader();
        reader.onload = () => resolve(reader.result);
        reader.onerror = () => reject(reader.error);
        reader.readAsDataURL(file);
      }));
    }
    pick.value = "";
    showAttached();
  });
  $("attach").addEventListener("click", () => pick.click());

  function bubble(role) {
    const div = document.createElement("div");
    div.className = "msg " + role;
    log.appendChild(div);
    return div;
  }

  async function loadModel() {
    const headers = $("api-key").value ? { Authorization: "Bearer " + $("api-key").value } : {};
    try {
      const resp = await fetch("/v1/models", { headers });
      if (!resp.ok) throw new Error(resp.status === 401 ? "this server needs an API key (settings)" : resp.statusText);
      const card = (await resp.json()).data[0];
      model = card.id;
      $("model").textContent = model;
      const caps = card.capabilities || {};
      const kinds = attachKinds(caps);
      $("attach").hidden = !kinds.show;
      $("attach").textContent = kinds.label;
      $("attach").title = kinds.title;
      pick.accept = kinds.accept;
      status.textContent = "";
    } catch (e) {
      status.textContent = "cannot list models: " + e.message;
    }
  }

  async function ask() {
    const text = input.value.trim();
    if ((!text && images.length === 0) || running) return;
    if (!model) await loadModel();
    if (!model) return;
    input.value = "";
    history.push({ role: "user", content: userContent(text, images) });
    const mine = bubble("user");
    for (const url of images) mine.appendChild(media(url, "your attachment"));
    mine.appendChild(document.createTextNode(text));
    images = [];
    showAttached();
    const out = bubble("assistant");
    const thinking = document.createElement("details");
    thinking.innerHTML = "<summary>thinking</summary>";
    const thought = document.createElement("div");
    thinking.appendChild(thought);
    const answer = document.createElement("div");
    out.appendChild(answer);
    const system = $("system").value.trim();
    const messages = (system ? [{ role: "system", content: system }] : []).concat(history);
    running = new AbortController();
    send.disabled = true;
    stop.disabled = false;
    status.textContent = "generating…";
    const started = performance.now();
    let first = null;
    let content = "";
    try {
      const { usage, finish } = await streamChat({
        model, messages, temperature: $("temperature").value, maxTokens: $("max-tokens").value,
        apiKey: $("api-key").value, signal: running.signal,
      }, (c, r) => {
        if (first === null) first = performance.now();
        if (r) {
          if (!thinking.parentNode) out.insertBefore(thinking, answer);
          thought.textContent += r;
        }
        content += c;
        answer.textContent = content;
        log.scrollTop = log.scrollHeight;
      });
      history.push({ role: "assistant", content });
      const secs = (performance.now() - (first ?? started)) / 1000;
      const n = usage ? usage.completion_tokens : 0;
      status.textContent = `${n} tokens, ${secs > 0 ? (n / secs).toFixed(1) : "-"} tokens/s, first token after ` +
        `${(((first ?? performance.now()) - started) / 1000).toFixed(2)} s` + (finish === "length" ? " (cut at max tokens)" : "");
    } catch (e) {
      if (e.name === "AbortError") {
        history.push({ role: "assistant", content });
        status.textContent = "stopped";
      } else {
        out.classList.add("error");
        answer.textContent = content + (content ? "\n" : "") + e.message;
        history.pop();  // the question stays on screen but not in what is sent next
        status.textContent = "";
      }
    } finally {
      running = null;
      send.disabled = false;
      stop.disabled = true;
      input.focus();
    }
  }

  send.addEventListener("click", ask);
  stop.addEventListener("click", () => running && running.abort());
  $("new").addEventListener("click", () => {
    if (running) running.abort();
    history = [];
    images = [];
    showAttached();
    log.textContent = "";
  });
  $("api-key").addEventListener("change", loadModel);
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); ask(); }
  });
  loadModel();
  input.focus();
}
