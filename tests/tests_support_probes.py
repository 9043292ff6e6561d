"""Shared by the benchmark probes' tests: a probe's sm_90 build report."""
import json
import os
import subprocess
import sys


def sm90_builds_of(script: str, names: list[str], timeout: float = 1200.0) -> dict:
    """The sm_90 build report of a benchmark probe's formulations: runs ``script --sm90-json NAMES`` in a fresh
    process with the interpreter off (Triton's compiler and ptxas run on the CPU) and returns the JSON it prints
    last, one entry per name (the probes' ``sm90_builds``)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, script, "--sm90-json", ",".join(names)], env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
