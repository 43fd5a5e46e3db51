// Live refresh for the admin pages (shipped in the package: no CDN, no inline script, so
// the page's Content-Security-Policy stays 'self'). The page reads without it: the server
// renders every record. With JavaScript on, the region marked data-live="SECONDS" is
// fetched again from the same URL (the same search, the same page) and swapped in place,
// with no reload: the server's template and escaping stay the only ones. Boxes an operator
// ticked stay ticked and the box the keyboard was on keeps the focus; nothing is fetched
// while the tab is hidden or while paused; an answer that is not 200 (a session that
// expired, a server gone) stops it and says why.
(function () {
  "use strict";
  var region = document.querySelector("[data-live]");
  var status = document.querySelector("[data-live-status]");
  if (!region || !status || !window.fetch || !window.DOMParser) {
    return;
  }
  var seconds = Math.max(2, parseInt(region.getAttribute("data-live"), 10) || 10);
  var said = status.querySelector("[data-live-said]");
  var toggle = status.querySelector("button");
  var paused = false;
  var stopped = false;
  var busy = false;

  function say(text) {
    said.textContent = text;
  }

  function ticked() {
    var chosen = {};
    region.querySelectorAll("input:checked").forEach(function (box) {
      chosen[keyOf(box)] = true;
    });
    return chosen;
  }

  function keyOf(box) {
    return box.name + "\u0000" + box.value;
  }

  function refresh() {
    if (paused || stopped || busy || document.hidden) {
      return;
    }
    busy = true;
    fetch(window.location.href, {
      headers: { "Accept": "text/html" },
      credentials: "same-origin",
      cache: "no-store"
    }).then(function (answer) {
      if (!answer.ok) {
        throw new Error("the server answered " + answer.status + ": reload the page");
      }
      return answer.text();
    }).then(function (html) {
      var fresh = new DOMParser().parseFromString(html, "text/html").querySelector("[data-live]");
      if (!fresh) {
        throw new Error("the page changed: reload it");
      }
      var chosen = ticked();
      var focused = document.activeElement;
      var focusKey = focused && focused.tagName === "INPUT" && region.contains(focused) ?
        keyOf(focused) : null;
      region.replaceChildren.apply(region, Array.prototype.map.call(fresh.childNodes,
        function (node) { return document.importNode(node, true); }));
      region.querySelectorAll("input").forEach(function (box) {
        if (chosen[keyOf(box)]) {
          box.checked = true;
        }
        if (focusKey !== null && keyOf(box) === focusKey) {
          box.focus();
        }
      });
      say("Live: updated " + new Date().toLocaleTimeString() + ", every " + seconds + " s.");
    }).catch(function (error) {
      stopped = true;
      toggle.hidden = true;
      say("Live refresh stopped: " + error.message);
    }).finally(function () {
      busy = false;
    });
  }

  toggle.addEventListener("click", function () {
    paused = !paused;
    toggle.textContent = paused ? "Resume" : "Pause";
    say(paused ? "Live refresh paused." : "Live: every " + seconds + " s.");
  });
  say("Live: every " + seconds + " s.");
  status.hidden = false;
  window.setInterval(refresh, seconds * 1000);
}());
