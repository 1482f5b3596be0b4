// vkv view: replays a vkv-record/1 recording (vkv/recording.py) of the KV cache, step by step.
// Everything is drawn from one step line: the two pools, the requests' block tables, the
// queues, the radix tree; the timeline marks the steps that preempted, swapped, copied on write
// or served prompt tokens from the prefix cache.
// Keys: ← → step, space play/pause, Home/End first/last step.
"use strict";

const SCHEMA = "vkv-record/1";
const STEP_KEYS = ["schedule", "gpu", "cpu", "sequences"];
const view = { header: null, steps: [], index: 0, timer: null, selected: null, live: false };
const $ = (id) => document.getElementById(id);

// A colour per request, far from its neighbours' (golden-angle hues), dark enough for white text.
function colour(id) {
  return `hsl(${(id * 137.508) % 360}, 65%, 40%)`;
}

// The recording's lines as [header, steps]; an Error naming the line when it is not one. A
// file's steps are numbered from 1; a live one may have dropped its oldest steps, and may have
// none yet.
function parseRecording(text, live) {
  const lines = text.split("\n");
  if (lines[lines.length - 1] === "") lines.pop();
  if (lines.length === 0) throw new Error("the recording is empty");
  const parsed = lines.map((line, i) => {
    try {
      return JSON.parse(line);
    } catch (e) {
      const cut = i === lines.length - 1 && !text.endsWith("\n");
      throw new Error(`line ${i + 1}: ${cut ? "cut short (the run stopped while writing it?)" : "not JSON"}`);
    }
  });
  const header = parsed[0];
  if (!header || header.schema !== SCHEMA) {
    throw new Error(`line 1: not a ${SCHEMA} header`);
  }
  const steps = parsed.slice(1);
  const first = live && steps.length ? steps[0].step : 1;
  steps.forEach((step, i) => checkStep(step, first + i, `line ${i + 2}`));
  if (steps.length === 0 && !live) throw new Error("the recording has a header and no step");
  return [header, steps];
}

function checkStep(step, number, where) {
  if (!step || step.kind !== "step" || step.step !== number) throw new Error(`${where}: expected step ${number}`);
  for (const key of STEP_KEYS) if (!(key in step)) throw new Error(`${where}: step ${number} has no "${key}"`);
}

function showError(message) {
  const box = $("error");
  box.textContent = `This recording cannot be shown: ${message}`;
  box.hidden = false;
  $("about").textContent = "no recording";
}

function describeRun(header) {
  const c = header.config;
  const kv = header.kv;
  const format = c.kv_cache_dtype === "auto" ? kv.dtype : c.kv_cache_dtype;
  $("about").textContent =
    `${header.model}: ${c.num_gpu_blocks} GPU + ${c.num_cpu_blocks} CPU blocks of ${c.block_size} tokens, ` +
    `KV ${format} (${kv.bytes_per_token.toLocaleString()} bytes a token, ${kv.sixteen_bit_ratio.toFixed(2)}x ` +
    `the blocks of a 16-bit cache in the same bytes), preemption by ${c.preemption_mode}, ` +
    `prefix caching ${c.enable_prefix_caching ? "on" : "off"}`;
  $("tree-section").hidden = !c.enable_prefix_caching;
}

// Which blocks a step moved: swap destinations and copy-on-write targets, per device.
function movedBlocks(schedule) {
  return {
    gpu: new Set([...schedule.swap_in.map((p) => p[1]), ...schedule.copy.map((p) => p[1])]),
    cpu: new Set(schedule.swap_out.map((p) => p[1])),
  };
}

// A click, or Enter on the focused element (every block and row takes the focus by Tab).
function onActivate(element, action) {
  element.addEventListener("click", action);
  element.addEventListener("keydown", (e) => {
    if (e.key === "Enter") action();
  });
}

// A block's owners: the sequences whose table holds it, the running ones for the GPU pool and
// the swapped ones for the CPU pool (a block in use that no table holds has none: a leak).
function ownersOf(step, device) {
  const holder = device === "gpu" ? "running" : "swapped";
  const owners = new Map();
  for (const seq of step.sequences) {
    if (seq.status !== holder) continue;
    for (const block of seq.block_table) {
      if (!owners.has(block)) owners.set(block, []);
      owners.get(block).push(seq.id);
    }
  }
  return owners;
}

// Each block of a pool as [state, reference count, owners].
function blockStates(step, device) {
  const pool = step[device];
  const owners = ownersOf(step, device);
  const refs = new Map(pool.ref_counts);
  const states = Array.from({ length: pool.size }, () => ["free", 0, []]);
  for (const block of pool.held) states[block] = ["held", refs.get(block) ?? 1, owners.get(block) || []];
  for (const [block] of pool.cached) states[block] = ["cached", 0, []];
  return states;
}

function drawPool(device, step, moved) {
  const pool = step[device];
  const grid = $(device);
  const cached = new Map(pool.cached.map(([block, hash]) => [block, hash]));
  const cells = blockStates(step, device).map(([state, ref, owners], block) => {
    const cell = document.createElement("span");
    cell.className = "cell";
    cell.tabIndex = 0;
    cell.dataset.device = device;
    cell.dataset.block = block;
    cell.dataset.state = state;
    if (state === "held") {
      cell.classList.add("held");
      cell.dataset.ref = ref;
      cell.dataset.owners = owners.join(",");
      cell.style.background = owners.length ? colour(owners[0]) : "#555";
      if (ref > 1) {
        cell.classList.add("shared");
        cell.textContent = ref;
      }
    } else if (state === "cached") {
      cell.classList.add("cached");
      cell.dataset.hash = cached.get(block);
    }
    if (moved.has(block)) cell.classList.add("moved");
    onActivate(cell, () => select({ kind: "block", device, block }));
    return cell;
  });
  grid.replaceChildren(...cells);
  const free = pool.size - pool.held.length - pool.cached.length;
  $(`${device}-summary`).textContent =
    `(${pool.held.length} held, ${pool.cached.length} cached, ${free} free of ${pool.size})`;
}

function drawSequences(step) {
  const rows = step.sequences.map((seq) => {
    const row = document.createElement("tr");
    row.tabIndex = 0;
    row.dataset.seq = seq.id;
    row.dataset.status = seq.status;
    const device = seq.status === "swapped" ? "cpu" : "gpu";
    const table = seq.block_table.map((b, i) => `${i}→${b}`).join("  ");
    const cells = [seq.id, seq.status.replace("_", " "), seq.prompt_tokens,
      `${seq.completion_tokens}/${seq.max_tokens}`, seq.computed_tokens, table || "(no blocks)"];
    cells.forEach((value, i) => {
      const td = document.createElement("td");
      if (i === 0) {
        const swatch = document.createElement("span");
        swatch.className = "swatch";
        swatch.style.background = colour(seq.id);
        td.append(swatch);
      }
      td.append(String(value));
      row.append(td);
    });
    row.addEventListener("mouseenter", () => highlight(device, seq.block_table, true));
    row.addEventListener("mouseleave", () => highlight(device, seq.block_table, false));
    onActivate(row, () => select({ kind: "sequence", id: seq.id }));
    return row;
  });
  $("sequences").tBodies[0].replaceChildren(...rows);
}

function highlight(device, blocks, on) {
  for (const block of blocks) {
    const cell = $(device).children[block];
    if (cell) cell.classList.toggle("highlight", on);
  }
}

function drawQueues(step) {
  const queues = { running: [], waiting: [], swapped: [] };
  for (const seq of step.sequences) if (seq.status in queues) queues[seq.status].push(seq.id);
  const s = step.schedule;
  const lines = Object.entries(queues).map(([name, ids]) => {
    const p = document.createElement("p");
    p.className = "queue";
    p.dataset.queue = name;
    p.textContent = `${name} (${ids.length}): ${ids.join(", ") || "—"}`;
    return p;
  });
  const events = document.createElement("p");
  events.className = "queue";
  events.textContent =
    `this step: ${s.kind}, ${s.scheduled.length} scheduled` +
    (s.preempted.length ? `, preempted ${s.preempted.join(", ")}` : "") +
    (s.swap_out.length ? `, ${s.swap_out.length} blocks swapped out` : "") +
    (s.swap_in.length ? `, ${s.swap_in.length} swapped in` : "") +
    (s.copy.length ? `, ${s.copy.length} copied on write` : "") +
    (s.prefix_hit_tokens ? `, ${s.prefix_hit_tokens} prompt tokens from the prefix cache` : "") +
    (s.ignored.length ? `, ignored ${s.ignored.map((i) => i[0]).join(", ")}` : "");
  $("queues").replaceChildren(...lines, events);
}

function drawTree(step) {
  if (!step.tree) return;
  const children = new Map();
  for (const node of step.tree) {
    if (!children.has(node.parent)) children.set(node.parent, []);
    children.get(node.parent).push(node);
  }
  const list = (parent) => (children.get(parent) || []).map((node) => {
    const item = document.createElement("li");
    item.dataset.node = node.id;
    item.textContent = node.parent === null
      ? "root"
      : `node ${node.id}: ${node.tokens} tokens in blocks [${node.blocks.join(", ")}], ` +
        `lock ${node.lock}, last used ${node.last_access}`;
    const sub = list(node.id);
    if (sub.length) {
      const ul = document.createElement("ul");
      ul.append(...sub);
      item.append(ul);
    }
    return item;
  });
  $("tree").replaceChildren(...list(null));
}

function drawTimeline() {
  const line = $("timeline");
  const n = view.steps.length;
  const marks = [];
  view.steps.forEach((step, i) => {
    const s = step.schedule;
    const kind = s.preempted.length ? "preempt" : s.swap_in.length || s.swap_out.length ? "swap"
      : s.copy.length ? "copy" : s.prefix_hit_tokens ? "hit" : null;
    if (!kind) return;
    const mark = document.createElement("span");
    mark.className = `mark ${kind}`;
    mark.style.left = `${(100 * i) / Math.max(1, n - 1)}%`;
    mark.title = `step ${i + 1}: ${kind}`;
    mark.addEventListener("click", () => go(i));
    marks.push(mark);
  });
  const now = document.createElement("span");
  now.className = "now";
  now.id = "now";
  line.replaceChildren(...marks, now);
}

// The text shown for what was clicked, from the step on screen.
function detailsOf(step, selected) {
  if (selected.kind === "sequence") {
    const seq = step.sequences.find((s) => s.id === selected.id);
    return seq ? `request ${seq.id}\n${JSON.stringify(seq, null, 1)}` : `request ${selected.id}: not live at this step`;
  }
  const [state, ref, owners] = blockStates(step, selected.device)[selected.block];
  const cached = step[selected.device].cached.find((c) => c[0] === selected.block);
  let text = `${selected.device.toUpperCase()} block ${selected.block}: `;
  if (state === "held") {
    text += `held, reference count ${ref}\nowners (sequences whose block table holds it): ${owners.join(", ") || "none"}`;
    for (const owner of owners) {
      const seq = step.sequences.find((s) => s.id === owner);
      if (seq) text += `\n  request ${owner}: logical block ${seq.block_table.indexOf(selected.block)}`;
    }
  } else if (cached) {
    text += `free, keeps cached content (hash ${cached[1]}): evictable, reused by a prompt with its prefix`;
  } else {
    text += "free";
  }
  const node = (step.tree || []).find((n) => n.blocks.includes(selected.block));
  if (selected.device === "gpu" && node) text += `\nin radix-tree node ${node.id} (lock ${node.lock})`;
  return text;
}

function select(selected) {
  view.selected = selected;
  $("details").textContent = detailsOf(view.steps[view.index], selected);
}

function go(index) {
  if (view.steps.length === 0) return;
  view.index = Math.max(0, Math.min(view.steps.length - 1, index));
  const step = view.steps[view.index];
  const moved = movedBlocks(step.schedule);
  drawPool("gpu", step, moved.gpu);
  drawPool("cpu", step, moved.cpu);
  drawSequences(step);
  drawQueues(step);
  drawTree(step);
  $("slider").value = view.index + 1;
  const last = view.steps[view.steps.length - 1].step;
  $("stepinfo").textContent = `step ${step.step} of ${last}: ${step.schedule.kind}`;
  document.body.dataset.step = step.step;
  const now = $("now");
  if (now) now.style.left = `${(100 * view.index) / Math.max(1, view.steps.length - 1)}%`;
  if (view.selected) select(view.selected);
}

function play(on) {
  clearInterval(view.timer);
  view.timer = null;
  if (on) {
    view.timer = setInterval(() => {
      if (view.index >= view.steps.length - 1) return play(false);
      go(view.index + 1);
    }, 125);
  }
  $("play").textContent = on ? "❚❚ pause" : "▶ play";
}

function bindControls() {
  $("slider").addEventListener("input", (e) => go(Number(e.target.value) - 1));
  $("prev").addEventListener("click", () => go(view.index - 1));
  $("next").addEventListener("click", () => go(view.index + 1));
  $("play").addEventListener("click", () => play(view.timer === null));
  document.addEventListener("keydown", (e) => {
    if (e.target.tagName === "INPUT" && e.key !== " ") return;
    const keys = {
      ArrowRight: () => go(view.index + 1), ArrowLeft: () => go(view.index - 1),
      Home: () => go(0), End: () => go(view.steps.length - 1), " ": () => play(view.timer === null),
    };
    if (keys[e.key]) {
      e.preventDefault();
      keys[e.key]();
    }
  });
}

function show(header, steps) {
  view.header = header;
  view.steps = steps;
  describeRun(header);
  $("slider").max = Math.max(1, steps.length);
  drawTimeline();
  go(steps.length - 1 >= 0 && view.live ? steps.length - 1 : 0);
  if (steps.length === 0) $("stepinfo").textContent = "waiting for the engine's first step";
  document.body.dataset.ready = "true";
}

// Live: each new step arrives as a Server-Sent Event; the view follows the newest step unless
// it was moved back to an earlier one.
function follow() {
  const last = view.steps.length ? view.steps[view.steps.length - 1].step : 0;
  const events = new EventSource(`events?after=${last}`);
  events.onmessage = (message) => {
    const step = JSON.parse(message.data);
    const expected = view.steps.length ? view.steps[view.steps.length - 1].step + 1 : step.step;
    try {
      checkStep(step, expected, "live event");
    } catch (e) {
      events.close();
      showError(e.message);
      return;
    }
    const following = view.steps.length === 0 || view.index === view.steps.length - 1;
    view.steps.push(step);
    $("slider").max = view.steps.length;
    drawTimeline();
    if (following) go(view.steps.length - 1);
    else $("stepinfo").textContent = `step ${view.steps[view.index].step} of ${step.step} (live: End follows the newest)`;
  };
}

async function main() {
  bindControls();
  try {
    const answer = await fetch("recording.jsonl");
    if (!answer.ok) throw new Error(`the server answered ${answer.status}`);
    view.live = answer.headers.get("X-VKV-Live") === "1";
    const [header, steps] = parseRecording(await answer.text(), view.live);
    show(header, steps);
    if (view.live) follow();
  } catch (e) {
    showError(e.message);
    document.body.dataset.ready = "error";
  }
}

main();
