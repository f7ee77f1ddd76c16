"""``/playground``: one self-contained HTML page to try the served model from a browser.

Why a page at all: a person who has just started ``preheat serve`` on a pod has only curl. Why
self-contained: an offline pod must show it (no CDN, no external font; inline CSS and JS only).

The page itself holds nothing of the model: it is a constant, served without a token. In the
browser it waits on ``/health-check`` (``STARTING`` until ``READY``), then reads ``/openapi.json``
(asking for the API token when the server answers 401, and keeping it in a JavaScript variable
only) and builds its form from the ``Input`` schema, which the server derives from the family's
declared inputs (``Family.input_specs``, see ``preheat.server.app._describe_model``): so every
family gets its own fields, and no code here knows a family. The field for a schema:

    schema                                   control
    ---------------------------------------  -----------------------------------------------
    enum (a sampler, an output format)       <select>
    integer / number, with bounds            <input type=number min max>
    string, with ``examples`` (LoRA files)   <input> and a <datalist> of the examples
    string                                   <textarea> (a prompt, a negative prompt)
    integer or a name (a class label)        <input> and a <datalist> of the names
    string, ``format: uri`` (an image)       file upload, sent as a data URL
    ... and ``x-mask-of: FIELD``             a mask drawn with the pointer over FIELD's image
    array of 2 integers                      <input> "a,b"
    ``x-alias-of`` (another way to give X)   none (X has its field)

The size's two fields (``x-size``: 0 the width, 1 the height; ``families.inputs.IMAGE_SIZE``)
become one size <select> of the served sizes (the OpenAI body's ``size`` enum). A run posts Cog's ``POST /predictions`` with ``Accept: text/event-stream`` and reads the
server-sent events from the fetch body (``log`` lines ``step k/N`` move the bar, ``output`` shows
images as they arrive, ``completed`` carries the prediction and its timings); a server that
answers JSON instead is read as the finished prediction. Everything the page echoes (the prompt,
error messages) goes in through ``textContent``: never parsed as HTML. The page sends only what a
client could send with curl, so the server's own checks (the LoRA URL policy, ``--lora-dir``) hold.
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Optional

__all__ = ["PAGE", "HEADERS", "lora_choices"]

MAX_LORA_CHOICES = 200  # files listed from --lora-dir (a listing, not a crawl)


def lora_choices(lora_dir: Optional[str]) -> list[str]:
    """The ``.safetensors`` files under ``--lora-dir``, relative to it (what a request may name),
    sorted; [] when the server reads no local LoRA files."""
    if lora_dir is None:
        return []
    base = Path(lora_dir)
    try:
        found = sorted(str(p.relative_to(base)) for p in base.rglob("*.safetensors") if p.is_file())
    except OSError:
        return []
    return found[:MAX_LORA_CHOICES]


_STYLE = """
:root{--fg:#1d2023;--mute:#5f6b76;--line:#d9dee3;--acc:#2f6fdf;--bad:#b3261e;--bg:#f7f8fa}
*{box-sizing:border-box}body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:var(--fg);
background:var(--bg)}header{display:flex;gap:1rem;align-items:center;padding:.8rem 1.2rem;background:#fff;
border-bottom:1px solid var(--line)}header h1{font-size:1.1rem;margin:0}header a{color:var(--mute);font-size:.9rem}
#status{font:600 .8rem ui-monospace,monospace;padding:.15rem .5rem;border-radius:.3rem;background:#eee}
#status[data-status=READY]{background:#d8f3dc;color:#1b5e20}#status[data-status=STARTING]{background:#fff3cd}
#status[data-status=SETUP_FAILED],#status[data-status=DEFUNCT]{background:#f8d7da;color:var(--bad)}
main{display:grid;grid-template-columns:minmax(18rem,26rem) 1fr;gap:1.2rem;padding:1.2rem}
@media(max-width:50rem){main{grid-template-columns:1fr}}
form,.panel{background:#fff;border:1px solid var(--line);border-radius:.5rem;padding:1rem}
label{display:block;margin:.55rem 0 .15rem;font-weight:600;font-size:.85rem}
label small{display:block;font-weight:400;color:var(--mute)}
input,select,textarea{width:100%;font:inherit;padding:.35rem .45rem;border:1px solid var(--line);border-radius:.3rem}
textarea{min-height:3.2rem;resize:vertical}button{font:inherit;font-weight:600;margin-top:.9rem;padding:.45rem 1.1rem;
border:0;border-radius:.3rem;background:var(--acc);color:#fff;cursor:pointer}button:disabled{opacity:.5;cursor:default}
#progress-row{display:flex;gap:.6rem;align-items:center;margin:.2rem 0 .8rem}progress{flex:1;height:.8rem}
#progress-text{font:.85rem ui-monospace,monospace;min-width:4rem}.error{color:var(--bad);white-space:pre-wrap}
.run{border-top:1px solid var(--line);padding:.8rem 0}.run:first-child{border-top:0}.echo{color:var(--mute);
font-size:.85rem;white-space:pre-wrap;word-break:break-word}.images{display:flex;flex-wrap:wrap;gap:.6rem;margin:.5rem 0}
figure{margin:0}figure img{image-rendering:pixelated;min-width:96px;min-height:96px;border:1px solid var(--line);
background:#000}figcaption,.timings{font:.75rem ui-monospace,monospace;color:var(--mute)}
.drop{position:relative;display:inline-block;margin-top:.3rem}.drop img{max-width:100%;display:block}
.drop canvas{position:absolute;inset:0;width:100%;height:100%;opacity:.45;cursor:crosshair;touch-action:none}
"""

_SCRIPT = r"""
"use strict";
const S = {token: null, spec: null, fields: [], images: new Map(), total: null, running: false};
const $ = (id) => document.getElementById(id);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function el(tag, attrs, text) {  // attributes and text only: nothing is parsed as HTML
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) if (v !== undefined && v !== null) e.setAttribute(k, String(v));
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}
function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (S.token) h["Authorization"] = "Bearer " + S.token;
  return h;
}
function setStatus(text) { $("status").textContent = text; $("status").dataset.status = text; }
function showError(where, text) { where.textContent = text; where.hidden = !text; }

async function boot() {
  for (let i = 0; ; i++) {  // STARTING until warm-up ends
    let health;
    try { health = await (await fetch("/health-check", {cache: "no-store"})).json(); }
    catch (err) { health = {status: "UNREACHABLE"}; }
    setStatus(health.status);
    if (health.status === "SETUP_FAILED" || health.status === "DEFUNCT") {
      showError($("form-error"), health.error || "the server cannot run predictions");
      return;
    }
    if (health.status !== "STARTING" && health.status !== "UNREACHABLE") break;
    await sleep(Math.min(2000, 250 + 100 * i));
  }
  await loadSchema();
}

function askToken(then, refused) {
  const form = $("token-form");
  form.hidden = false;
  showError($("token-error"), refused ? "the server refused that token" : "");
  $("token").focus();
  form.onsubmit = (ev) => {
    ev.preventDefault();
    S.token = $("token").value.trim() || null;  // page memory only: no storage, no cookie
    $("token").value = "";
    form.hidden = true;
    then();
  };
}

async function loadSchema() {
  let r;
  try { r = await fetch("/openapi.json", {headers: headers(), cache: "no-store"}); }
  catch (err) { showError($("form-error"), "cannot reach the server: " + err); return; }
  if (r.status === 401) { askToken(loadSchema, S.token !== null); return; }
  if (!r.ok) { showError($("form-error"), "GET /openapi.json: HTTP " + r.status); return; }
  buildForm(await r.json());
}

// ------------------------------------------------------------------ the form, from the schema

function unwrap(p) {  // an optional input's schema: anyOf [its schema, null]
  if (p.anyOf) {
    const kept = p.anyOf.filter((s) => s.type !== "null");
    if (kept.length === 1) return Object.assign({}, kept[0], {nullable: true});
  }
  return p;
}
function choiceNames(s) {  // "an integer or a name": the names
  const named = (s.anyOf || []).find((x) => Array.isArray(x.enum) && x.type === "string");
  return named && (s.anyOf || []).some((x) => x.type === "integer") ? named.enum : null;
}
function bound(s, a, b) { return s[a] !== undefined ? s[a] : s[b]; }

function buildForm(spec) {
  S.spec = spec;
  S.fields = [];
  const schemas = (spec.components || {}).schemas || {};
  const props = (schemas.Input || {}).properties || {};
  const sizeProp = unwrap(((schemas.ImageGenerationRequest || {}).properties || {}).size || {});
  const sizes = (sizeProp.enum || []).filter((v) => v !== "auto");
  const box = $("fields");
  box.textContent = "";
  const entries = Object.entries(props).sort((a, b) => (a[1]["x-order"] ?? 1e3) - (b[1]["x-order"] ?? 1e3));
  S.sizeFields = [];  // the size's two fields (x-size 0: the width, 1: the height)
  for (const [name, p] of entries) if (p["x-size"] !== undefined) S.sizeFields[p["x-size"]] = name;
  const sizePair = S.sizeFields[0] !== undefined && S.sizeFields[1] !== undefined && sizes.length;
  let sized = false;
  for (const [name, p] of entries) {
    if (p["x-alias-of"]) continue;
    if (sizePair && p["x-size"] !== undefined) {
      if (!sized) addSize(box, sizes);
      sized = true;
      continue;
    }
    addField(box, name, p);
  }
  $("run").disabled = false;
  $("form").hidden = false;
}

function labelFor(box, name, p) {
  const label = el("label", {for: "f-" + name}, p.title || name);
  if (p.description) label.appendChild(el("small", {}, p.description));
  box.appendChild(label);
}

function addSize(box, sizes) {
  labelFor(box, "size", {title: "Size", description: "Width x height: the sizes this server serves."});
  const select = el("select", {id: "f-size", name: "size"});
  for (const v of sizes) select.appendChild(el("option", {value: v}, v));
  box.appendChild(select);
  S.fields.push({name: "size", kind: "size", node: select});
}

function addField(box, name, p) {
  const s = unwrap(p);
  if (s.not) return;  // an input this model does not take
  const id = "f-" + name;
  const def = p.default !== undefined ? p.default : s.default;
  let node, kind;
  const names = choiceNames(s);
  if (s.format === "uri") {
    return addImage(box, name, p, s);
  } else if (Array.isArray(s.enum)) {
    kind = s.type === "integer" ? "int" : "text";
    node = el("select", {id, name});
    if (s.nullable || def === undefined) node.appendChild(el("option", {value: ""}, "(the model's default)"));
    for (const v of s.enum) node.appendChild(el("option", {value: v}, v));
    if (def !== undefined && def !== null) node.value = String(def);
  } else if (names) {
    kind = "label";
    node = el("input", {id, name, list: id + "-names", autocomplete: "off", placeholder: names.slice(0, 4).join(", ")});
    const list = el("datalist", {id: id + "-names"});
    for (const v of names) list.appendChild(el("option", {value: v}));
    box.appendChild(list);
  } else if (s.type === "integer" || s.type === "number") {
    kind = s.type === "integer" ? "int" : "number";
    node = el("input", {id, name, type: "number", min: bound(s, "minimum", "ge"), max: bound(s, "maximum", "le"),
                        step: s.type === "integer" ? (s.multipleOf || 1) : "any",
                        placeholder: def === undefined || def === null ? "default" : undefined});
    if (def !== undefined && def !== null) node.value = String(def);
  } else if (s.type === "array") {
    kind = "pair";
    node = el("input", {id, name, placeholder: "e.g. 1024,1024"});
  } else if (Array.isArray(s.examples) || Array.isArray(p.examples)) {
    kind = "text";
    node = el("input", {id, name, list: id + "-examples", autocomplete: "off", maxlength: s.maxLength,
                        placeholder: "none"});
    const list = el("datalist", {id: id + "-examples"});
    for (const v of (s.examples || p.examples)) list.appendChild(el("option", {value: v}));
    box.appendChild(list);
  } else {
    kind = "text";
    node = el("textarea", {id, name, maxlength: s.maxLength, rows: 2});
    if (typeof def === "string") node.value = def;
  }
  labelFor(box, name, p);
  box.appendChild(node);
  S.fields.push({name, kind, node});
}

function addImage(box, name, p, s) {  // an image input: a file sent as a data URL; a mask: drawn over its image
  labelFor(box, name, p);
  const of = p["x-mask-of"] || s["x-mask-of"];
  if (of) {
    const note = el("div", {id: "f-" + name, class: "echo"}, "Draw the mask on the " + of + " image above.");
    box.appendChild(note);
    S.fields.push({name, kind: "mask", of, node: note});
    return;
  }
  const input = el("input", {id: "f-" + name, name, type: "file", accept: "image/*"});
  const drop = el("div", {class: "drop", id: "f-" + name + "-preview", hidden: ""});
  box.appendChild(input);
  box.appendChild(drop);
  S.fields.push({name, kind: "image", node: input});
  input.addEventListener("change", () => {
    const file = input.files && input.files[0];
    if (!file) { S.images.delete(name); drop.hidden = true; return; }
    const reader = new FileReader();
    reader.onload = () => {
      S.images.set(name, reader.result);
      drop.textContent = "";
      const img = el("img", {alt: name});
      img.onload = () => attachMasks(name, drop, img);
      img.src = reader.result;
      drop.appendChild(img);
      drop.hidden = false;
    };
    reader.readAsDataURL(file);
  });
}

function attachMasks(of, drop, img) {
  for (const f of S.fields.filter((x) => x.kind === "mask" && x.of === of)) {
    const canvas = el("canvas", {id: "f-" + f.name + "-canvas", width: img.naturalWidth, height: img.naturalHeight});
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#000";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    f.canvas = canvas;
    f.drawn = false;
    let down = false;
    const paint = (ev) => {
      const r = canvas.getBoundingClientRect();
      const x = (ev.clientX - r.left) * canvas.width / r.width, y = (ev.clientY - r.top) * canvas.height / r.height;
      ctx.fillStyle = "#fff";
      ctx.beginPath();
      ctx.arc(x, y, Math.max(2, canvas.width / 20), 0, 2 * Math.PI);
      ctx.fill();
      f.drawn = true;
    };
    canvas.addEventListener("pointerdown", (ev) => { down = true; paint(ev); });
    canvas.addEventListener("pointermove", (ev) => { if (down) paint(ev); });
    window.addEventListener("pointerup", () => { down = false; });
    drop.appendChild(canvas);
  }
}

function collect() {  // the form -> Cog's input object (empty fields: absent, the model's default)
  const input = {};
  for (const f of S.fields) {
    if (f.kind === "image") { if (S.images.has(f.name)) input[f.name] = S.images.get(f.name); continue; }
    if (f.kind === "mask") { if (f.canvas && f.drawn) input[f.name] = f.canvas.toDataURL("image/png"); continue; }
    const v = f.node.value.trim();
    if (v === "") continue;
    if (f.kind === "size") { v.split("x").map(Number).forEach((side, i) => { input[S.sizeFields[i]] = side; }); }
    else if (f.kind === "int" || f.kind === "number") input[f.name] = Number(v);
    else if (f.kind === "pair") input[f.name] = v.split(/[x,]/).map((t) => Number(t.trim()));
    else if (f.kind === "label" && /^[0-9]+$/.test(v)) input[f.name] = v;
    else input[f.name] = f.node.value;
  }
  return input;
}

// ------------------------------------------------------------------ a run: the event stream

function setProgress(k, n) {
  if (n) { S.total = n; $("progress").max = n; $("progress").value = k; $("progress-text").textContent = k + "/" + n; }
  else { $("progress").removeAttribute("value"); $("progress-text").textContent = ""; }
}

function newRun(input) {
  const run = el("div", {class: "run"});
  const echoed = Object.entries(input).filter(([k, v]) => typeof v === "string" && !v.startsWith("data:"));
  run.appendChild(el("div", {class: "echo"}, echoed.map(([k, v]) => k + ": " + v).join("\n") || "(defaults)"));
  const state = el("div", {class: "echo state"}, "queued");
  const error = el("div", {class: "error", hidden: ""});
  const images = el("div", {class: "images"});
  const timings = el("div", {class: "timings"});
  run.append(state, error, images, timings);
  $("runs").prepend(run);
  return {node: run, state, error, images, timings, shown: new Set(), metrics: {}};
}

function showImages(run, urls) {
  for (const url of urls || []) {
    if (typeof url !== "string" || run.shown.has(url)) continue;
    if (!/^(data:image\/|https?:\/\/|\/)/.test(url)) continue;  // an image, nothing else
    run.shown.add(url);
    const index = run.shown.size, fig = el("figure"), img = el("img", {alt: "image " + index});
    const cap = el("figcaption", {}, "#" + index);
    img.onload = () => { cap.textContent = "#" + index + " " + img.naturalWidth + "x" + img.naturalHeight + timingLine(run); };
    img.src = url;
    fig.append(img, cap);
    run.images.appendChild(fig);
  }
}

function timingLine(run) {
  const m = run.metrics, per = m.seconds_per_image ?? m.per_image_s;
  return per !== undefined ? " · " + Number(per).toFixed(3) + " s/image" : "";
}

function showMetrics(run, metrics) {
  Object.assign(run.metrics, metrics || {});
  const parts = [];
  for (const [k, v] of Object.entries(run.metrics)) {
    if (typeof v === "number") parts.push(k + " " + (Number.isInteger(v) ? v : v.toFixed(3)));
    else if (typeof v === "string" && v.length < 40) parts.push(k + " " + v);
  }
  run.timings.textContent = parts.join(" · ");
}

function onLog(run, text) {
  for (const m of String(text).matchAll(/step (\d+)\s*\/\s*(\d+)/g)) setProgress(Number(m[1]), Number(m[2]));
}

function finish(run, pred) {
  run.state.textContent = pred.status || "";
  if (pred.logs) onLog(run, pred.logs);
  showMetrics(run, pred.metrics);
  showImages(run, Array.isArray(pred.output) ? pred.output : (pred.output ? [pred.output] : []));
  if (pred.status === "failed" || pred.error) showError(run.error, pred.error || pred.status);
}

function dispatch(run, event, data) {
  let d = data;
  try { d = JSON.parse(data); } catch (err) { /* a plain text line */ }
  if (event === "start") run.state.textContent = "processing";
  else if (event === "log" || event === "logs") onLog(run, typeof d === "string" ? d : (d.logs ?? d.message ?? d.data ?? ""));
  else if (event === "metric" || event === "metrics") showMetrics(run, typeof d === "object" ? (d.metrics || d) : {});
  else if (event === "output") showImages(run, Array.isArray(d) ? d : (d && d.output ? [].concat(d.output) : [d]));
  else if (event === "completed" || event === "done") { if (typeof d === "object") finish(run, d); }
  else if (event === "error") showError(run.error, typeof d === "string" ? d : (d.error || d.detail || JSON.stringify(d)));
}

async function readStream(run, response) {  // server-sent events from a POST (EventSource can only GET)
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (value) buffer += decoder.decode(value, {stream: true});
    buffer = buffer.replace(/\r\n?/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (!line || line.startsWith(":")) continue;
        const at = line.indexOf(":");
        const field = at < 0 ? line : line.slice(0, at);
        const val = at < 0 ? "" : line.slice(at + 1).replace(/^ /, "");
        if (field === "event") event = val;
        else if (field === "data") data.push(val);
      }
      dispatch(run, event, data.join("\n"));
    }
    if (done) return;
  }
}

function errorText(body, status) {
  const d = body && (body.detail ?? (body.error && body.error.message));
  if (Array.isArray(d)) return d.map((e) => (e.loc || []).filter((x) => x !== "body" && x !== "input").join(".") + ": " + e.msg).join("\n");
  return d ? String(d) : "HTTP " + status;
}

async function submit(ev) {
  if (ev) ev.preventDefault();
  if (S.running) return;
  const input = collect();
  S.running = true;
  $("run").disabled = true;
  setProgress(0, null);
  const run = newRun(input);
  try {
    const r = await fetch("/predictions", {method: "POST", body: JSON.stringify({input}),
      headers: headers({"Content-Type": "application/json", "Accept": "text/event-stream"})});
    if (r.status === 401) {
      run.node.remove();
      askToken(() => submit(null), S.token !== null);
      return;
    }
    if (!r.ok) {
      let body = null;
      try { body = await r.json(); } catch (err) { /* not JSON */ }
      run.state.textContent = "refused";
      showError(run.error, errorText(body, r.status));
      return;
    }
    if ((r.headers.get("content-type") || "").startsWith("text/event-stream")) await readStream(run, r);
    else finish(run, await r.json());
  } catch (err) {
    showError(run.error, "the request failed: " + err);
  } finally {
    S.running = false;
    $("run").disabled = false;
  }
}

$("form").addEventListener("submit", submit);
boot();
"""

_BODY = """<header><h1>preheat playground</h1><span id="status" data-status="">…</span>
<a href="/docs">API reference</a></header>
<main><section>
<form id="token-form" hidden><label for="token">API token<small>This server needs its token. It is kept in this
page's memory only: reloading forgets it.</small></label><input id="token" type="password" autocomplete="off">
<div id="token-error" class="error" hidden></div><button type="submit">Use token</button></form>
<div id="form-error" class="error" hidden></div>
<form id="form" hidden><div id="fields"></div><button id="run" type="submit" disabled>Run</button></form>
</section><section class="panel"><div id="progress-row"><progress id="progress" max="1" value="0"></progress>
<span id="progress-text"></span></div><div id="runs"></div></section></main>"""

PAGE = ("<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width,initial-scale=1'><title>preheat playground</title>"
        f"<style>{_STYLE}</style></head><body>{_BODY}<script>{_SCRIPT}</script></body></html>")

_SCRIPT_HASH = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
# Only this page's own script runs, and it talks to this server only: an injected <script> or
# onerror= would not run even if some echo were parsed as HTML (the echoes use textContent).
HEADERS = {
    "Content-Security-Policy": (f"default-src 'none'; script-src 'sha256-{_SCRIPT_HASH}'; style-src 'unsafe-inline'; "
                                "img-src 'self' data: blob:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
                                "frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}
