"""Kill -9 soak: start a resumable command, kill it at random moments, start it again, and let
it finish; the caller compares the result with an uninterrupted run."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time


def kill_soak(args: list[str], kills: int, window: tuple[float, float], seed: int = 0,
              env: dict | None = None, progress=None, first_when=None) -> list:
    """Run `python -m edgespec ARGS` `kills` times, each killed with SIGKILL after a random delay
    in `window` seconds (a run that finishes first is not counted), then once to the end; returns
    `progress()` (say, the last saved step) after each real kill. `first_when`: the first run is
    killed as soon as this returns true instead (so at least one kill lands mid-way)."""
    rng = random.Random(seed)
    cmd = [sys.executable, "-m", "edgespec", *args]
    env = dict(os.environ, **(env or {}))
    killed = []
    for _ in range(kills):
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        if first_when is not None:
            while p.poll() is None and not first_when():
                time.sleep(0.005)
            first_when = None
            timeout = 0.0
        else:
            timeout = rng.uniform(*window)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            p.wait()
            killed.append(progress() if progress else None)
        time.sleep(0.05)
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return killed
