// kf dashboard: plain JavaScript + SVG, no dependencies, no network beyond its own API.
// Live mode fetches /api/state and follows /api/stream (server-sent events); report mode
// reads the JSON embedded in <script id="kf-data"> and never touches the network.
"use strict";

(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const embedded = document.getElementById("kf-data");
  const STATIC = embedded ? JSON.parse(embedded.textContent) : null;
  let state = null;
  let openId = null;
  let refreshing = false;
  let again = false;

  // -- small helpers -------------------------------------------------------------------

  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "text") e.textContent = v;
      else if (k === "onclick") e.addEventListener("click", v);
      else e.setAttribute(k, v === true ? "" : String(v));
    }
    for (const kid of kids.flat()) {
      if (kid === null || kid === undefined || kid === false) continue;
      e.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
    }
    return e;
  }

  function svg(tag, attrs, ...kids) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined) continue;
      if (k === "text") e.textContent = v;
      else e.setAttribute(k, String(v));
    }
    for (const kid of kids.flat()) if (kid) e.append(kid);
    return e;
  }

  function title(text) {
    return svg("title", { text: text });
  }

  const fmtX = (s) => (s === null || s === undefined ? "—" : s.toFixed(2) + "×");
  const fmtMs = (ms) => (ms === null || ms === undefined ? "—" : ms.toFixed(4) + " ms");
  const short = (id) => (id ? id.slice(0, 12) : "—");

  function fmtAge(s) {
    if (s === null || s === undefined) return "—";
    if (s < 1) return "now";
    if (s < 90) return Math.round(s) + " s ago";
    if (s < 5400) return Math.round(s / 60) + " min ago";
    return (s / 3600).toFixed(1) + " h ago";
  }

  function fmtTime(t) {
    if (!t) return "—";
    return new Date(t * 1000).toLocaleString();
  }

  // speedup → colour: red below 1×, grey at 1×, green to blue above (log scale, ±4×)
  function colour(s) {
    if (s === null || s === undefined || !(s > 0)) return "#d0d0d0";
    const x = Math.max(-2, Math.min(2, Math.log2(s))) / 2;
    if (x < 0) {
      const t = -x;
      return `hsl(6, ${40 + 45 * t}%, ${78 - 28 * t}%)`;
    }
    return `hsl(${140 + 70 * x}, ${35 + 40 * x}%, ${78 - 38 * x}%)`;
  }

  // -- data ----------------------------------------------------------------------------

  async function loadState() {
    if (STATIC) return STATIC.state;
    const r = await fetch("api/state", { cache: "no-store" });
    if (!r.ok) throw new Error("api/state: HTTP " + r.status);
    return r.json();
  }

  async function loadCandidate(id) {
    if (STATIC) return STATIC.candidates[id] || null;
    const r = await fetch("api/candidates/" + encodeURIComponent(id), { cache: "no-store" });
    if (r.status === 404) return null;
    if (!r.ok) throw new Error("candidate: HTTP " + r.status);
    return r.json();
  }

  async function refresh() {
    if (refreshing) {
      again = true;
      return;
    }
    refreshing = true;
    try {
      do {
        again = false;
        state = await loadState();
        render();
        if (openId) await showCandidate(openId, false);
      } while (again);
    } catch (err) {
      document.getElementById("run-title").textContent = "error: " + err.message;
    } finally {
      refreshing = false;
    }
  }

  function nowS() {
    if (STATIC) return state.run.last_time || 0;
    return state.server_time || Date.now() / 1000;
  }

  // -- rendering -----------------------------------------------------------------------

  function render() {
    const run = state.run;
    document.body.dataset.head = String(run.head);
    document.getElementById("run-title").textContent =
      `run ${run.run_id || "?"} · seed ${run.seed} · ${run.events} events` +
      (state.db ? ` · ${state.db}` : "");
    const status = document.getElementById("run-status");
    status.textContent = run.finished ? "finished" : run.events ? "running" : "empty";
    status.className = "pill " + (run.finished ? "done" : "running");
    if (run.finish_reason) status.title = run.finish_reason;
    renderIntegrity();
    renderStats();
    renderLegend();
    renderArchive();
    renderCandidatesChart();
    renderTimeChart();
    renderThroughput();
    renderDevices();
    renderCandidates();
    renderPrompts();
    renderTuning();
    renderLessons();
  }

  function renderIntegrity() {
    // the log's hash chain, as the server verified it (absent in older reports)
    const box = document.getElementById("integrity");
    const found = state.integrity;
    box.hidden = !found || found.status === "verified";
    if (box.hidden) return;
    box.className = "integrity " + found.status;
    box.dataset.status = found.status;
    box.textContent = found.status === "broken"
      ? "WARNING: " + found.message + ". What this page shows may have been forged."
      : found.message;
  }

  function renderStats() {
    const run = state.run;
    const p = state.progress;
    // the headline leaves out tasks the audit marked degenerate (a constant passes them)
    const a = state.archive;
    const best = a.headline_best;
    const degenerate = a.degenerate_tasks || [];
    const cfg = run.config || {};
    const items = [
      ["tasks", a.tasks.length],
      ["candidates", run.counts.proposed],
      ["correct", p.correct],
      ["failed", p.failed],
      ["best speedup", best ? fmtX(best) : "—"],
      ["geomean speedup", a.headline_geomean ? fmtX(a.headline_geomean) : "—"],
      ["degenerate tasks (left out)", degenerate.length ? degenerate.join(", ") : "none"],
      ["cells filled", state.archive.filled],
      ["evaluations / min", p.per_minute ? p.per_minute.toFixed(1) : "—"],
      ["mutator", cfg.mutator || "—"],
      ["sandbox", run.unsandboxed ? `UNSANDBOXED (${run.unsandboxed} results)` : run.boxed ? "bwrap" : "—"],
    ];
    const box = document.getElementById("stats");
    box.replaceChildren(
      ...items.map(([k, v]) =>
        el("div", { class: "stat", "data-stat": k, title: `${k}: ${v}` }, el("div", { class: "v", text: v }), el("div", { class: "k", text: k })),
      ),
    );
  }

  function renderLegend() {
    const stops = [0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4];
    const box = document.getElementById("legend");
    box.replaceChildren(
      el("span", { class: "hint", text: "speedup" }),
      ...stops.map((s) => el("span", { class: "swatch", style: `background:${colour(s)}`, text: s + "×" })),
      el("span", { class: "swatch", style: `background:${colour(null)}`, text: "empty" }),
    );
  }

  function renderArchive() {
    const a = state.archive;
    const box = document.getElementById("archive");
    const out = [];
    const C = 22; // cell size
    const P = 4; // parallelism levels
    for (const t of a.tasks) {
      const sec = el("div", { class: "task", "data-task": t.task });
      sec.append(
        el(
          "h3",
          {},
          t.task,
          el("span", {
            class: "hint",
            text: ` · ${t.proposed} candidates, ${t.correct} correct, ${t.failed} failed, best ${fmtX(t.best_speedup)} (${fmtMs(t.best_ms)}), ${t.cells.length} elite cells`
              + (t.degenerate ? ` · DEGENERATE task (${t.degenerate}): left out of the headline` : ""),
          }),
        ),
      );
      if (t.skipped) sec.append(el("div", { class: "skipped", text: "skipped: " + t.skipped }));
      if (!t.cells.length && t.skipped) {
        out.push(sec);
        continue;
      }
      const byKey = new Map(t.cells.map((c) => [c.key, c]));
      for (let island = 0; island < Math.max(1, a.islands); island++) {
        const W = 40 + P * (4 * C + 26);
        const H = 4 * C + 58;
        const g = svg("svg", { width: W, height: H, class: "grid", "data-island": island });
        g.append(svg("text", { x: 0, y: 11, class: "axis", text: `island ${island}` }));
        for (let p = 0; p < P; p++) {
          const ox = 40 + p * (4 * C + 26);
          const oy = 32;
          g.append(svg("text", { x: ox, y: oy - 4, class: "axis small", text: `p${p} ${a.dims.parallelism[p]}` }));
          for (let c = 0; c < 4; c++) {
            for (let m = 0; m < 4; m++) {
              const key = `${island}:${m}.${c}.${p}`;
              const cell = byKey.get(key);
              const x = ox + m * C;
              const y = oy + (3 - c) * C;
              const r = svg("rect", {
                x: x + 1,
                y: y + 1,
                width: C - 2,
                height: C - 2,
                rx: 3,
                fill: colour(cell ? cell.speedup : null),
                class: cell ? "cell filled" : "cell",
                "data-key": key,
                "data-candidate": cell ? cell.candidate_id : null,
              });
              const what = `${a.dims.memory[m]} memory · ${a.dims.compute[c]} compute · ${a.dims.parallelism[p]}`;
              if (cell) {
                r.append(title(`${what}\n${short(cell.candidate_id)} · ${fmtX(cell.speedup)} · ${fmtMs(cell.runtime_ms)} · ${cell.operator}\nclick for details`));
                r.addEventListener("click", () => openCandidate(cell.candidate_id));
                if (cell.candidate_id === openId) r.classList.add("selected");
              } else {
                r.append(title(what + "\nempty"));
              }
              g.append(r);
            }
          }
          // axes: memory along x, compute along y
          for (let m = 0; m < 4; m++) {
            g.append(svg("text", { x: ox + m * C + C / 2, y: oy + 4 * C + 12, class: "axis tiny", "text-anchor": "middle", text: "m" + m }, title(a.dims.memory[m])));
          }
          if (p === 0) {
            for (let c = 0; c < 4; c++) {
              g.append(svg("text", { x: ox - 4, y: oy + (3 - c) * C + C / 2 + 3, class: "axis tiny", "text-anchor": "end", text: "c" + c }, title(a.dims.compute[c])));
            }
          }
        }
        g.append(svg("text", { x: 40, y: H - 4, class: "axis tiny", text: "x: memory (m0 naive → m3 registers) · y: compute (c0 multi-pass → c3 tiled)" }));
        sec.append(g);
      }
      out.push(sec);
    }
    if (!a.tasks.length) out.push(el("p", { class: "empty", text: "no tasks yet (waiting for run.started)" }));
    box.replaceChildren(...out);
  }

  // a scatter/step chart in SVG; series: [{name, points:[[x,y]], kind:'dots'|'step', colour}]
  function chart(box, series, opts) {
    const W = box.clientWidth || 520;
    const H = 220;
    const L = 46, R = 10, T = 10, B = 30;
    const pts = series.flatMap((s) => s.points);
    const g = svg("svg", { width: W, height: H, class: "plot" });
    if (!pts.length) {
      box.replaceChildren(el("p", { class: "empty", text: opts.empty }));
      return;
    }
    const xs = pts.map((p) => p[0]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1e-9);
    const ys = pts.map((p) => p[1]).filter((y) => y > 0);
    const y0 = Math.log2(Math.min(0.5, ...ys)), y1 = Math.log2(Math.max(2, ...ys));
    const sx = (x) => L + ((x - x0) / (x1 - x0 || 1)) * (W - L - R);
    const sy = (y) => T + (1 - (Math.log2(Math.max(y, 2 ** y0)) - y0) / (y1 - y0)) * (H - T - B);
    for (let e = Math.ceil(y0); e <= Math.floor(y1); e++) {
      const v = 2 ** e;
      g.append(svg("line", { x1: L, x2: W - R, y1: sy(v), y2: sy(v), class: v === 1 ? "gridline one" : "gridline" }));
      g.append(svg("text", { x: L - 4, y: sy(v) + 3, class: "axis tiny", "text-anchor": "end", text: v + "×" }));
    }
    g.append(svg("text", { x: (L + W - R) / 2, y: H - 6, class: "axis tiny", "text-anchor": "middle", text: opts.xlabel }));
    g.append(svg("text", { x: L, y: H - 18, class: "axis tiny", text: opts.fmtX(x0) }));
    g.append(svg("text", { x: W - R, y: H - 18, class: "axis tiny", "text-anchor": "end", text: opts.fmtX(x1) }));
    for (const s of series) {
      if (s.kind === "step" && s.points.length) {
        let d = "";
        s.points.forEach(([x, y], i) => {
          d += i === 0 ? `M${sx(x)},${sy(y)}` : `H${sx(x)}V${sy(y)}`;
        });
        d += `H${sx(x1)}`;
        g.append(svg("path", { d, fill: "none", stroke: s.colour, "stroke-width": 2 }, title(s.name)));
      } else {
        for (const p of s.points) {
          const mark = s.failed
            ? svg("path", { d: `M${sx(p[0]) - 3},${H - B - 3}l6,6m0,-6l-6,6`, stroke: s.colour, "stroke-width": 1.5, class: "mark failed" })
            : svg("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 3.5, fill: s.colour, class: "mark" });
          mark.append(title(p[2] || s.name));
          if (p[3]) mark.addEventListener("click", () => openCandidate(p[3]));
          g.append(mark);
        }
      }
    }
    const legend = el("div", { class: "chart-legend" }, ...series.filter((s) => s.legend !== false && s.points.length).map((s) => el("span", {}, el("i", { style: `background:${s.colour}` }), s.name)));
    box.replaceChildren(g, legend);
  }

  const PALETTE = ["#2f6fdf", "#e07b00", "#8a3fc7", "#0a9a7a", "#c0392b", "#6b7f10"];

  function perTask() {
    const tasks = [...new Set(state.progress.evaluations.map((e) => e.task))];
    return tasks.map((task, i) => ({ task, colour: PALETTE[i % PALETTE.length], evals: state.progress.evaluations.filter((e) => e.task === task) }));
  }

  function renderCandidatesChart() {
    const series = [];
    const all = state.progress.evaluations;
    const index = new Map(all.map((e, i) => [e.seq, i + 1]));
    for (const { task, colour: col, evals } of perTask()) {
      const ok = evals.filter((e) => e.ok && e.speedup > 0);
      const bad = evals.filter((e) => !e.ok);
      let best = 0;
      const step = [];
      for (const e of ok) if (e.speedup > best) { best = e.speedup; step.push([index.get(e.seq), best]); }
      series.push({ name: task + " best", kind: "step", colour: col, points: step });
      series.push({ name: task, kind: "dots", colour: col, legend: false, points: ok.map((e) => [index.get(e.seq), e.speedup, `${task} · ${short(e.candidate_id)} · ${fmtX(e.speedup)} · ${fmtMs(e.runtime_ms)}`, e.candidate_id]) });
      if (bad.length) series.push({ name: task + " failed", kind: "dots", failed: true, colour: "#c0392b", legend: false, points: bad.map((e) => [index.get(e.seq), 1, `${task} · ${short(e.candidate_id)} · failed: ${e.failure || "?"}`, e.candidate_id]) });
    }
    chart(document.getElementById("chart-candidates"), series, { xlabel: "evaluated candidate (log order); × = failed", fmtX: (x) => "#" + Math.round(x), empty: "no candidate evaluated yet" });
  }

  function renderTimeChart() {
    const t0 = state.run.started_at || 0;
    const series = [];
    for (const { task, colour: col, evals } of perTask()) {
      let best = 0;
      const step = [];
      for (const e of evals) if (e.ok && e.speedup > best) { best = e.speedup; step.push([e.time - t0, best]); }
      series.push({ name: task, kind: "step", colour: col, points: step });
    }
    chart(document.getElementById("chart-time"), series, { xlabel: "seconds since the run started (producer clocks)", fmtX: (x) => x.toFixed(0) + " s", empty: "no correct candidate yet" });
  }

  function renderThroughput() {
    const p = state.progress;
    const box = document.getElementById("throughput");
    const evals = p.evaluations;
    const head = el("p", { class: "kv" },
      el("b", { text: String(evals.length) }), " evaluated: ",
      el("span", { class: "ok", text: `${p.correct} correct` }), ", ",
      el("span", { class: "bad", text: `${p.failed} failed` }),
      p.per_minute ? ` · ${p.per_minute.toFixed(1)} evaluations/min over ${p.span_s.toFixed(0)} s` : "");
    if (evals.length < 2) {
      box.replaceChildren(head);
      return;
    }
    const N = 24;
    const t0 = Math.min(...evals.map((e) => e.time));
    const span = Math.max(1e-6, p.span_s);
    const okB = new Array(N).fill(0), badB = new Array(N).fill(0);
    for (const e of evals) {
      const i = Math.min(N - 1, Math.floor(((e.time - t0) / span) * N));
      (e.ok ? okB : badB)[i]++;
    }
    const W = box.clientWidth || 500, H = 120, B = 18;
    const max = Math.max(1, ...okB.map((v, i) => v + badB[i]));
    const bw = W / N;
    const g = svg("svg", { width: W, height: H, class: "plot" });
    for (let i = 0; i < N; i++) {
      const hOk = (okB[i] / max) * (H - B - 6), hBad = (badB[i] / max) * (H - B - 6);
      const label = `${okB[i]} correct, ${badB[i]} failed in ${(span / N).toFixed(1)} s`;
      g.append(svg("rect", { x: i * bw + 1, y: H - B - hOk, width: bw - 2, height: hOk, class: "bar ok" }, title(label)));
      g.append(svg("rect", { x: i * bw + 1, y: H - B - hOk - hBad, width: bw - 2, height: hBad, class: "bar bad" }, title(label)));
    }
    g.append(svg("text", { x: 0, y: H - 4, class: "axis tiny", text: "0 s" }));
    g.append(svg("text", { x: W, y: H - 4, class: "axis tiny", "text-anchor": "end", text: span.toFixed(0) + " s" }));
    box.replaceChildren(head, g);
  }

  function liveness(d) {
    if (d.left_at) return ["left", `left ${fmtAge(nowS() - d.left_at)}: ${d.left_reason || ""}`];
    const age = d.last_seen ? nowS() - d.last_seen : null;
    if (age !== null && age <= 30) return ["alive", `seen ${fmtAge(age)}`];
    return ["silent", `silent, last seen ${fmtAge(age)}`];
  }

  function capsTable(caps) {
    const rows = Object.entries(caps || {}).map(([k, v]) => {
      let text = typeof v === "object" && v !== null ? JSON.stringify(v) : String(v);
      if (text.length > 160) text = text.slice(0, 160) + "…";
      return el("tr", {}, el("th", { text: k }), el("td", { text }));
    });
    return el("table", { class: "caps" }, rows);
  }

  function renderDevices() {
    const box = document.getElementById("devices");
    if (!state.devices.length) {
      box.replaceChildren(el("p", { class: "empty", text: "no device has announced itself yet" }));
      return;
    }
    box.replaceChildren(
      ...state.devices.map((d) => {
        const [status, text] = liveness(d);
        return el("details", { class: "device", "data-device": d.device_id },
          el("summary", {},
            el("span", { class: "dot " + status, title: status }), " ",
            el("b", { text: d.device_id }), ` ${d.kind || "(not announced)"} · `,
            el("span", { class: "status " + status, text: status }), ` · ${text} · ${d.heartbeats} heartbeats · busy ${d.busy}, queued ${d.queued}`),
          d.announced ? capsTable(d.capabilities) : el("p", { class: "empty", text: "no device.announced event for this device" }));
      }),
    );
  }

  function renderCandidates() {
    const box = document.getElementById("candidates");
    const rows = state.candidates.map((c) =>
      el("tr", { class: "cand-row " + c.status + (c.id === openId ? " selected" : ""), "data-candidate": c.id, onclick: () => openCandidate(c.id) },
        el("td", { class: "mono", text: short(c.id) }),
        el("td", { text: c.task }),
        el("td", { text: c.operator }),
        el("td", { text: String(c.island) }),
        el("td", { text: c.status === "failed" ? "failed: " + (c.failure || "?") : c.status }),
        el("td", { class: "num", text: fmtX(c.speedup) }),
        el("td", { class: "num", text: fmtMs(c.runtime_ms) }),
        el("td", { class: "mono", text: c.cell ? c.cell.join(".") : "—" })));
    if (!rows.length) {
      box.replaceChildren(el("p", { class: "empty", text: "no candidate yet" }));
      return;
    }
    box.replaceChildren(el("table", { class: "list" },
      el("thead", {}, el("tr", {}, ...["id", "task", "operator", "island", "status", "speedup", "latency", "cell m.c.p"].map((h) => el("th", { text: h })))),
      el("tbody", {}, rows)));
  }

  function renderPrompts() {
    const box = document.getElementById("prompts");
    const p = state.prompts;
    if (!p.events.length) {
      box.replaceChildren(el("p", { class: "empty prompts-none", text: p.message }));
      return;
    }
    const kids = [];
    if (p.population.length) {
      kids.push(el("table", { class: "list population" },
        el("thead", {}, el("tr", {}, ...["prompt", "from", "operator · region", "uses", "kernels", "correct", "failed", "best"].map((h) => el("th", { text: h })))),
        el("tbody", {}, p.population.map((q) => el("tr", { class: "prompt-member", "data-prompt": q.prompt_id },
          el("td", { class: "mono", text: short(q.prompt_id) }),
          el("td", { class: "mono", text: q.parent_prompt_id ? short(q.parent_prompt_id) : "—" }),
          el("td", { text: [q.operator, q.region].filter(Boolean).join(" · ") || "—" }),
          el("td", { class: "num", text: String(q.uses) }),
          el("td", { class: "num", text: String(q.candidates) }),
          el("td", { class: "num", text: String(q.correct) }),
          el("td", { class: "num", text: String(q.failed) }),
          el("td", { class: "num", text: fmtX(q.best_speedup) }))))));
    } else {
      kids.push(el("p", { class: "empty", text: "no prompt population events (prompt.seeded / prompt.rewritten) in this run" }));
    }
    kids.push(el("details", {}, el("summary", { text: `${p.events.length} prompt / LLM events` }),
      el("div", { class: "scroll" }, el("table", { class: "list" },
        el("thead", {}, el("tr", {}, ...["seq", "type", "source", "data"].map((h) => el("th", { text: h })))),
        el("tbody", {}, p.events.map((e) => {
          let data = JSON.stringify(e.data);
          if (data.length > 300) data = data.slice(0, 300) + "…";
          return el("tr", { class: "prompt-event" }, el("td", { text: String(e.seq) }), el("td", { text: e.type }), el("td", { text: e.source }), el("td", { class: "mono", text: data }));
        }))))));
    box.replaceChildren(...kids);
  }

  function renderTuning() {
    const box = document.getElementById("tuning");
    const t = state.tuning || { tasks: {}, message: "no template tuning in this run" };
    const names = Object.keys(t.tasks);
    if (!names.length) {
      box.replaceChildren(el("p", { class: "empty tuning-none", text: t.message }));
      return;
    }
    const cfg = (c) => (c ? Object.entries(c).map(([k, v]) => `${k}=${v}`).join(" ") : "—");
    box.replaceChildren(...names.map((name) => el("div", { class: "tuning-task", "data-task": name },
      el("h3", { text: name }),
      el("table", { class: "list" },
        el("thead", {}, el("tr", {}, ...["device", "elite", "shapes", "tuned configuration", "tuner: tuned", "tuner: own", "beyond noise", "candidate", "speedup at shapes"].map((h) => el("th", { text: h })))),
        el("tbody", {}, t.tasks[name].map((r) => el("tr", {
            class: "tuning-row" + (r.tuned_candidate_id ? " cand-row " + (r.tuned_status || "") : ""),
            "data-device": r.device_id, "data-shape": r.shape || "", "data-elite": r.candidate_id || "",
            onclick: r.tuned_candidate_id ? () => openCandidate(r.tuned_candidate_id) : null },
          el("td", { class: "mono", text: r.device_id }),
          el("td", { class: "mono", text: r.candidate_id ? short(r.candidate_id) : "—" }),
          el("td", { class: "mono", text: r.shape || r.note || "—" }),
          el("td", { class: "mono tuned-config", text: r.shape ? cfg(r.best_config) : "—" }),
          el("td", { class: "num", text: fmtMs(r.best_ms) }),
          el("td", { class: "num", text: fmtMs(r.baseline_ms) }),
          el("td", { text: r.shape ? (r.improved ? "yes" : "no") : "—" }),
          el("td", { class: "mono", text: r.tuned_candidate_id ? short(r.tuned_candidate_id) + " " + (r.tuned_status || "") : "—" }),
          el("td", { class: "num", text: fmtX(r.tuned_speedup) }))))))));
  }

  function renderLessons() {
    const box = document.getElementById("lessons");
    const t = state.lessons || { lessons: {}, message: "no lessons in this run" };
    const ids = Object.keys(t.lessons);
    if (!ids.length) {
      box.replaceChildren(el("p", { class: "empty lessons-none", text: t.message }));
      return;
    }
    box.replaceChildren(el("table", { class: "list" },
      el("thead", {}, el("tr", {}, ...["lesson", "status", "prompts", "comparisons gained", "bought"].map((h) => el("th", { text: h })))),
      el("tbody", {}, ids.map((id) => {
        const x = t.lessons[id];
        return el("tr", { class: "lesson-row " + x.status, "data-lesson": id },
          el("td", { class: "mono", text: short(id) }),
          el("td", { text: x.status }),
          el("td", { class: "num", text: String(x.uses) }),
          el("td", { class: "num", text: `${x.wins} / ${x.comparisons}` }),
          el("td", { class: "num", text: fmtX(x.bought) }));
      }))));
  }

  // -- candidate detail ------------------------------------------------------------------

  function openCandidate(id) {
    if (location.hash !== "#cand=" + id) history.replaceState(null, "", "#cand=" + id);
    showCandidate(id, true);
  }

  function section(name, ...kids) {
    return el("section", { class: "dsec", "data-section": name }, el("h3", { text: name }), ...kids);
  }

  function pre(text, cls) {
    return el("pre", { class: cls || "" }, text || "");
  }

  function diffView(text) {
    const p = el("pre", { class: "diff" });
    for (const line of text.split("\n")) {
      const cls = line.startsWith("+") && !line.startsWith("+++") ? "add" : line.startsWith("-") && !line.startsWith("---") ? "del" : line.startsWith("@@") ? "hunk" : "";
      p.append(el("span", { class: cls, text: line + "\n" }));
    }
    return p;
  }

  function kv(obj, keys) {
    return el("table", { class: "caps" }, keys.filter((k) => obj[k] !== undefined && obj[k] !== null && obj[k] !== "").map((k) => {
      const v = obj[k];
      return el("tr", {}, el("th", { text: k }), el("td", { text: typeof v === "object" ? JSON.stringify(v) : String(v) }));
    }));
  }

  function chip(c, label) {
    return el("button", { class: "chip " + c.status, "data-candidate": c.id, onclick: () => openCandidate(c.id), title: `${c.status} · ${c.operator}` }, `${label || ""}${short(c.id)} ${c.speedup ? fmtX(c.speedup) : c.status}`);
  }

  async function showCandidate(id, scroll) {
    openId = id;
    const d = await loadCandidate(id);
    const panel = document.getElementById("detail");
    const body = document.getElementById("detail-body");
    document.querySelectorAll(".selected").forEach((n) => n.classList.remove("selected"));
    document.querySelectorAll(`[data-candidate="${CSS.escape(id)}"]`).forEach((n) => n.classList.add("selected"));
    panel.hidden = false;
    if (!d) {
      body.replaceChildren(el("p", { class: "empty", text: `no candidate ${id} in this run` }));
      return;
    }
    panel.dataset.candidateId = d.id;
    const kids = [];
    kids.push(el("h2", {}, "candidate ", el("span", { class: "mono cand-id", text: d.id })));
    kids.push(el("p", { class: "kv" },
      el("span", { class: "pill " + d.status, text: d.status === "failed" ? "failed: " + (d.failure || "?") : d.status }),
      ` ${d.task} · island ${d.island} · ${d.operator} · ${d.mutator}` + (d.cell ? ` · cell ${d.cell.join(".")}` : "") + (d.speedup ? ` · ${fmtX(d.speedup)} (${fmtMs(d.runtime_ms)} vs eager ${fmtMs(d.ref_ms)})` : "") + (d.speedup && d.profile && d.profile.compiled_runtime_ms ? ` · ${fmtX(d.profile.speedup_vs_compiled)} vs torch.compile ${fmtMs(d.profile.compiled_runtime_ms)}` : "")));
    const chain = [chip(d, "this: "), ...d.lineage.map((c) => chip(c))];
    const last = d.lineage.length ? d.lineage[d.lineage.length - 1] : d;
    kids.push(section("lineage",
      el("div", { class: "lineage" }, chain.flatMap((c, i) => (i ? [el("span", { class: "arrow", text: "←" }), c] : [c]))),
      el("p", { class: "hint", text: last.operator === "seed" ? `back to seed ${short(last.id)}` : `${d.lineage.length} ancestor(s)` + (last.parent_id ? ` (parent ${short(last.parent_id)} not in this log)` : "") }),
      d.second_parent_id ? el("p", { class: "hint" }, "crossover with ", el("a", { href: "#cand=" + d.second_parent_id, onclick: (e) => { e.preventDefault(); openCandidate(d.second_parent_id); }, text: short(d.second_parent_id) })) : null));
    if (d.error) kids.push(section("error", pre(d.error, "error")));
    kids.push(section("config", kv({ family: d.family, config: d.config, selection: d.selection }, ["family", "config", "selection"])));
    kids.push(section("diff to parent", d.diff === null ? el("p", { class: "empty", text: "a seed: no parent" }) : d.diff ? diffView(d.diff) : el("p", { class: "empty", text: "identical to its parent" })));
    kids.push(section("source", pre(d.source, "source")));
    const cmp = d.compile;
    kids.push(section("compile", cmp ? [kv(cmp, ["ok", "failure_kind", "duration_s", "device_id", "seq", "source"]), cmp.error ? pre(cmp.error, "error") : null, cmp.log ? pre(cmp.log, "log") : el("p", { class: "empty", text: "empty compile log" })] : el("p", { class: "empty", text: "not compiled yet" })));
    const v = d.verify;
    kids.push(section("verification", v ? [
      kv(v, ["correct", "failure_kind", "trials", "max_abs_err", "max_rel_err", "atol", "rtol", "duration_s", "device_id"]),
      v.error ? pre(v.error, "error") : null,
      v.evidence && v.evidence.length ? el("table", { class: "list" }, el("thead", {}, el("tr", {}, ...["trial seed", "ok", "max abs err", "max rel err", "reason"].map((h) => el("th", { text: h })))),
        el("tbody", {}, v.evidence.map((t) => el("tr", { class: t.ok ? "" : "failed" }, el("td", { text: String(t.seed) }), el("td", { text: t.ok ? "✓" : "✗" }), el("td", { text: t.max_abs_err.toExponential(2) }), el("td", { text: t.max_rel_err.toExponential(2) }), el("td", { text: t.reason || "" }))))) : null,
    ] : el("p", { class: "empty", text: "not verified yet" })));
    const p = d.profile;
    kids.push(section("timings", p ? [
      kv(p, ["ok", "speedup", "runtime_ms", "runtime_std_ms", "runtime_median_ms", "runtime_min_ms", "runtime_ci95_ms", "trials", "ref_runtime_ms", "ref_runtime_std_ms", "ref_trials", "compiled_runtime_ms", "compiled_runtime_std_ms", "compiled_trials", "speedup_vs_compiled", "speedup_vs_best", "compile_baseline_s", "compile_baseline_cached", "compile_baseline_error", "timer", "outside_wall_ms", "outside_calls", "threads", "flags", "device", "failure_kind", "duration_s", "sandbox"]),
      p.error ? pre(p.error, "error") : null,
    ] : el("p", { class: "empty", text: "not profiled" })));
    if (d.elite.length) kids.push(section("archive", el("ul", {}, d.elite.map((e) => el("li", { text: `seq ${e.seq}: elite of cell ${e.cell.join(".")} on island ${e.island} at ${fmtX(e.speedup)}` + (e.replaced ? `, replacing ${short(e.replaced)}` : "") + (e.migrated_from !== null && e.migrated_from !== undefined ? ` (migrated from island ${e.migrated_from})` : "") })))));
    kids.push(section("events", el("table", { class: "list" }, el("tbody", {}, d.events.map((e) => el("tr", {}, el("td", { text: String(e.seq) }), el("td", { text: e.type }), el("td", { text: e.source }), el("td", { text: fmtTime(e.time) })))))));
    body.replaceChildren(...kids);
    if (scroll) body.scrollTop = 0;
  }

  function closeDetail() {
    openId = null;
    document.getElementById("detail").hidden = true;
    document.querySelectorAll(".selected").forEach((n) => n.classList.remove("selected"));
    history.replaceState(null, "", location.pathname + location.search);
  }

  // -- start ---------------------------------------------------------------------------

  function fromHash() {
    const m = /^#cand=(.+)$/.exec(location.hash);
    return m ? decodeURIComponent(m[1]) : null;
  }

  function connect() {
    const live = document.getElementById("live");
    if (STATIC) {
      live.className = "live static";
      live.title = "a saved report (no live updates)";
      return;
    }
    const es = new EventSource("api/stream");
    es.addEventListener("open", () => { live.className = "live on"; live.title = "live: following the log"; });
    es.addEventListener("error", () => { live.className = "live off"; live.title = "disconnected; retrying"; });
    es.addEventListener("head", (ev) => {
      if (!state || Number(ev.data) !== state.run.head) refresh();
    });
  }

  document.getElementById("detail-close").addEventListener("click", closeDetail);
  document.addEventListener("keydown", (e) => { if (e.key === "Escape") closeDetail(); });
  window.addEventListener("hashchange", () => { const id = fromHash(); if (id && id !== openId) showCandidate(id, true); });
  openId = fromHash();
  refresh().then(connect);
})();
