"""The status page at `/`: content over the API (escaping, chart, tables), and the real thing in
headless Chromium (Debian's package): load the page, check the rendered DOM, take a screenshot
(its path is printed; the file stays in pytest's tmp directory)."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from controller.api import create_app
from tests.controller.ops_support import TOKEN, LiveDaemon, Rig, make_rig

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    r = await make_rig(tmp_path)
    yield r
    await r.close()


async def _page(rig: Rig) -> str:
    app = create_app(rig.controller, TOKEN)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.get("/")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    return r.text


async def test_page_before_any_data(rig: Rig) -> None:
    html = await _page(rig)
    assert 'id="profile">baseline<' in html
    assert "Not enough observations for a chart yet" in html
    assert "none yet" in html  # no decision yet


async def test_page_content(rig: Rig) -> None:
    # Baseline first (break-even needs its rate at this batch size), pinned away before the
    # policy's own first move is due (an untried chain is weighed from 5 minutes in).
    await rig.ticks(25)
    rig.controller.pin("eagle3-2step", 3600, "", "me")
    await rig.ticks(30)
    html = await _page(rig)
    assert 'id="profile">eagle3-2step<' in html
    assert 'id="mode">active<' in html
    assert '<svg id="chart"' in html and "<polyline" in html
    assert html.count('class="switch"') == 1  # the pinned switch (the start precedes the data)
    rows = re.findall(r"<tr class=\"([^\"]*)\"><td>.*?</span>([^<]+)</td>", html)
    assert [name for _, name in rows] == ["baseline", "eagle3-2step", "eagle3-5step"]
    assert "running" in dict((n, c) for c, n in rows)["eagle3-2step"]
    # Observed tok/s only where the profile runs: baseline's is its last run's, under the
    # traffic of 25 ticks ago, in a table of estimates for the traffic served now.
    table = html.split('id="estimates"')[1].split("</table>")[0]
    cells = {
        name: re.findall(r"<td>([^<]*)</td>", rest)
        for name, rest in re.findall(r"</span>([^<]+)</td>(.*?)</tr>", table)
    }
    assert cells["baseline"][2] == "–"
    assert float(cells["eagle3-2step"][2].replace(",", "")) > 0
    # The break-even line for the running profile: 2-step needs 1.33 (266.7 tok/s x 40 ms / 8)
    # and accepts 2.2.
    assert re.search(r"eagle3-2step needs accept length <b>1\.33</b>.*<b>2\.19?\d*</b>", html)
    assert "pays" in html
    assert "Pin: eagle3-2step until" in html
    decisions = html.split('id="decisions"')[1]
    assert decisions.count("<tr>") == 1 + 15  # header + the 15 most recent


async def test_page_escapes_what_it_prints(rig: Rig) -> None:
    await rig.ticks(3)
    rig.controller.funnel.blocked_reason = "<script>alert('x')</script> & more"
    html = await _page(rig)
    assert "<script>" not in html
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; more" in html


def _chromium(args: list[str], tmp: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    assert CHROMIUM is not None
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp / 'chromium-profile'}",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium not installed (tools/test-deps.sh installs Debian's)"
)
def test_status_page_in_headless_chromium(tmp_path: Path) -> None:
    with LiveDaemon(tmp_path / "daemon", time_scale=100.0) as live:
        live.wait_ticks(30)  # some baseline first: break-even needs its rate
        r = httpx.put(
            live.url + "/v1/pin",
            json={"profile": "eagle3-2step", "ttl_s": 3600, "reason": "screenshot"},
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=5,
        )
        assert r.status_code == 200
        live.wait_ticks(40)
        url = live.url + "/"

        dom = _chromium(["--dump-dom", url], tmp_path)
        assert dom.returncode == 0, dom.stderr[-2000:]
        html = dom.stdout
        assert "<title>specpilot · eagle3-2step</title>" in html
        assert re.search(r'id="profile">eagle3-2step<', html)
        assert 'id="estimates"' in html and 'id="decisions"' in html
        for name in ("baseline", "eagle3-2step", "eagle3-5step"):
            assert name in html
        assert "break-even accept length" in html
        assert "<polyline" in html and 'class="switch"' in html

        shot = tmp_path / "status-page.png"
        res = _chromium(["--screenshot=" + str(shot), "--window-size=1200,900", url], tmp_path)
        assert res.returncode == 0, res.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000  # a rendered page, not a blank one
    print(f"status page screenshot: {shot}")
