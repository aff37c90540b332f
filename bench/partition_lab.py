"""The netns lab both partitioned cold-start benches run in (shared by
``bench/partition_cluster.py`` and ``bench/generate_partitioned.py``): the environment, the
cluster with the partition planner told the links' rate, and the per-k steps around the
measurement (publish, the seed replica on host0, the ready poller, the teardown)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

from flashpoint.registry import LocalStore
from flashpoint.registry.manifest import Manifest
from flashpoint.testing.netcluster import FAKE_AWS_ENV, UNSET_ENV, NetCluster
from flashpoint.testing.netns import NetLab


def add_lab_arguments(ap: argparse.ArgumentParser) -> None:
    """The lab's own options: stage hosts, their links' rate, the planner's per-stage
    overhead and the registry's GET span."""
    ap.add_argument("--hosts", type=int, default=4, help="stage hosts (plus host0, the peer)")
    ap.add_argument("--rate-mbit", type=float, default=250.0)
    ap.add_argument("--overhead-s", type=float, default=0.5,
                    help="per-stage start cost the controller plans with")
    ap.add_argument("--span-mb", type=int, default=32,
                    help="bytes per ranged registry GET (moto's server re-reads the whole "
                         "object for every GET, so fewer, larger GETs)")


def require_root(script: str) -> None:
    """Exit unless run as root: the lab builds network namespaces."""
    if os.geteuid() != 0:
        sys.exit(f"{script} builds network namespaces: run it as root")


def use_fake_aws() -> None:
    """Point this process (and the cluster it starts) at moto's fake S3 credentials."""
    for key, value in FAKE_AWS_ENV.items():
        os.environ[key] = value
    for key in UNSET_ENV:
        os.environ.pop(key, None)


async def start_cluster(lab: Path, args: argparse.Namespace, *, model_bytes: int,
                        timeout_s: float, peer: bool) -> NetCluster:
    """``args.hosts`` stage hosts plus ``host0`` in network namespaces under ``lab``
    (created), from the options of :func:`add_lab_arguments`: every stage host's link capped
    at ``args.rate_mbit`` each way and the controller's partition cost model told the same
    rate; ``host0``'s link is left uncapped when it serves as the ``peer`` the stages fetch
    from. Each device holds one replica of a ``model_bytes`` model (so the seed replica
    fills host0's); ``timeout_s`` bounds cold starts and deploys."""
    lab.mkdir()
    rate_bps = args.rate_mbit * 1e6
    return await NetCluster.start(NetLab, lab, args.hosts + 1, rate_mbit=args.rate_mbit,
                                  registry_capped=False,
                                  device_memory_bytes=model_bytes + (96 << 20),
                                  uncapped_hosts=(0,) if peer else (),
                                  controller={"partition_bandwidth_bps": rate_bps,
                                              "partition_link_bps": rate_bps,
                                              "partition_overhead_s": args.overhead_s,
                                              "cold_start_timeout_s": timeout_s,
                                              "deploy_timeout_s": timeout_s},
                                  host={"registry_span_bytes": args.span_mb << 20})


async def publish_k(c: NetCluster, store: LocalStore, model: str, manifest: Manifest,
                    version: str) -> None:
    """Publish one k's model version to the cluster's registry and wait until every host's
    pool is full again: the previous k's workers were stopped, and a stage must not wait for
    a fresh Python + torch process."""
    await c.publish(manifest, store.blob_path(model, version))
    await c.wait("every host's warm worker connected", c._pools_ready, 120.0)


async def seed_peer(c: NetCluster, name: str, model: str, version: str,
                    timeout_s: float) -> None:
    """A one-replica function ``name`` warm on host0: host0's RAM gets the model and its
    replica fills host0's only device, so no GPU of the measured scale-up lands there."""
    await c.deploy(name, model, model_version=version, min_replicas=1, max_replicas=1,
                   keep_alive_s=600, timeout_s=timeout_s)
    await c.wait_warm(name, ["host0"], timeout_s=300)


async def watch_ready(c: NetCluster, fn: str, t0: float, ready: list[float], *, polls: int,
                      stages_seen: list[int] | None = None) -> None:
    """Append to ``ready`` the seconds from ``t0`` until ``fn`` first had somewhere to
    serve (its group linked, or for k = 1 its replica warm); polls ``/v1/status`` at most
    ``polls`` times, 50 ms apart. ``stages_seen`` collects every seen group's stage count."""
    for _ in range(polls):
        st = await c.status()
        mine = [g for g in st["groups"] if g["function"] == fn]
        if stages_seen is not None:
            stages_seen.extend(len(g.get("stages", ())) for g in mine)
        if any(g["phase"] == "serving" for g in mine) or \
                any(r["function"] == fn and r["phase"] == "warm" for r in st["replicas"]):
            ready.append(time.monotonic() - t0)
            return
        await asyncio.sleep(0.05)


async def wait_whole(c: NetCluster, fn: str, k: int, timeout_s: float) -> None:
    """Until ``fn``'s group dissolved into ``k`` warm whole replicas."""

    async def complete() -> tuple[bool, Any]:
        st = await c.status()
        mine = [r["phase"] for r in st["replicas"] if r["function"] == fn]
        groups = [g for g in st["groups"] if g["function"] == fn]
        return not groups and len(mine) == k and all(p == "warm" for p in mine), (mine, groups)

    await c.wait(f"{fn}: every stage whole", complete, timeout_s, interval_s=0.1)


async def remove(c: NetCluster, fn: str, names: tuple[str, ...]) -> None:
    """Delete the functions ``names`` (``fn``'s run) and wait until no replica is left."""
    assert c.session is not None
    for name in names:
        async with c.session.delete(f"{c.url}/v1/functions/{name}") as r:
            assert r.status in (200, 204), await r.text()

    async def gone() -> tuple[bool, Any]:
        st = await c.status()
        return not st["replicas"], None

    await c.wait(f"{fn}: replicas stopped", gone, 60.0)


def published_line(model: str, version: str, preset: str, manifest: Manifest,
                   since: float) -> str:
    """The progress line printed after one k's model version is published."""
    return (f"  published {model}@{version} ({preset}): {manifest.blob_size / 1e6:.1f} MB, "
            f"{len(manifest.layers)} layers ({time.monotonic() - since:.1f}s)")
