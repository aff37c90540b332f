"""Ray Serve side of the peer benchmark; runs in the Ray venv (bench/peers/envs.py), never in
the project's. It starts a local Ray cluster and Serve's HTTP proxy on 127.0.0.1, then obeys
one JSON command per stdin line and answers one JSON line on stdout (after ``@@ ``):

- ``{"cmd": "deploy", "app": NAME, "model": "noop|mlp|big|bert", "setting": S, "path": P}``
  deploys application NAME at route ``/NAME``; ``setting`` picks the deployment options
  (:data:`SETTINGS`); returns once Serve reports it running;
- ``{"cmd": "replicas", "app": NAME}``: how many of its replicas are running;
- ``{"cmd": "delete", "app": NAME}``; ``{"cmd": "shutdown"}``.

Every reply carries ``ok``; a failed command answers ``{"ok": false, "error": ...}``.
Requests and replies use Flashpoint's JSON tensor form (``{"inputs": {"x": {"data", "shape",
"datatype"}}}``), and each reply names the replica that answered it.

    python ray_app.py --port 8000
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np
from ray import serve
from ray_settings import BATCH, SETTINGS
from starlette.requests import Request

REPLY = "@@ "  # prefixes reply lines: Ray may print its own lines on stdout


def _replica() -> str:
    ctx = serve.get_replica_context()
    rid = getattr(ctx, "replica_id", None)
    return str(getattr(rid, "unique_id", rid) if rid is not None else ctx.replica_tag)


def _tensor(body: dict[str, Any]) -> np.ndarray:
    x = body["inputs"]["x"]
    return np.asarray(x["data"], dtype=np.float32).reshape(x["shape"])


def _reply(y: np.ndarray) -> dict[str, Any]:
    return {"outputs": {"y": {"data": y.reshape(-1).tolist(), "shape": list(y.shape),
                              "datatype": "FP32"}}, "replica": _replica()}


def _load(path: str) -> Any:
    import torch

    torch.set_num_threads(1)  # as Flashpoint's CPU workers (torch_threads = 1)
    return torch.jit.load(path, map_location="cpu").eval()


def _run(module: Any, x: np.ndarray) -> np.ndarray:
    import torch

    with torch.inference_mode():
        return module(torch.from_numpy(x)).numpy()


@serve.deployment
class Noop:
    async def __call__(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        return {"outputs": {"y": body["inputs"]["x"]}, "replica": _replica()}


@serve.deployment
class Model:
    def __init__(self, path: str) -> None:
        self.module = _load(path)

    async def __call__(self, request: Request) -> dict[str, Any]:
        return _reply(_run(self.module, _tensor(await request.json())))


@serve.deployment
class BatchedModel:
    def __init__(self, path: str) -> None:
        self.module = _load(path)

    @serve.batch(**BATCH)
    async def infer(self, xs: list[np.ndarray]) -> list[np.ndarray]:
        sizes = [len(x) for x in xs]
        out = _run(self.module, np.concatenate(xs))
        return list(np.split(out, np.cumsum(sizes)[:-1]))

    async def __call__(self, request: Request) -> dict[str, Any]:
        return _reply(await self.infer(_tensor(await request.json())))


@serve.deployment
class Bert:
    def __init__(self, path: str) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        torch.set_num_threads(1)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path).eval()

    async def __call__(self, request: Request) -> dict[str, Any]:
        import torch

        text = (await request.json())["inputs"]["text"]
        enc = self.tokenizer(text, return_tensors="pt", padding=True, truncation=True)
        with torch.inference_mode():
            logits = self.model(**enc).logits.numpy()
        return {"outputs": {"logits": {"data": logits.reshape(-1).tolist(),
                                       "shape": list(logits.shape), "datatype": "FP32"}},
                "replica": _replica()}


def deploy(app: str, model: str, setting: str, path: str) -> None:
    opts = SETTINGS[setting]
    if model == "noop":
        bound = Noop.options(**opts).bind()
    elif model == "bert":
        bound = Bert.options(**opts).bind(path)
    else:
        cls = BatchedModel if setting == "tuned" and model == "mlp" else Model
        bound = cls.options(**opts).bind(path)
    # With zero initial replicas serve.run returns once the application is deployed.
    serve.run(bound, name=app, route_prefix=f"/{app}", blocking=False)


def running_replicas(app: str) -> int:
    status = serve.status().applications.get(app)
    if status is None:
        return 0
    total = 0
    for dep in status.deployments.values():
        total += int(dep.replica_states.get("RUNNING", 0))
    return total


def wait_running(app: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications.get(app)
        if status is not None and str(status.status).endswith("RUNNING"):
            return
        time.sleep(0.1)
    raise TimeoutError(f"application {app} not RUNNING within {timeout_s}s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--num-cpus", type=int, default=8)
    args = ap.parse_args()
    import ray

    ray.init(num_cpus=args.num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=512 << 20, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    print(REPLY + json.dumps({"ok": True, "ready": True, "ray": ray.__version__}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "deploy":
                deploy(cmd["app"], cmd["model"], cmd["setting"], cmd.get("path", ""))
                wait_running(cmd["app"], float(cmd.get("timeout_s", 300)))
                reply: dict[str, Any] = {"ok": True}
            elif cmd["cmd"] == "replicas":
                reply = {"ok": True, "replicas": running_replicas(cmd["app"])}
            elif cmd["cmd"] == "delete":
                serve.delete(cmd["app"])
                reply = {"ok": True}
            elif cmd["cmd"] == "shutdown":
                serve.shutdown()
                ray.shutdown()
                print(REPLY + json.dumps({"ok": True}), flush=True)
                return
            else:
                reply = {"ok": False, "error": f"unknown command {cmd['cmd']!r}"}
        except Exception as e:  # answered to the driver, which fails the run loudly
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print(REPLY + json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
