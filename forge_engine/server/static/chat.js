const $ = id => document.getElementById(id);
const history = [];
let model = null, controller = null;
function headers() {
  const h = {"Content-Type": "application/json"}, key = $("api-key").value;
  if (key) h.Authorization = "Bearer " + key;
  return h;
}
function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;  // text, never HTML
  $("log").append(div);
  div.scrollIntoView();
  return div;
}
async function errorMessage(r) {
  try { return (await r.json()).error.message; } catch (e) { return r.status + " " + r.statusText; }
}
async function send(text) {
  history.push({role: "user", content: text});
  bubble("user", text);
  const reply = bubble("assistant", "");
  controller = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  let tokens = 0, start = performance.now(), first = null;
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({model, messages: history, stream: true, stream_options: {include_usage: true},
                            max_tokens: Number($("max-tokens").value), temperature: Number($("temperature").value)})});
    if (!r.ok) throw new Error(await errorMessage(r));
    const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += value;
      const events = buffer.split("\n\n");
      buffer = events.pop();
      for (const event of events) {
        const data = event.replace(/^data: /, "");
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) tokens = chunk.usage.completion_tokens;
        const delta = chunk.choices.length ? chunk.choices[0].delta.content : "";
        if (delta) { reply.textContent += delta; tokens += 1; first = first || performance.now(); }
        const seconds = (performance.now() - (first || start)) / 1000;
        $("speed").textContent = tokens + " tokens, " + (seconds > 0 ? (tokens - 1) / seconds : 0).toFixed(1) + " tok/s";
      }
    }
  } catch (e) {
    if (e.name === "AbortError") reply.classList.add("stopped");
    else bubble("error", String(e.message || e));
  } finally {
    history.push({role: "assistant", content: reply.textContent});
    controller = null;
    $("send").disabled = false; $("stop").disabled = true;
  }
}
function drawBlocks(map) {
  const canvas = $("blocks"), cols = Math.min(256, Math.ceil(Math.sqrt(3 * map.length)) || 1);
  const rows = Math.ceil(map.length / cols);  // about three times wider than high
  canvas.width = cols; canvas.height = Math.max(rows, 1);
  const ctx = canvas.getContext("2d"), image = ctx.createImageData(canvas.width, canvas.height);
  for (let i = 0; i < map.length; i++) {
    const c = map[i], rgb = c === "." ? [225, 225, 225] : c === "c" ? [140, 180, 240] : [40, 160 - 10 * Number(c), 60];
    image.data.set([...rgb, 255], 4 * i);
  }
  ctx.putImageData(image, 0, 0);
}
async function poll() {
  try {
    const r = await fetch("/v1/engine/stats", {headers: headers()});
    if (!r.ok) { $("engine").textContent = await errorMessage(r); return; }
    const s = await r.json(), kv = s.kv;
    $("running").textContent = s.running; $("waiting").textContent = s.waiting;
    $("kv").textContent = "KV blocks: " + kv.used_blocks + " used, " + kv.cached_blocks + " cached, " + kv.total_blocks +
      " in all (" + (100 * kv.usage).toFixed(1) + "%); prefix hits " + (100 * kv.prefix_hit_rate).toFixed(0) + "%";
    $("engine").textContent = s.tokens_per_s.toFixed(1) + " tok/s over recent steps, " + s.steps + " steps";
    drawBlocks(s.block_map);
  } catch (e) { $("engine").textContent = "engine stats unavailable"; }
}
$("form").addEventListener("submit", e => {
  e.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", e => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("form").requestSubmit(); }
});
$("stop").addEventListener("click", () => controller && controller.abort());
fetch("/v1/models", {headers: headers()}).then(r => r.json()).then(m => { model = m.data[0].id; $("model").textContent = model; })
  .catch(() => {});
poll();
setInterval(poll, 500);
