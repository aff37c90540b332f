"""A stand-in for ``nvidia-cuda-mps-control`` (tests copy it onto PATH under that name).

It obeys what Flashpoint relies on: ``-d`` daemonises and returns 0, the daemon writes
``nvidia-cuda-mps-control.pid`` and ``control`` into ``$CUDA_MPS_PIPE_DIRECTORY`` and logs to
``$CUDA_MPS_LOG_DIRECTORY/control.log``; a second ``-d`` on the same pipe directory fails;
commands on stdin (``quit``, ``get_default_active_thread_percentage``, ``get_server_list``)
reach the daemon of that pipe directory and fail when none runs. The daemon lives at most
``FAKE_MPS_LIFETIME_S`` seconds (bounded, in case a test forgets it); with
``FAKE_MPS_IGNORE_QUIT=1`` it ignores ``quit`` so the kill-by-PID path can be tested.
Standard library only.
"""

import os
import subprocess
import sys
import time

PIPE = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
LOG = os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps")
PIDF = os.path.join(PIPE, "nvidia-cuda-mps-control.pid")
QUIT = os.path.join(PIPE, "quit-requested")


def log(msg):
    with open(os.path.join(LOG, "control.log"), "a") as f:
        f.write(f"[{time.time():.3f}] {msg}\n")


def alive():
    try:
        pid = int(open(PIDF).read().strip())
        os.kill(pid, 0)
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[-1].split()[0]
        return state != "Z"
    except (OSError, ValueError):
        return False


def serve():
    tmp = PIDF + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.rename(tmp, PIDF)
    open(os.path.join(PIPE, "control"), "w").close()
    log(f"Startup pid {os.getpid()} devices={os.environ.get('CUDA_VISIBLE_DEVICES', '')}")
    end = time.time() + float(os.environ.get("FAKE_MPS_LIFETIME_S", "60"))
    ignore_quit = os.environ.get("FAKE_MPS_IGNORE_QUIT") == "1"
    while time.time() < end and (ignore_quit or not os.path.exists(QUIT)):
        time.sleep(0.02)
    log("Exit")
    for p in (PIDF, QUIT, os.path.join(PIPE, "control")):
        try:
            os.remove(p)
        except OSError:
            pass


def main():
    args = sys.argv[1:]
    if args == ["-d"]:
        if alive():
            print("An instance of this daemon is already running", file=sys.stderr)
            return 1
        os.makedirs(PIPE, exist_ok=True)
        os.makedirs(LOG, exist_ok=True)
        subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve"],
                         start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return 0
    if args == ["--serve"]:
        serve()
        return 0
    if args:
        print(f"unknown option {args}", file=sys.stderr)
        return 2
    if not alive():
        print("Cannot find MPS control daemon process", file=sys.stderr)
        return 1
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            open(QUIT, "w").close()
            log("quit")
        elif cmd == "get_default_active_thread_percentage":
            print("100.0")
        elif cmd == "get_server_list":
            pass  # no clients, so no servers
        elif cmd:
            print(f"unknown command {cmd}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
