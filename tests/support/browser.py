"""A page checked in a real headless Chromium, over the DevTools protocol on a pipe (no extra packages).

`render(path)` loads a local HTML file and returns what a reader would see: the console errors and
uncaught exceptions, failed resource loads, every <img>/<svg> with its rendered and natural size,
the page's text, and (optionally) a full-page PNG screenshot.

Chromium is found as $POSTTRAIN_CHROMIUM or chromium / chromium-browser / google-chrome on PATH
(Debian: `apt-get install chromium`).
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
# Rendered boxes and natural sizes of every image and inline SVG, and the page's text.
PROBE = """JSON.stringify({
  images: [...document.querySelectorAll('img, svg')].map(e => ({
    tag: e.tagName.toLowerCase(), alt: e.getAttribute('alt') || '',
    width: e.getBoundingClientRect().width, height: e.getBoundingClientRect().height,
    natural_width: e.naturalWidth || 0, natural_height: e.naturalHeight || 0, complete: e.complete !== false})),
  text: document.body.innerText,
  external: [...document.querySelectorAll('[src],[href]')].map(e => e.getAttribute('src') || e.getAttribute('href'))
    .filter(u => /^(https?:)?\\/\\//.test(u)),
})"""


def find_chromium() -> str | None:
    """The Chromium binary, or None."""
    if os.environ.get("POSTTRAIN_CHROMIUM"):
        return os.environ["POSTTRAIN_CHROMIUM"]
    return next((p for p in map(shutil.which, NAMES) if p), None)


def _high_fd(fd: int) -> int:
    """`fd` moved to a number >= 10 (the old one closed)."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return high


class DevTools:
    """One headless Chromium driven over --remote-debugging-pipe (fd 3: commands in, fd 4: replies out)."""

    def __init__(self, binary: str, timeout: float = 60.0):
        self.timeout, self.events, self._next_id, self._buf = timeout, [], 0, b""
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()
        # The child's ends move to fds >= 10 first, so that placing them at 3 and 4 overwrites neither.
        cmd_r, out_w = (_high_fd(fd) for fd in (cmd_r, out_w))
        self._profile = tempfile.mkdtemp(prefix="chromium-profile-")
        args = [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
            "--remote-debugging-pipe",
            f"--user-data-dir={self._profile}",
            "about:blank",
        ]
        # The protocol wants fds 3 and 4 exactly: bash (dash cannot name fds >= 10) puts the pipe ends
        # there, then becomes Chromium.
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$@" 3<&{cmd_r} 4>&{out_w}', "bash", *args],
            pass_fds=(cmd_r, out_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        os.close(cmd_r)
        os.close(out_w)

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._out_r], [], [], left)[0]:
                raise TimeoutError("no reply from Chromium")
            chunk = os.read(self._out_r, 1 << 20)
            if not chunk:
                raise RuntimeError(f"Chromium exited: {self.proc.stderr.read().decode(errors='replace')[-2000:]}")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """Send a command and wait for its result; events that arrive meanwhile are kept in `events`."""
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        try:
            os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        except BrokenPipeError:
            raise RuntimeError(f"Chromium exited: {self.proc.stderr.read().decode(errors='replace')[-2000:]}") from None
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def wait_for(self, method: str) -> dict:
        """The first event `method` (already received or the next to come)."""
        deadline = time.monotonic() + self.timeout
        while True:
            found = next((e for e in self.events if e.get("method") == method), None)
            if found:
                return found
            self.events.append(self._read_message(deadline))

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except Exception:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._cmd_w)
        os.close(self._out_r)
        self.proc.stderr.close()
        shutil.rmtree(self._profile, ignore_errors=True)


def problems(events: list[dict]) -> list[str]:
    """Console errors, uncaught exceptions and failed loads among DevTools events."""
    out = []
    for e in events:
        p = e.get("params", {})
        if e.get("method") == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            out.append(f"uncaught: {d.get('exception', {}).get('description') or d.get('text')}")
        elif e.get("method") == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            out.append(f"console.{p['type']}: {' '.join(str(a.get('value', a.get('description'))) for a in p['args'])}")
        elif e.get("method") == "Log.entryAdded" and p["entry"]["level"] == "error":
            out.append(f"log: {p['entry']['text']} {p['entry'].get('url', '')}".strip())
    return out


def render(path: str, binary: str, *, width: int = 1300, screenshot: str | None = None) -> dict:
    """Load `path` in headless Chromium: {"problems", "images", "text", "external"} (see PROBE)."""
    browser = DevTools(binary)
    try:
        target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            browser.send(f"{domain}.enable", session=session)
        browser.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False},
            session,
        )
        browser.send("Page.navigate", {"url": "file://" + os.path.abspath(path)}, session)
        browser.wait_for("Page.loadEventFired")
        probe = browser.send("Runtime.evaluate", {"expression": PROBE, "returnByValue": True}, session)
        if "exceptionDetails" in probe:
            raise RuntimeError(f"probe failed: {probe['exceptionDetails']}")
        result = json.loads(probe["result"]["value"])
        if screenshot:
            shot = browser.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session)
            with open(screenshot, "wb") as f:
                f.write(base64.b64decode(shot["data"]))
        result["problems"] = problems(browser.events)
        return result
    finally:
        browser.close()
