// The fairgate console: reads /console/events (server-sent events, one a second, the fleet's view assessed by
// the gateway: proxy/control/console.py) and draws it. Every name a tenant chose is set as text, never markup.
"use strict";

const HISTORY = 300;      // points kept on the chart (seconds)
const MAX_SERIES = 8;     // tenants drawn (the busiest); the table shows them all
const COLORS = ["#2f6fdf", "#d9485f", "#2e9e5b", "#c08a1e", "#7b4fd6", "#1d9bb2", "#d4622a", "#6b7280"];

const $ = (id) => document.getElementById(id);
let times = [];           // seconds (wall clock)
let shares = new Map();   // tenant -> [its service over its weight, per point]
let chart = null, chartNames = "";

function fmt(x, digits = 0) {
  return Number(x).toLocaleString(undefined, {maximumFractionDigits: digits, minimumFractionDigits: digits});
}

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

function fill(tableId, rows) {
  const body = $(tableId).querySelector("tbody");
  body.replaceChildren();
  for (const cells of rows) {
    const tr = document.createElement("tr");
    for (const [text, cls] of cells) cell(tr, text, cls);
    body.appendChild(tr);
  }
}

function record(view) {
  times.push(view.at);
  const names = Object.keys(view.tenants);
  for (const name of names) {
    if (!shares.has(name)) shares.set(name, new Array(times.length - 1).fill(null));
  }
  for (const [name, series] of shares) {
    const t = view.tenants[name];
    series.push(t ? t.share : null);
  }
  if (times.length > HISTORY) {
    times = times.slice(-HISTORY);
    for (const [name, series] of shares) shares.set(name, series.slice(-HISTORY));
  }
}

function drawChart(view) {
  const busiest = Object.entries(view.tenants)
    .sort((a, b) => (b[1].queued - a[1].queued) || (b[1].rate - a[1].rate))
    .slice(0, MAX_SERIES).map(([name]) => name).sort();
  const key = JSON.stringify(busiest);
  const data = [times, ...busiest.map((n) => shares.get(n))];
  const el = $("share-chart");
  if (chart === null || key !== chartNames) {
    if (chart !== null) chart.destroy();
    chartNames = key;
    chart = new uPlot({
      width: el.clientWidth || 900, height: 260,
      scales: {x: {time: true}},
      series: [{}, ...busiest.map((name, i) => ({label: name, stroke: COLORS[i % COLORS.length], width: 2,
                                                 value: (u, v) => v == null ? "–" : fmt(v, 1)}))],
      axes: [{}, {label: "tokens / s / weight", size: 70}],
    }, data, el);
  } else {
    chart.setData(data);
  }
}

function show(view) {
  $("login").hidden = true;
  $("fleet").hidden = false;
  $("status").textContent = `policy ${view.policy} · updated ${new Date(view.at * 1000).toLocaleTimeString()}`;
  const head = $("headline");
  head.textContent = view.headline;
  head.className = view.headline.startsWith("Not fair") ? "unfair" : "";
  $("jain").textContent = fmt(view.fairness.jain, 2);
  $("waiting").textContent = fmt(view.fairness.waiting);
  $("gap").textContent = fmt(view.fairness.counter_gap);
  $("replicas").textContent = fmt(view.replicas);

  const tenants = Object.entries(view.tenants).sort((a, b) => (b[1].queued - a[1].queued) || (b[1].rate - a[1].rate));
  fill("tenants", tenants.map(([name, t]) => {
    const why = Object.entries(t.refused)
      .map(([code, n]) => `${fmt(n)} × ${view.reasons[code] || "refused"} (${code})`).join("; ");
    return [[name], [fmt(t.weight, 1)], [fmt(t.rate)], [fmt(t.share)], [fmt(t.queued)],
            [t.queued ? `${fmt(t.oldest_wait_s, 1)} s` : "–"], [fmt(t.counter)],
            [why || "–", Object.keys(t.refused_now).length ? "why bad" : "why"]];
  }));
  fill("backends", Object.entries(view.backends).sort().map(([name, b]) => [
    [name], [b.up ? "yes" : "no", b.up ? "good" : "bad"], [fmt(b.inflight)],
    [b.kv_capacity || b.kv_use ? `${fmt(100 * (b.kv_use || b.kv_committed / b.kv_capacity))} %` : "–"],
    [b.prompt ? `${fmt(100 * b.cached / b.prompt)} %` : "–"]]));
  const classes = Object.entries(view.slo).sort();
  fill("slo", classes.length ? classes.map(([name, c]) => [
    [name], [c.all ? `${fmt(100 * c.met / c.all, 1)} %` : "–"], [fmt(c.all)]]) : [[["none set"], ["–"], ["–"]]]);
  record(view);
  drawChart(view);
}

function askForToken(refused) {
  $("fleet").hidden = true;
  $("login").hidden = false;
  $("login-error").hidden = !refused;
  $("status").textContent = "";
  $("token").focus();
}

async function start() {
  // whether a token is needed, asked first: the page makes no request that would be refused
  try {
    const access = await (await fetch("/console/access", {cache: "no-store"})).json();
    if (access.token && !sessionStorage.getItem("fairgate-ops-token")) return askForToken(false);
  } catch (e) {
    $("status").textContent = "the gateway does not answer; trying again…";
    return setTimeout(start, 2000);
  }
  connect();
}

async function connect() {
  const token = sessionStorage.getItem("fairgate-ops-token");
  const headers = token ? {Authorization: `Bearer ${token}`} : {};
  let response;
  try {
    response = await fetch("/console/events", {headers, cache: "no-store"});
  } catch (e) {
    $("status").textContent = "the gateway does not answer; trying again…";
    setTimeout(connect, 2000);
    return;
  }
  if (response.status === 401) {
    sessionStorage.removeItem("fairgate-ops-token");
    return askForToken(true);
  }
  if (!response.ok) {
    $("status").textContent = `the gateway answered ${response.status}; trying again…`;
    setTimeout(connect, 2000);
    return;
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffered = "";
  for (;;) {
    let chunk;
    try {
      chunk = await reader.read();
    } catch (e) {
      break;
    }
    if (chunk.done) break;
    buffered += decoder.decode(chunk.value, {stream: true});
    let end;
    while ((end = buffered.indexOf("\n\n")) >= 0) {
      const event = buffered.slice(0, end);
      buffered = buffered.slice(end + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) show(JSON.parse(line.slice(6)));
      }
    }
  }
  $("status").textContent = "the stream ended; reconnecting…";
  setTimeout(connect, 1000);
}

$("login").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem("fairgate-ops-token", $("token").value);
  $("token").value = "";
  connect();
});
window.addEventListener("resize", () => {
  if (chart !== null) chart.setSize({width: $("share-chart").clientWidth, height: 260});
});
start();
