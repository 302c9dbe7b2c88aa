"""One self-contained HTML file to explore attention: no network, no CDN.

A head view (pick a layer and heads; hover a token on the left to see what it
attends to on the right, line width = weight, one colour per head) and a
model view (a thumbnail of every layer x head; click one to open it in the
head view), in the spirit of bertviz, as plain HTML, CSS and JavaScript with
the maps embedded as JSON (`<script type="application/json"
id="attention-data">`).
"""

import html
import json

import numpy as np

from keras_attn.visualize.maps import AttentionMap

_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font-family:sans-serif;margin:16px;color:#222}
#controls{margin-bottom:8px}
#head-view{display:flex;gap:80px;position:relative}
.col div{padding:1px 6px;cursor:default;white-space:pre}
.col div.pad{color:#aaa}
#lines{position:absolute;left:0;top:0;pointer-events:none}
#model-view{display:grid;gap:4px;margin-top:16px;justify-content:start;align-items:start}
#model-view canvas{border:1px solid #ccc;cursor:pointer}
.label{font-size:11px;max-width:220px;overflow-wrap:anywhere}
</style></head><body>
<h3>__TITLE__</h3>
<div id="controls">Layer: <select id="layer"></select> <span id="heads"></span>
 Example: <select id="example"></select></div>
<div id="head-view"><div class="col" id="left"></div><svg id="lines"></svg><div class="col" id="right"></div></div>
<h4>Model view (click a map)</h4><div id="model-view"></div>
<script type="application/json" id="attention-data">__DATA__</script>
<script>
const data = JSON.parse(document.getElementById("attention-data").textContent);
const colors = ["#1f77b4","#ff7f0e","#2ca02c","#d62728","#9467bd","#8c564b","#e377c2","#7f7f7f","#bcbd22","#17becf"];
const layerSel = document.getElementById("layer"), exSel = document.getElementById("example");
let layer = 0, example = 0, shown = new Set();
data.maps.forEach((m, i) => layerSel.add(new Option(m.name, i)));
for (let b = 0; b < data.batch; b++) exSel.add(new Option(String(b), b));
function map() { return data.maps[layer]; }
function headBoxes() {
  const box = document.getElementById("heads"); box.innerHTML = "Heads: ";
  shown = new Set([...Array(map().scores[example].length).keys()]);
  map().scores[example].forEach((_, h) => {
    const c = document.createElement("input"); c.type = "checkbox"; c.checked = true; c.id = "head" + h;
    c.onchange = () => { c.checked ? shown.add(h) : shown.delete(h); draw(-1); };
    const l = document.createElement("label"); l.style.color = colors[h % colors.length];
    l.textContent = h + " "; l.prepend(c); box.appendChild(l);
  });
}
function tokens(which) {
  const m = map(), n = which === "q" ? m.scores[example][0].length : m.scores[example][0][0].length;
  const t = which === "q" ? m.query_tokens : m.key_tokens;
  return t && t.length === n ? t : [...Array(n).keys()].map(String);
}
function column(id, toks, pad, hover) {
  const col = document.getElementById(id); col.innerHTML = "";
  toks.forEach((t, i) => {
    const d = document.createElement("div"); d.textContent = t; d.dataset.index = i;
    if (pad && pad[i]) d.className = "pad";
    if (hover) { d.onmouseenter = () => draw(i); d.onmouseleave = () => draw(-1); }
    col.appendChild(d);
  });
}
function draw(query) {
  const svg = document.getElementById("lines"), left = document.getElementById("left"),
        right = document.getElementById("right"), view = document.getElementById("head-view");
  const box = view.getBoundingClientRect();
  svg.setAttribute("width", box.width); svg.setAttribute("height", box.height); svg.innerHTML = "";
  const m = map(), rows = query < 0 ? [...Array(left.children.length).keys()] : [query];
  const x1 = left.getBoundingClientRect().right - box.left, x2 = right.getBoundingClientRect().left - box.left;
  shown.forEach(h => rows.forEach(q => m.scores[example][h][q].forEach((w, k) => {
    if (w <= 0.01) return;
    const a = left.children[q].getBoundingClientRect(), b = right.children[k].getBoundingClientRect();
    const line = document.createElementNS("http://www.w3.org/2000/svg", "line");
    line.setAttribute("x1", x1); line.setAttribute("x2", x2);
    line.setAttribute("y1", (a.top + a.bottom) / 2 - box.top); line.setAttribute("y2", (b.top + b.bottom) / 2 - box.top);
    line.setAttribute("stroke", colors[h % colors.length]);
    line.setAttribute("stroke-opacity", Math.min(1, w * (query < 0 ? 0.6 : 1)));
    line.setAttribute("stroke-width", 1 + 3 * w); svg.appendChild(line);
  })));
}
function headView() {
  document.getElementById("head-view").dataset.layer = map().name;
  headBoxes();
  const m = map();
  column("left", tokens("q"), m.query_padding ? m.query_padding[example] : null, true);
  column("right", tokens("k"), m.key_padding ? m.key_padding[example] : null, false);
  draw(-1);
}
function modelView() {
  const mv = document.getElementById("model-view"); mv.innerHTML = "";
  const heads = Math.max(...data.maps.map(m => m.scores[example].length));
  mv.style.gridTemplateColumns = `repeat(${heads + 1}, auto)`;
  data.maps.forEach((m, i) => {
    const l = document.createElement("div"); l.className = "label"; l.textContent = m.name; mv.appendChild(l);
    for (let h = 0; h < heads; h++) {
      const s = m.scores[example][h], c = document.createElement("canvas");
      if (!s) { mv.appendChild(document.createElement("div")); continue; }
      const px = Math.max(2, Math.floor(80 / Math.max(s.length, s[0].length)));
      c.width = s[0].length * px; c.height = s.length * px; c.title = m.name + " head " + h;
      const g = c.getContext("2d");
      s.forEach((row, q) => row.forEach((w, k) => {
        g.fillStyle = `rgba(31,119,180,${w})`; g.fillRect(k * px, q * px, px, px); }));
      c.onclick = () => { layer = i; layerSel.value = i; headView(); };
      mv.appendChild(c);
    }
  });
}
layerSel.onchange = () => { layer = +layerSel.value; headView(); };
exSel.onchange = () => { example = +exSel.value; headView(); modelView(); };
// A link can open a view: #layer=<index or name>&example=<b>&query=<position>.
function fromFragment() {
  const p = new URLSearchParams(location.hash.slice(1));
  if (p.has("example") && +p.get("example") >= 0 && +p.get("example") < data.batch) {
    example = +p.get("example"); exSel.value = example;
  }
  if (p.has("layer")) {
    const v = p.get("layer"), byName = data.maps.findIndex(m => m.name === v);
    const i = byName >= 0 ? byName : +v;
    if (Number.isInteger(i) && i >= 0 && i < data.maps.length) { layer = i; layerSel.value = i; }
  }
  headView(); modelView();
  const q = +p.get("query"), rows = document.getElementById("left").children.length;
  if (p.has("query") && Number.isInteger(q) && q >= 0 && q < rows) draw(q);
}
window.onhashchange = fromFragment;
fromFragment();
</script></body></html>
"""


def _tokens(tokens):
    return None if tokens is None else [str(t) for t in tokens]


def view_data(maps, tokens=None, key_tokens=None, decimals=4):
    """The JSON-ready dict that `html_view` embeds (also useful on its own)."""
    maps = list(maps)
    if not maps or not all(isinstance(m, AttentionMap) for m in maps):
        raise ValueError("`maps` must be a non-empty list of AttentionMap (see attention_maps).")
    batch = maps[0].scores.shape[0]
    out = []
    for m in maps:
        square = m.scores.shape[-1] == m.scores.shape[-2]
        out.append({
            "name": m.name,
            "scores": np.round(m.scores.astype(np.float64), decimals).tolist(),
            "query_tokens": _tokens(tokens),
            "key_tokens": _tokens(tokens if square else key_tokens),
            "query_padding": m.query_padding().tolist(),
            "key_padding": m.key_padding().tolist(),
        })
    return {"batch": batch, "maps": out}


def html_view(maps, tokens=None, path="attention.html", *, key_tokens=None,
              title="Attention", decimals=4):
    """Writes one self-contained HTML file with a head view and a model view.

    Args:
        maps: `AttentionMap`s (from `attention_maps`).
        tokens: labels of the query positions (and keys of self-attention).
        path: the file to write.
        key_tokens: labels of cross-attention keys (e.g. the source sentence).
        title: the page title.
        decimals: weights are rounded to this many decimals in the file.

    Returns:
        `path`. The file needs no network: open it in any browser. A URL
        fragment opens a given view: `attention.html#layer=1` (an index or
        a layer's name), `&example=0` (the batch row), `&query=2` (the
        lines of one query token, as when hovering it).
    """
    payload = json.dumps(view_data(maps, tokens, key_tokens, decimals))
    # Inside <script>, "</" would end the element: escape it.
    payload = payload.replace("</", "<\\/")
    page = _TEMPLATE.replace("__TITLE__", html.escape(title)).replace("__DATA__", payload)
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return path
