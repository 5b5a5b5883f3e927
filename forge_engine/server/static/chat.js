const $ = id => document.getElementById(id);
const history = [];
let model = null, controller = null;
let waiting = 0;  // tool calls of the last reply still without a result
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
const NAME = /^[A-Za-z0-9_-]{1,64}$/, CHOICES = ["auto", "required", "none"];
function readTools() {  // the tools box: {tools} (null when empty), or {error} saying what is wrong
  const text = $("tools").value.trim(), shape = '{"type": "function", "function": {"name": ...}}';
  if (!text) return {tools: null};
  let tools;
  try { tools = JSON.parse(text); } catch (e) { return {error: "tools: not JSON: " + e.message}; }
  if (!Array.isArray(tools) || !tools.length)
    return {error: "tools must be a non-empty list of " + shape};
  const names = new Set();
  for (let i = 0; i < tools.length; i++) {
    const f = tools[i] && tools[i].type === "function" ? tools[i].function : null;
    if (!f || typeof f.name !== "string" || !NAME.test(f.name))
      return {error: "tools[" + i + "] must be " + shape + ", a name of 1-64 of A-Z a-z 0-9 _ -"};
    const p = f.parameters;
    if (p !== undefined && (typeof p !== "object" || !p || Array.isArray(p)))
      return {error: "tools[" + i + "]: parameters must be a JSON schema object"};
    if (names.has(f.name)) return {error: "tools name a function twice: " + f.name};
    names.add(f.name);
  }
  return {tools};
}
function checkTools() {  // show what is wrong with the tools box; offer its tools' names as choices
  const checked = readTools(), select = $("tool-choice"), chosen = select.value;
  $("tools-error").textContent = checked.error || "";
  while (select.options.length > CHOICES.length) select.remove(CHOICES.length);
  for (const tool of checked.tools || []) select.add(new Option(tool.function.name));
  select.value = [...select.options].some(o => o.value === chosen) ? chosen : "auto";
  return checked;
}
function takeCall(calls, piece) {  // a call's index, id and name, then pieces of its arguments
  const i = piece.index ?? calls.length, f = piece.function || {};
  calls[i] = calls[i] || {id: "call_" + i, type: "function", function: {name: "", arguments: ""}};
  if (piece.id) calls[i].id = piece.id;
  if (f.name) calls[i].function.name = f.name;
  if (f.arguments) calls[i].function.arguments += f.arguments;
}
function pretty(json) {
  try { return JSON.stringify(JSON.parse(json), null, 2); } catch (e) { return json; }
}
function showCalls(calls) {  // one block per call, with a box for its result; all given, it goes on
  const results = new Array(calls.length);
  waiting = calls.length;
  $("send").disabled = true;
  calls.forEach((call, i) => {
    const block = bubble("tool-call", ""), form = document.createElement("form");
    const name = document.createElement("div"), args = document.createElement("pre");
    const input = document.createElement("input"), button = document.createElement("button");
    name.className = "call-name"; name.textContent = "\u2192 " + call.function.name;
    args.className = "call-args"; args.textContent = pretty(call.function.arguments);
    input.className = "tool-result"; input.placeholder = "result of " + call.function.name;
    button.type = "submit"; button.textContent = "Send result";
    form.append(input, button);
    block.append(name, args, form);
    form.addEventListener("submit", e => {
      e.preventDefault();
      if (!input.value.trim() || input.disabled) return;
      input.disabled = button.disabled = true;
      results[i] = {role: "tool", tool_call_id: call.id, content: input.value};
      if (--waiting === 0) { history.push(...results); complete("auto"); }
    });
    if (i === 0) input.focus();
  });
}
async function send(text) {
  history.push({role: "user", content: text});
  bubble("user", text);
  await complete($("tool-choice").value);
}
function offer(tools, choice) {  // the tools, and which to call: a name is sent as its object
  if (!tools) return {};
  const named = {type: "function", function: {name: choice}};
  return {tools, tool_choice: CHOICES.includes(choice) ? choice : named};
}
async function complete(choice) {  // a forced choice holds for a message; replies to results choose
  const reply = bubble("assistant", ""), calls = [], {tools} = readTools();
  controller = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  let tokens = 0, start = performance.now(), first = null, stopped = false;
  try {
    const body = {model, messages: history, stream: true, stream_options: {include_usage: true},
                  max_tokens: Number($("max-tokens").value),
                  temperature: Number($("temperature").value), ...offer(tools, choice)};
    const r = await fetch("/v1/chat/completions", {method: "POST", headers: headers(), signal: controller.signal,
                                                   body: JSON.stringify(body)});
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
        const delta = chunk.choices.length ? chunk.choices[0].delta : {};
        for (const piece of delta.tool_calls || []) takeCall(calls, piece);
        if (delta.content) {
          reply.textContent += delta.content; tokens += 1; first = first || performance.now();
        }
        const seconds = (performance.now() - (first || start)) / 1000;
        $("speed").textContent = tokens + " tokens, " + (seconds > 0 ? (tokens - 1) / seconds : 0).toFixed(1) + " tok/s";
      }
    }
  } catch (e) {
    stopped = true;
    if (e.name === "AbortError") reply.classList.add("stopped");
    else bubble("error", String(e.message || e));
  } finally {
    controller = null;
    $("send").disabled = false; $("stop").disabled = true;
    if (calls.length && !stopped) {
      history.push({role: "assistant", content: reply.textContent || null, tool_calls: calls});
      if (!reply.textContent) reply.remove();
      showCalls(calls);
    } else history.push({role: "assistant", content: reply.textContent});
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
  if (!text.trim() || controller || waiting) return;
  if (checkTools().error) { $("tools").focus(); return; }
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", e => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("form").requestSubmit(); }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("tools").addEventListener("input", checkTools);
fetch("/v1/models", {headers: headers()}).then(r => r.json()).then(m => { model = m.data[0].id; $("model").textContent = model; })
  .catch(() => {});
poll();
setInterval(poll, 500);
