// Flashpoint's dashboard: polls /v1/ui/state and renders six views. No framework, no CDN:
// every node is built with DOM calls and text is set with textContent (names and sources come
// from the cluster, never trusted as HTML). The API key, when the cluster needs one, lives in
// sessionStorage (gone with the tab) and travels as "Authorization: Bearer", like any API call.
"use strict";

const POLL_MS = 1000;
const KEY_ITEM = "flashpoint.api_key";
const VIEWS = ["cluster", "functions", "waterfall", "transfers", "mig", "cost"];
const TIER_NAMES = {ram: "own RAM", peer: "peer chain", registry: "registry",
                    pipeline: "pipeline", kaas: "KaaS", unknown: "unknown"};
const PHASE_COLOURS = {decision: "#9aa3b5", placement: "#b4bccb", deploy_rpc: "#7f8aa0",
                       assign: "#c9a0dc", worker_prepare: "#a7c7e7", load: "#5b8fd0",
                       to_device: "#3a6fb0", first_inference: "#274f85", announce: "#9fc5a5",
                       handoff: "#c8c8c8", ready_to_dispatch: "#dddddd", request: "#bbbbbb"};

let timer = null;
let last = null;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "style") Object.assign(node.style, v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function bytes(n) {
  if (!n) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function secs(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return `${(s * 1000).toFixed(1)} ms`;
  return `${s.toFixed(2)} s`;
}

function tierMark(tier) {
  return el("span", {class: `tier tier-${tier}`, title: TIER_NAMES[tier] || tier});
}

function table(headers, rows) {
  return el("table", {}, el("thead", {}, el("tr", {}, headers.map(h => el("th", {}, h)))),
            el("tbody", {}, rows));
}

// -- views -------------------------------------------------------------------------------
function renderReplica(r) {
  return el("div", {class: "replica", "data-replica-id": r.replica_id, "data-phase": r.phase},
            tierMark(r.tier), el("b", {}, r.function), el("span", {}, r.phase),
            el("span", {class: "muted"}, r.replica_id),
            el("span", {class: "muted"}, r.source || "–"),
            el("span", {class: "muted"}, bytes(r.device_bytes)),
            r.inflight ? el("span", {class: "badge"}, `${r.inflight} in flight`) : null);
}

function renderDevice(d) {
  const label = d.mig_profile ? `${d.device_id} (MIG ${d.mig_profile})` : d.device_id;
  return el("div", {class: "device", "data-device-id": d.device_id},
            el("div", {}, label, " ", el("span", {class: "muted"}, `${d.kind}, ${bytes(d.memory_bytes)}`)),
            d.replicas.length ? d.replicas.map(renderReplica) : el("div", {class: "muted"}, "idle"));
}

function renderCluster(s) {
  const hosts = s.hosts.map(h => {
    const badges = [];
    if (!h.alive) badges.push(el("span", {class: "badge bad"}, "lost"));
    if (h.spot_notice) badges.push(el("span", {class: "badge warn"}, `spot notice: ${secs(h.drain_in_s)} left`));
    else if (h.draining) badges.push(el("span", {class: "badge warn"}, "draining"));
    const filling = Object.entries(h.filling).map(([k, [done, total]]) =>
      `${k} ${total ? Math.round(100 * done / total) : 0}%`);
    return el("div", {class: `host${h.draining ? " draining" : ""}${h.alive ? "" : " dead"}`,
                      "data-host-id": h.host_id},
      el("h3", {}, h.host_id, badges),
      el("div", {class: "muted"}, `RAM ${bytes(h.ram_bytes)}${h.leaf ? `, leaf ${h.leaf}` : ""}`),
      h.gpus.map(g => el("div", {class: "gpu"}, el("div", {}, `GPU ${g.gpu_index} ${g.model}${g.mig ? " (MIG)" : ""}`),
                         g.devices.map(renderDevice))),
      h.cpu_devices.map(renderDevice),
      el("div", {class: "cache"}, "RAM cache: ",
         h.cached_models.length ? h.cached_models.join(", ") : "empty",
         filling.length ? ` · filling ${filling.join(", ")}` : ""));
  });
  return [el("h2", {}, `Hosts (${s.hosts.length})`),
          el("div", {class: "hosts"}, hosts.length ? hosts : el("p", {class: "muted"}, "no hosts yet"))];
}

function renderFunctions(s) {
  const rows = s.functions.map(f => el("tr", {"data-function": f.name},
    el("td", {}, el("b", {}, f.name), el("div", {class: "muted"}, `${f.model}@${f.model_version}`)),
    el("td", {}, f.ready ? "ready" : (f.not_ready ? f.not_ready.message : "not ready")),
    el("td", {}, f.rate_per_s.toFixed(2)),
    el("td", {}, secs(f.p50_s)), el("td", {}, secs(f.p99_s)),
    el("td", {}, f.slo ? `${(100 * f.slo.compliance).toFixed(1)}% of ${f.slo.met + f.slo.missed} (SLO ${f.slo_ms} ms)` :
                 (f.slo_ms ? `SLO ${f.slo_ms} ms` : "–")),
    el("td", {}, f.queued),
    el("td", {}, Object.entries(f.replicas_by_phase).map(([p, n]) => `${p} ${n}`).join(", ") || "0"),
    el("td", {}, `planned ${f.planned}, requested ${f.requested}, observed ${f.observed}`,
       el("div", {class: "muted"}, f.reason || "")),
    el("td", {}, f.decisions.slice(0, 5).map(d => el("div", {class: "decision"},
       `${d.previous ?? "–"} → ${d.desired} (${secs(d.age_s)} ago): ${d.reason}`,
       d.actions.length ? el("div", {class: "muted"}, d.actions.join("; ")) : null)))));
  return [el("h2", {}, `Functions (${s.functions.length})`),
          table(["function", "state", "req/s", "p50", "p99", "SLO compliance", "queue",
                 "replicas by phase", "scaling", "recent decisions"], rows)];
}

function median(values) {
  if (!values.length) return null;
  const v = [...values].sort((a, b) => a - b);
  return v[Math.floor((v.length - 1) / 2)];
}

// The source hierarchy (own RAM < peer chain < registry; pipeline serves while loading):
// per tier, how many starts and their median wall and bytes-obtaining time.
function tierSummary(waterfall) {
  const rows = ["ram", "peer", "registry", "pipeline"].map(tier => {
    const starts = waterfall.filter(w => w.tier === tier);
    const total = starts.map(w => w.phases.reduce((a, [, v]) => a + v, 0));
    const obtain = starts.map(w => (w.phases.find(([p]) => p === "obtain") || [null, 0])[1]);
    return el("tr", {"data-tier": tier}, el("td", {}, tierMark(tier), ` ${TIER_NAMES[tier]}`),
              el("td", {}, starts.length), el("td", {}, secs(median(total))),
              el("td", {}, secs(median(obtain))));
  });
  return table(["source tier", "cold starts", "median wall", "median obtain"], rows);
}

function renderWaterfall(s) {
  const longest = Math.max(1e-6, ...s.waterfall.map(w => w.phases.reduce((a, [, v]) => a + v, 0)));
  const rows = s.waterfall.map(w => {
    let at = 0;
    const total = w.phases.reduce((a, [, v]) => a + v, 0);
    const segs = w.phases.map(([name, v]) => {
      const seg = el("div", {class: `wf-seg phase-${name}`, title: `${name}: ${secs(v)}`,
                             "data-phase": name},
                     );
      // The bytes' phase (obtain) takes the source tier's colour: the hierarchy at a glance.
      const colour = name === "obtain" ? getComputedStyle(document.documentElement)
        .getPropertyValue(`--${w.tier}`).trim() || "#999" : (PHASE_COLOURS[name] || "#aaa");
      Object.assign(seg.style, {left: `${100 * at / longest}%`, width: `${100 * v / longest}%`,
                                background: colour});
      at += v;
      return seg;
    });
    return el("div", {class: "wf-row", "data-replica-id": w.replica_id, "data-tier": w.tier,
                      "data-source": w.source},
      el("div", {}, tierMark(w.tier), " ", el("b", {}, w.function), " ",
         el("span", {class: "muted"}, `${w.replica_id} on ${w.host_id || "?"} from `),
         el("span", {class: "wf-source"}, `${w.source || "?"} (${TIER_NAMES[w.tier] || w.tier})`),
         w.complete ? null : el("span", {class: "badge"}, "host+worker phases only")),
      el("div", {class: "wf-bar"}, segs),
      el("div", {}, secs(total)));
  });
  const legend = el("div", {class: "muted"}, "phases: ",
    s.phases.map(p => el("span", {class: "hop"}, el("span", {class: "tier", style: {background: PHASE_COLOURS[p] || "#999"}}), ` ${p}`)),
    " · obtain is coloured by where the bytes came from");
  return [el("h2", {}, `Cold starts (${s.waterfall.length})`), tierSummary(s.waterfall), legend,
          rows.length ? rows : el("p", {class: "muted"}, "no cold start yet")];
}

function renderTransfers(s) {
  const chains = s.transfers.map(t => el("div", {class: "chain", "data-transfer-id": t.transfer_id},
    el("div", {}, el("b", {}, t.model_key), " ", el("span", {class: "muted"}, t.transfer_id || "registry fill"),
       t.active ? el("span", {class: "badge"}, "active") : el("span", {class: "badge"}, "finished")),
    el("span", {class: "hop"}, t.sender),
    t.hops.map(h => [el("span", {class: "arrow"}, "→"),
      el("span", {class: "hop", "data-host-id": h.host_id}, h.host_id, " ",
         el("span", {class: "progress"}, el("span", {style: {width: `${h.total_bytes ? 100 * h.verified_bytes / h.total_bytes : 0}%`}})),
         ` ${h.state}`, h.state === "receiving" ? ` ${bytes(h.verified_bytes)} / ${bytes(h.total_bytes)}` : "")])));
  return [el("h2", {}, `Transfers (${s.transfers.length})`),
          chains.length ? chains : el("p", {class: "muted"}, "no chain has run")];
}

function renderMig(s) {
  const gpus = s.mig.gpus.map(g => el("div", {class: "gpu"},
    el("div", {}, el("b", {}, `${g.host_id} GPU ${g.gpu_index}`), ` ${g.model} `, g.mig ? el("span", {class: "badge"}, "MIG on") : el("span", {class: "badge"}, "MIG off")),
    g.slices.map(sl => el("span", {class: "slice"}, `${sl.profile || "whole GPU"} ${sl.device_id} ${bytes(sl.memory_bytes)}`,
                          sl.replicas.length ? ` · ${sl.replicas.join(", ")}` : ""))));
  const reconf = s.mig.reconfigurator;
  return [el("h2", {}, "MIG geometry"),
          gpus.length ? gpus : el("p", {class: "muted"}, "no GPU in this cluster"),
          el("h2", {}, "Reconfigurator"),
          el("pre", {}, reconf ? JSON.stringify(reconf, null, 2) : "off (controller.mig_reconfigure)")];
}

function renderCost(s) {
  const c = s.cost;
  const rows = Object.entries(c).map(([k, v]) => el("tr", {}, el("td", {}, k),
    el("td", {}, k.endsWith("_usd") ? `$${Number(v).toFixed(4)}` : Number(v).toFixed(4))));
  const k = s.kaas;
  const execs = (k.replicas || []).map(r => el("tr", {}, el("td", {}, r.replica_id),
    el("td", {}, r.host_id), el("td", {}, r.device_id), el("td", {}, r.phase), el("td", {}, r.inflight)));
  return [el("h2", {}, "Cost meter"), table(["item", "value"], rows),
          el("h2", {}, "KaaS executors"),
          el("p", {}, `${k.executors ?? 0} of ${k.executors_wanted ?? 0} wanted`,
             k.broken ? ` · broken: ${k.broken}` : "", k.unplaced ? ` · unplaced: ${k.unplaced}` : ""),
          table(["executor", "host", "device", "phase", "in flight"], execs)];
}

const RENDER = {cluster: renderCluster, functions: renderFunctions, waterfall: renderWaterfall,
                transfers: renderTransfers, mig: renderMig, cost: renderCost};

function currentView() {
  const v = location.hash.replace("#", "");
  return VIEWS.includes(v) ? v : "cluster";
}

function render() {
  const view = currentView();
  for (const v of VIEWS) document.getElementById(`view-${v}`).hidden = v !== view;
  for (const a of document.querySelectorAll("#tabs a")) a.classList.toggle("active", a.dataset.view === view);
  if (!last) return;
  const section = document.getElementById(`view-${view}`);
  section.replaceChildren(...RENDER[view](last).flat());
  section.dataset.rendered = String(Date.now());
}

function legend() {
  const tiers = ["ram", "peer", "registry", "pipeline"].map(t => el("span", {}, tierMark(t), ` ${TIER_NAMES[t]}`));
  document.getElementById("legend").replaceChildren("source tiers, fastest first: ", ...tiers);
}

// -- polling and the key -------------------------------------------------------------------
function setConn(text, bad) {
  const c = document.getElementById("conn");
  c.textContent = text;
  c.classList.toggle("bad", !!bad);
}

function askForKey(message) {
  clearTimeout(timer);
  document.getElementById("login").hidden = false;
  document.querySelector("main").hidden = true;
  document.getElementById("login-error").textContent = message || "";
  setConn("API key needed", true);
  document.getElementById("api-key").focus();
}

async function poll() {
  const key = sessionStorage.getItem(KEY_ITEM);
  const headers = key ? {Authorization: `Bearer ${key}`} : {};
  try {
    const resp = await fetch("/v1/ui/state", {headers, cache: "no-store"});
    if (resp.status === 401 || resp.status === 403) {
      sessionStorage.removeItem(KEY_ITEM);
      askForKey(key ? "That key was refused." : "");
      return;
    }
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    last = await resp.json();
    document.getElementById("login").hidden = true;
    document.querySelector("main").hidden = false;
    if (last.gateway && !last.gateway.controller_connected) {
      // Through a stand-alone gateway whose controller is away: the data is its last copy.
      setConn(`controller unreachable · data ${secs(last.gateway.table_age_s)} old`, true);
    } else {
      setConn(`live · ${new Date().toLocaleTimeString()}`, false);
    }
    document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
    render();
  } catch (err) {
    setConn(`disconnected (${err.message}); retrying`, true);
  }
  timer = setTimeout(poll, POLL_MS);
}

async function start() {
  legend();
  window.addEventListener("hashchange", render);
  document.getElementById("login").addEventListener("submit", ev => {
    ev.preventDefault();
    sessionStorage.setItem(KEY_ITEM, document.getElementById("api-key").value.trim());
    document.getElementById("api-key").value = "";
    poll();
  });
  render();
  // Ask before the first data call whether a key is needed, so an open page never
  // answers a 401 (the console stays clean); a stored key is tried as it is.
  if (!sessionStorage.getItem(KEY_ITEM)) {
    try {
      const auth = await (await fetch("/v1/ui/auth", {cache: "no-store"})).json();
      if (auth.key_required) { askForKey(""); return; }
    } catch (err) {
      setConn(`disconnected (${err.message})`, true);
    }
  }
  poll();
}

document.addEventListener("DOMContentLoaded", start);
