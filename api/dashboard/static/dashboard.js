// fairq dashboard: the overview's chart and its refresh. A static file: the page's
// Content-Security-Policy allows no inline script.
//
// A page whose <main> has data-refresh-seconds reloads itself in the background that often
// (not while the tab is hidden): it fetches its own URL and swaps each element marked
// data-refresh-region for the one with the same id in the answer. The server rendered and
// escaped them; nothing here builds HTML from data. A fetch sent to the login page (the
// session expired) takes the tab there.
(function () {
  "use strict";

  var chart = null;

  function seriesOf(root) {
    var holder = root.querySelector("#chart-data");
    if (!holder) return null;
    var series = JSON.parse(holder.getAttribute("data-series"));
    return [series.t, series.completed, series.failed];
  }

  function chartWidth(element) {
    return Math.max(element.clientWidth - 16, 300);
  }

  function drawChart() {
    var element = document.getElementById("finished-chart");
    var data = seriesOf(document);
    if (!element || !data || typeof window.uPlot !== "function") return;
    if (chart) {
      chart.setData(data);
      return;
    }
    var utc = function (ts) { return window.uPlot.tzDate(new Date(ts * 1000), "Etc/UTC"); };
    var hourMinute = window.uPlot.fmtDate("{HH}:{mm}");
    var minute = window.uPlot.fmtDate("{YYYY}-{MM}-{DD} {HH}:{mm} UTC");
    chart = new window.uPlot({
      width: chartWidth(element),
      height: 240,
      // Every time on these pages is in UTC.
      tzDate: utc,
      scales: { x: { time: true }, y: { range: function (u, min, max) { return [0, Math.max(max, 1)]; } } },
      axes: [
        { values: function (u, splits) { return splits.map(function (ts) { return hourMinute(utc(ts)); }); } },
        { label: "tasks per minute" }
      ],
      series: [
        { value: function (u, ts) { return ts == null ? "--" : minute(utc(ts)); } },
        { label: "completed", stroke: "#1e7a46", fill: "rgba(30, 122, 70, 0.12)", width: 2 },
        { label: "failed", stroke: "#b42318", fill: "rgba(180, 35, 24, 0.12)", width: 2 }
      ]
    }, data, element);
    window.addEventListener("resize", function () {
      chart.setSize({ width: chartWidth(element), height: 240 });
    });
  }

  function markStale(stale) {
    var note = document.getElementById("refreshed");
    if (note) note.classList.toggle("stale-data", stale);
  }

  function refresh() {
    if (document.hidden) return;
    fetch(window.location.href, {
      credentials: "same-origin",
      cache: "no-store",
      headers: { "Accept": "text/html" }
    }).then(function (response) {
      if (response.redirected && new URL(response.url).pathname.endsWith("/login")) {
        window.location.assign(response.url);
        return null;
      }
      if (!response.ok) {
        markStale(true);
        return null;
      }
      return response.text();
    }).then(function (text) {
      if (text === null) return;
      var fresh = new DOMParser().parseFromString(text, "text/html");
      document.querySelectorAll("[data-refresh-region]").forEach(function (region) {
        var replacement = region.id && fresh.getElementById(region.id);
        if (replacement) region.replaceWith(document.importNode(replacement, true));
      });
      markStale(false);
      drawChart();
    }).catch(function () {
      markStale(true);
    });
  }

  drawChart();
  var main = document.querySelector("main[data-refresh-seconds]");
  if (main) {
    var seconds = Number(main.getAttribute("data-refresh-seconds"));
    if (seconds > 0) window.setInterval(refresh, seconds * 1000);
  }
}());
