// ocache dashboard: polls GET /ocache/api/view (ocache/dashboard.py documents its shape) and
// renders it. Text only through textContent (session ids and folders are data, never markup).
"use strict";
(function () {
  const POLL_MS = Number(new URLSearchParams(location.search).get("interval_ms")) || 1000;
  const KEEP = 200;                       // requests kept for the chart across polls
  const TIERS = ["resident", "session", "disk", "head"];
  const COLORS = {prefilled: "#d9534f", resident: "#5cb85c", session: "#2a7ab0", disk: "#8e6bbf",
                  head: "#f0ad4e"};
  const seen = new Map();                 // request_id -> request record

  const $ = (id) => document.getElementById(id);
  const int = (v) => (v === null || v === undefined) ? "–" : Math.round(v).toLocaleString("en-US");
  function bytes(n) {                     // decimal units, like `ocache cache ls`
    if (n === null || n === undefined) return "–";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i++; }
    return i === 0 ? `${Math.round(n)} B` : `${n.toFixed(1)} ${units[i]}`;
  }
  function secs(s) {
    if (s === null || s === undefined) return "–";
    if (s < 1) return `${(s * 1000).toFixed(0)} ms`;
    if (s < 120) return `${s.toFixed(1)} s`;
    if (s < 7200) return `${(s / 60).toFixed(1)} min`;
    return `${(s / 3600).toFixed(1)} h`;
  }
  const ms = (v) => (v === null || v === undefined) ? "–" : `${v.toFixed(1)} ms`;
  const set = (id, text) => { const e = $(id); if (e) e.textContent = text; };
  function row(cells, attrs) {
    const tr = document.createElement("tr");
    for (const [k, v] of Object.entries(attrs || {})) tr.dataset[k] = v;
    for (const c of cells) {
      const td = document.createElement("td");
      const [text, cls] = Array.isArray(c) ? c : [c, ""];
      td.textContent = text;
      if (cls) td.className = cls;
      tr.appendChild(td);
    }
    return tr;
  }
  function fill(tbody, rows) { tbody.replaceChildren(...rows); }

  // --- token (admin): from #token=... in the URL or the input; kept for this tab only
  const fromHash = new URLSearchParams(location.hash.slice(1)).get("token");
  if (fromHash) {  // keep it out of the address bar (and of screenshots)
    sessionStorage.setItem("ocache-token", fromHash);
    window.history.replaceState(null, "", location.pathname + location.search);
  }
  $("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem("ocache-token", $("token").value);
    poll();
  });

  // --- chart
  const chart = new Chart($("chart"), {
    type: "bar",
    data: {labels: [], datasets: [
      {label: "prefilled", data: [], backgroundColor: COLORS.prefilled, stack: "t"},
      ...TIERS.map((t) => ({label: t === "head" ? "head (ocache prefilled it in this request)" : `reused from ${t}`,
                            data: [], backgroundColor: COLORS[t], stack: "t"})),
    ]},
    options: {
      animation: false, maintainAspectRatio: false,
      scales: {x: {stacked: true, title: {display: true, text: "request (oldest → newest)"}},
               y: {stacked: true, beginAtZero: true, title: {display: true, text: "prompt tokens"}}},
      plugins: {tooltip: {mode: "index"}},
    },
  });

  function renderChart(reqs) {
    for (const r of reqs) seen.set(r.request_id, r);
    while (seen.size > KEEP) seen.delete(seen.keys().next().value);
    const all = [...seen.values()];
    chart.data.labels = all.map((r) => r.request_id);
    chart.data.datasets[0].data = all.map((r) => r.prefilled);
    TIERS.forEach((t, i) => {
      chart.data.datasets[i + 1].data = all.map((r) => (r.tier === t ? r.reused : 0));
    });
    chart.update();
  }

  function render(v) {
    const t = v.totals, u = v.upstream;
    set("up-state", u.state ?? "?"); set("up-epoch", u.epoch ?? "?"); set("up-restarts", int(u.restarts));
    set("up-build", u.build_info ?? ""); set("up-url", u.url ?? "");
    set("uptime", secs(v.uptime_s));
    set("t-saved-alone", t.saved_vs_alone === null || t.saved_vs_alone === undefined ? "–" : int(t.saved_vs_alone));
    set("t-saved-alone-s", secs(t.saved_vs_alone_s)); set("t-alone-prefill", int(t.alone_prefill));
    set("t-ocache-prefill", int(t.ocache_prefill));
    set("t-saved", int(t.saved)); set("t-saved-s", secs(t.saved_s));
    set("t-rate", int(t.prefill_tok_s)); set("t-reused", int(t.reused));
    set("t-prefilled", int(t.prefilled)); set("t-completions", int(t.completions));
    set("t-inflight", int(t.inflight)); set("t-disk-bytes", bytes(t.disk_bytes));
    set("t-disk-entries", int(v.store.entries));
    set("t-fail-open", int(t.fail_open)); set("t-mispredictions", int(t.mispredictions));
    const al = v.align || {enabled: false, aligned: 0, saved: 0, refused: 0, requests: []};
    set("t-aligned", al.enabled ? int(al.aligned) : "off"); set("t-aligned-saved", int(al.saved));
    set("align-refused", int(al.refused));
    $("aligned").hidden = !al.requests.length;
    fill($("align-table").tBodies[0], al.requests.slice().reverse().map((r) => row([
      r.request_id, r.time ? new Date(r.time * 1000).toLocaleTimeString() : "–",
      [r.slot === null ? "–" : String(r.slot), "n"], [int(r.kept), "n kept"],
      [int(r.new), "n new"], [int(r.saved), "n saved"],
    ], {rid: r.request_id})));

    const off = v.tiers_off_lines || [];
    $("tiers-off").hidden = !off.length;
    fill($("tiers-off-list"), off.map((w) => {
      const li = document.createElement("li"); li.textContent = w; return li;
    }));

    $("warnings").hidden = !v.setup_warnings.length;
    fill($("warning-list"), v.setup_warnings.map((w) => {
      const li = document.createElement("li"); li.textContent = w; return li;
    }));

    const servers = v.servers || [];
    $("servers").hidden = !servers.length;
    fill($("server-table").tBodies[0], servers.map((x) => row([
      x.url ?? "?", x.state ?? "?", [String(x.epoch ?? "?"), "n"], [int(x.inflight), "n"],
      [int(x.routed), "n"], Object.entries(x.reasons).map(([k, n]) => `${k} ${n}`).join(", ") || "–",
      [`${int(x.busy_slots)}/${int(x.slots)}`, "n"], [int(x.tokens), "n tokens"],
      [int(x.prefilled), "n"], [int(x.reused), "n"],
    ], {server: x.url})));

    fill($("slot-table").tBodies[0], v.slots.map((s) => row([
      [String(s.id), "n"],
      (s.busy ? "busy · " : "") + (s.kind ?? (s.tokens ? "unknown" : "empty")) + (s.origin ? " (warmed head)" : ""),
      [int(s.tokens), "n tokens"], [int(s.head_len), "n"], [int(s.checkpoints), "n"],
      s.owner ?? (s.owner_hidden ? "(admin token)" : "–"),
      [s.idle_s === null ? "–" : secs(s.idle_s), "n"],
    ], {slot: s.id})));

    const tr = v.tiers;
    const cells = (id, vals) => {
      const r = $(id);
      for (const [cls, text] of Object.entries(vals)) r.querySelector("." + cls).textContent = text;
    };
    cells("tier-head", {saves: int(tr.head.saves), restores: int(tr.head.restores)});
    cells("tier-disk", {saves: int(tr.disk.anchors), restores: int(tr.disk.restores), hits: int(tr.disk.hits),
                        save: secs(tr.disk.save_s_p50), restore: secs(tr.disk.restore_s_p50)});
    cells("tier-session", {saves: int(tr.session.spills), restores: int(tr.session.restores),
                           hits: int(tr.session.hits), save: secs(tr.session.spill_s_p50),
                           restore: secs(tr.session.restore_s_p50)});

    fill($("store-table").tBodies[0], Object.entries(v.store.by_kind).map(([k, s]) =>
      row([k, [int(s.entries), "n entries"], [bytes(s.bytes), "n bytes"], [int(s.hits), "n"]], {kind: k})));
    set("store-budget", bytes(v.store.budget_bytes));
    const nx = v.store.next_eviction;
    set("store-next", nx ? `${nx.kind === "a" ? "anchor" : "spill"} ${nx.key} (${int(nx.n_tokens)} tokens, `
      + `${bytes(nx.bytes)}, ${int(nx.hits)} hits, idle ${secs(nx.idle_s)})` : "nothing stored");
    $("folder-table").hidden = !v.store.by_folder.length;
    fill($("folder-table").tBodies[0], v.store.by_folder.map((f) => row([
      f.folder ?? "–", f.client ?? "–", f.model ?? "–", [int(f.entries), "n"], [bytes(f.bytes), "n"]])));

    fill($("req-table").tBodies[0], v.requests.slice().reverse().map((r) => row([
      r.request_id, r.time ? new Date(r.time * 1000).toLocaleTimeString() : "–", r.kind ?? "–",
      [r.slot === null ? "–" : String(r.slot), "n"], r.tier ?? "–",
      [int(r.prefilled), "n prefilled"], [int(r.reused), "n reused"], [ms(r.restore_ms), "n"],
      [ms(r.ttft_ms), "n"], [String(r.status), "n"],
    ], {rid: r.request_id})));
    renderChart(v.requests);

    fill($("events"), (v.events || []).slice().reverse().map((e) => {
      const li = document.createElement("li");
      li.className = e.level;
      li.textContent = `${new Date(e.time * 1000).toLocaleTimeString()} ${e.source}: ${e.message}`;
      return li;
    }));
    document.body.dataset.viewTime = String(v.time);
  }

  let timer = null;
  async function poll() {
    clearTimeout(timer);
    const token = sessionStorage.getItem("ocache-token");
    try {
      const r = await fetch("/ocache/api/view", {cache: "no-store",
        headers: token ? {Authorization: `Bearer ${token}`} : {}});
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      const v = await r.json();
      render(v);
      set("status", v.admin ? "live (admin)" : (v.token_rejected ? "live (wrong admin token: sessions hidden)" : "live"));
      $("status").className = "";
    } catch (err) {
      set("status", `not connected: ${err.message}`);
      $("status").className = "error";
    }
    timer = setTimeout(poll, POLL_MS);
  }
  poll();
})();
