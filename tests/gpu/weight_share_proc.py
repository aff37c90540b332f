"""A process on one weights slot (tests/gpu/test_weight_share.py).

``writer DIR KEY N CHUNKS DELAY_S READERS`` claims the slot, waits until READERS readers
poll it, writes an arange of N float32 in CHUNKS steps (sleeping between them) and only
then publishes; ``reader DIR KEY`` waits for the flag, maps the weights and prints what it
saw (the states it polled, and whether the data was complete)."""

import json
import os
import pickle
import sys
import time

import numpy as np
import torch

from flashpoint.gpu.weight_share import Role, SlotState, WeightSlot, export_cpu, import_cpu


def main() -> int:
    mode, directory, key = sys.argv[1:4]
    slot = WeightSlot(directory, key, poll_s=0.005)
    if mode == "writer":
        n, chunks, delay = int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
        readers = int(sys.argv[7])
        assert slot.claim_or_wait(5.0) is Role.EXPORTER
        # write only once every reader polls the slot (they start slower: torch imports)
        deadline = time.monotonic() + 30
        while len(list(slot.dir.glob("reader-*.started"))) < readers:
            assert time.monotonic() < deadline, "readers never started"
            time.sleep(0.01)
        t = torch.zeros(n, dtype=torch.float32)
        payload_dir = slot.dir
        # export first (the files exist, still zero), then fill them slowly: a reader that
        # mapped before READY would see zeros in the tail
        payload = export_cpu({"w": t}, payload_dir)
        (path,) = pickle.loads(payload).values()
        mm = np.load(path, mmap_mode="r+")
        step = n // chunks
        for i in range(chunks):
            mm[i * step:(i + 1) * step] = np.arange(i * step, (i + 1) * step, dtype=np.float32)
            time.sleep(delay)
        mm.flush()
        slot.publish(payload)
        print(json.dumps({"role": "exporter", "generation": slot.generation}), flush=True)
        return 0
    seen = []
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        seen.append(int(slot.header().state))
        if len(seen) == 1:
            (slot.dir / f"reader-{os.getpid()}.started").touch()
        if seen[-1] == SlotState.READY:
            break
        time.sleep(0.005)
    role = slot.claim_or_wait(10.0)
    w = import_cpu(slot.read())["w"]
    ok = bool(torch.equal(w, torch.arange(w.numel(), dtype=torch.float32)))
    print(json.dumps({"role": role.name, "complete": ok, "seen": sorted(set(seen)),
                      "generation": slot.generation}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
