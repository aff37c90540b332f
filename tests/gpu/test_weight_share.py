"""The weights slot's ready-flag protocol on CPU (shared-memory files stand in for CUDA IPC
handles), and the real CUDA IPC path on a GPU (marked ``gpu``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flashpoint.errors import DeadlineExceeded, IntegrityError
from flashpoint.gpu.weight_share import (
    Role,
    SlotState,
    WeightSlot,
    export_cpu,
    import_cpu,
    slot_key,
)

PROC = Path(__file__).with_name("weight_share_proc.py")
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


def _spawn(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, str(PROC), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_readers_wait_for_the_flag_and_never_see_half_written_weights(tmp_path):
    key = slot_key("bert@1", "GPU-x")
    n = 1 << 20
    writer = _spawn("writer", str(tmp_path), key, str(n), "8", "0.05", "2")
    procs = [writer]
    try:
        # the writer claims first; readers started while it writes (~0.4 s)
        slot = WeightSlot(tmp_path, key)
        for _ in range(500):
            if slot.header().state is SlotState.WRITING:
                break
            time.sleep(0.01)
        assert slot.header().state is SlotState.WRITING
        procs += [_spawn("reader", str(tmp_path), key) for _ in range(2)]
        outs = [p.communicate(timeout=30) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    w, *readers = [json.loads(o) for o, _ in outs]
    assert w == {"role": "exporter", "generation": 1}
    for r in readers:
        assert r["role"] == "READER" and r["generation"] == 1
        assert r["seen"][0] == SlotState.WRITING  # it really waited through the write
        assert r["complete"] is True  # and what it mapped was whole


def test_dead_writer_is_taken_over_and_its_late_publish_refused(tmp_path):
    alive = {111: True}
    a = WeightSlot(tmp_path, "k", pid=111, alive=lambda p: alive.get(p, False))
    b = WeightSlot(tmp_path, "k", pid=222, alive=lambda p: alive.get(p, False), poll_s=0.01)
    assert a.claim_or_wait(1.0) is Role.EXPORTER
    with pytest.raises(DeadlineExceeded):  # a live writer: b waits, bounded
        b.claim_or_wait(0.1)
    alive[111] = False  # the writer died mid-write
    assert b.claim_or_wait(1.0) is Role.EXPORTER and b.generation == 2
    with pytest.raises(IntegrityError):  # a zombie's publish cannot clobber generation 2
        a.publish(b"stale")
    t = {"w": torch.arange(16, dtype=torch.float32)}
    b.publish(export_cpu(t, tmp_path))
    reader = WeightSlot(tmp_path, "k", pid=333)
    assert reader.claim_or_wait(1.0) is Role.READER
    assert torch.equal(import_cpu(reader.read())["w"], t["w"])


def test_torn_payload_and_abandon(tmp_path):
    a = WeightSlot(tmp_path, "k", pid=os.getpid())
    assert a.claim_or_wait(1.0) is Role.EXPORTER
    a.abandon()  # its load failed: the next one exports
    assert a.header().state is SlotState.EMPTY
    assert a.claim_or_wait(1.0) is Role.EXPORTER
    a.publish(b"payload-bytes")
    a.payload_path.write_bytes(b"payload-bytez")  # not what the header vouches for
    with pytest.raises(IntegrityError):
        WeightSlot(tmp_path, "k").read()
    a.hdr_path.write_bytes(b"junk")  # a foreign header reads as EMPTY: start over
    assert WeightSlot(tmp_path, "k").header().state is SlotState.EMPTY


GPU_SCRIPT = r'''
import json, sys, torch
from flashpoint.gpu.weight_share import WeightSlot, share_module_weights
d, key, out = sys.argv[1:4]
torch.manual_seed(0)
module = torch.nn.Linear(256, 256)
def load():
    m = torch.nn.Linear(256, 256)
    m.load_state_dict(module.state_dict())
    return m.to("cuda:0")
empty = torch.nn.Linear(256, 256, device="meta")
m, role = share_module_weights(empty, WeightSlot(d, key), "cuda:0", 60.0, load)
x = torch.ones(4, 256, device="cuda:0")
before = torch.cuda.memory_allocated()
y = m(x).sum().item()
ptr = m.weight.data_ptr()
print(json.dumps({"role": role.name, "y": y, "ptr": ptr, "alloc": before}), flush=True)
sys.stdin.readline()  # the exporter stays alive until the test is done with the reader
'''


@pytest.mark.gpu
def test_cuda_ipc_weights_shared_between_two_processes(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    script = tmp_path / "share.py"
    script.write_text(GPU_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    key = slot_key("linear@1", "cuda0")
    procs = []
    try:
        for _ in range(2):
            procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path), key, ""],
                                          env=env, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True))
            line = procs[-1].stdout.readline()
            assert line, "process died"
            procs[-1].result = json.loads(line)
        exp, rd = procs[0].result, procs[1].result
        assert (exp["role"], rd["role"]) == ("EXPORTER", "READER")
        assert rd["y"] == pytest.approx(exp["y"], rel=1e-5)  # the same weights
        assert rd["alloc"] < exp["alloc"]  # the reader allocated no weights of its own
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin.close()
                p.kill()
                p.wait()
