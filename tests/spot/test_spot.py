"""Spot eviction pieces: notice parsing, the IMDSv2 watcher against a local server speaking
that API, the file trigger, the cost meter, and the spot-then-on-demand rule."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from flashpoint.errors import BadRequest, NoCapacity
from flashpoint.spot.cost import TABLE3_PRICES, CostMeter
from flashpoint.spot.notice import (
    DEFAULT_LEAD_S,
    FileWatcher,
    ImdsWatcher,
    notice_from,
    watch,
    watchers_from,
)
from flashpoint.spot.provider import replace_host


def test_notice_time_becomes_a_monotonic_deadline():
    wall = datetime(2026, 11, 23, 18, 0, 0, tzinfo=UTC)
    n = notice_from({"action": "terminate", "time": "2026-11-23T18:01:30Z"}, "imds",
                    now_wall=wall, now_mono=100.0)
    assert (n.action, n.deadline_s, n.source) == ("terminate", 190.0, "imds")
    assert notice_from({"seconds": 5}, "file", now_mono=10.0).deadline_s == 15.0
    # Unreadable or missing time: the default lead (drain now, not never).
    assert notice_from({"time": "soon"}, "imds", now_mono=0.0).deadline_s == DEFAULT_LEAD_S
    assert notice_from(None, "signal", now_mono=0.0).deadline_s == DEFAULT_LEAD_S
    past = (wall - timedelta(seconds=30)).isoformat()
    assert notice_from({"time": past}, "imds", now_wall=wall, now_mono=7.0).deadline_s == 7.0


class FakeImds:
    """The IMDSv2 instance-action API: PUT token (TTL header required), GET with the token;
    404 until an action is set; tokens can be expired to exercise the 401 path."""

    def __init__(self) -> None:
        self.tokens: set[str] = set()
        self.action: dict[str, str] | None = None
        self.puts = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_put("/latest/api/token", self.token)
        app.router.add_get("/latest/meta-data/spot/instance-action", self.instance_action)
        return app

    async def token(self, request: web.Request) -> web.Response:
        if "X-aws-ec2-metadata-token-ttl-seconds" not in request.headers:
            return web.Response(status=400)
        self.puts += 1
        tok = f"tok{self.puts}"
        self.tokens.add(tok)
        return web.Response(text=tok)

    async def instance_action(self, request: web.Request) -> web.Response:
        if request.headers.get("X-aws-ec2-metadata-token") not in self.tokens:
            return web.Response(status=401)
        if self.action is None:
            return web.Response(status=404)
        return web.Response(text=json.dumps(self.action), content_type="text/plain")


@pytest.fixture
async def imds():
    fake = FakeImds()
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield fake, f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_imds_watcher_speaks_imdsv2(imds) -> None:
    fake, url = imds
    w = ImdsWatcher(url, timeout_s=2.0)
    async with aiohttp.ClientSession() as s:
        assert await w.poll(s) is None  # 404: nothing scheduled
        fake.tokens.clear()  # the token expired: 401, then a fresh token
        assert await w.poll(s) is None and fake.puts == 2
        at = (datetime.now(UTC) + timedelta(seconds=60)).strftime("%Y-%m-%dT%H:%M:%SZ")
        fake.action = {"action": "terminate", "time": at}
        n = await w.poll(s)
    assert n is not None and n.action == "terminate" and 50 < n.remaining_s() <= 61


async def test_watch_hands_over_one_notice_and_survives_a_dead_endpoint(imds, tmp_path) -> None:
    fake, url = imds
    got = []

    async def on_notice(n) -> None:
        got.append(n)

    # A metadata service that does not answer is retried, never fatal; the file fires.
    dead = ImdsWatcher("http://127.0.0.1:9", timeout_s=0.2)
    path = tmp_path / "notice"
    task = asyncio.ensure_future(watch([dead, FileWatcher(path)], on_notice, interval_s=0.05))
    await asyncio.sleep(0.3)
    assert not task.done()
    path.write_text(json.dumps({"seconds": 30}))
    n = await asyncio.wait_for(task, 5)
    assert got == [n] and n.source == "file" and 25 < n.remaining_s() <= 30


async def test_file_watcher_empty_file_is_the_default_lead(tmp_path: Path) -> None:
    path = tmp_path / "evict"
    assert await FileWatcher(path).poll() is None
    path.write_text("")
    n = await FileWatcher(path).poll()
    assert n is not None and DEFAULT_LEAD_S - 2 < n.remaining_s() <= DEFAULT_LEAD_S


def test_watchers_from_config():
    ws = watchers_from("imds, file:/tmp/x, signal", "http://127.0.0.1:1")
    assert [type(w).__name__ for w in ws] == ["ImdsWatcher", "FileWatcher"]
    assert watchers_from("", "x") == []
    with pytest.raises(BadRequest, match="unknown spot_notice"):
        watchers_from("smoke", "x")


def test_cost_meter_spot_vs_on_demand():
    m = CostMeter()
    m.start("a", "spot", 0.0)
    m.start("b", "ondemand", 0.0)
    m.start("a", "spot", 100.0)  # idempotent while running
    m.stop("a", 1800.0)
    m.stop("a", 9999.0)  # idempotent once stopped
    r = m.report(3600.0)
    aws = TABLE3_PRICES["aws"]
    assert r["spot_hours"] == pytest.approx(0.5) and r["ondemand_hours"] == pytest.approx(1.0)
    assert r["total_usd"] == pytest.approx(0.5 * aws["spot"] + aws["ondemand"])
    assert r["saved_usd"] == pytest.approx(0.5 * (aws["ondemand"] - aws["spot"]))
    with pytest.raises(ValueError):
        m.start("c", "preemptible", 0.0)


async def test_replacement_is_spot_first_then_on_demand():
    class Provider:
        def __init__(self, spot: bool) -> None:
            self.spot, self.asked = spot, []

        async def acquire(self, kind: str, replacing: str) -> str:
            self.asked.append(kind)
            if kind == "spot" and not self.spot:
                raise NoCapacity("no spot")
            return f"new-{kind}"

    p = Provider(spot=True)
    assert await replace_host(p, "h1") == ("new-spot", "spot") and p.asked == ["spot"]
    p = Provider(spot=False)
    assert await replace_host(p, "h1") == ("new-ondemand", "ondemand")
    assert p.asked == ["spot", "ondemand"]
