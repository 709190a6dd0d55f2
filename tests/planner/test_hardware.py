"""Reading the TF32 setting (planner/hardware.py: tf32_enabled), which picks the fp32 or TF32 peak of MFU.

torch 2.14 has two APIs for it: the legacy ``allow_tf32`` / ``set_float32_matmul_precision`` and
the per-backend ``torch.backends.cuda.matmul.fp32_precision``. Its legacy getter raises once only
the new API was used, and reports the legacy value after both were. The flags are process-global
and cannot be reset to "never set", so each case runs in its own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CASES = {
    "": False,  # the default: IEEE fp32 matmuls
    "torch.backends.cuda.matmul.allow_tf32 = True": True,
    "torch.set_float32_matmul_precision('high')": True,
    "torch.backends.cuda.matmul.fp32_precision = 'tf32'": True,  # new API only: the legacy getter raises
    "torch.backends.fp32_precision = 'tf32'": True,  # the generic new setting, inherited by cuda.matmul
    "torch.backends.cuda.matmul.fp32_precision = 'ieee'": False,
    # legacy on, then new off: the legacy getter still says "high"; cuBLAS follows the new setting
    "torch.backends.cuda.matmul.allow_tf32 = True; torch.backends.cuda.matmul.fp32_precision = 'ieee'": False,
}

# One fresh interpreter; each case in a forked child of it (the flags are process-global).
CHILD = """
import json, os, sys, torch
from dit_lightning.planner.hardware import tf32_enabled
results = {}
for setting in json.loads(sys.argv[1]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        exec(setting)
        try:
            legacy = torch.get_float32_matmul_precision()
        except RuntimeError:
            legacy = "raises"
        os.write(write, json.dumps({"tf32": tf32_enabled(), "legacy": legacy}).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        results[setting] = json.loads(f.read())
    os.waitpid(pid, 0)
print(json.dumps(results))
"""


def test_tf32_enabled_follows_every_api_of_torch():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(list(CASES))], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for setting, expected in CASES.items():
        assert results[setting]["tf32"] is expected, (setting, results[setting])
    # the case that breaks the legacy getter (and Lightning's check, which calls it) is covered
    assert results["torch.backends.cuda.matmul.fp32_precision = 'tf32'"]["legacy"] == "raises"
