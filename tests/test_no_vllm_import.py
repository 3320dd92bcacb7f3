"""heads/ and training/ never import vLLM (only plugin/ may).

A fresh interpreter blocks `vllm` (sys.modules["vllm"] = None) and records every attempt to
import it, even one guarded by try/except, then imports each module of treedraft.heads and
treedraft.training that exists. The test fails if any module imports vllm or fails to import.
"""

from __future__ import annotations

import json
import subprocess
import sys

REQUIRED = ["treedraft.heads.common", "treedraft.heads.eagle", "treedraft.heads.medusa"]
OPTIONAL = ["treedraft.heads.tree", "treedraft.heads.sampling", "treedraft.training"]

PROBE = r"""
import builtins, importlib, importlib.util, json, pkgutil, sys

sys.modules["vllm"] = None  # any plain `import vllm` now raises ImportError
attempts, current = [], [None]
real_import = builtins.__import__

def spy(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and (name == "vllm" or name.startswith("vllm.")):
        attempts.append((current[0], name))
    return real_import(name, globals, locals, fromlist, level)

real_import_module = importlib.import_module

def spy_module(name, package=None):
    if name == "vllm" or name.startswith("vllm."):
        attempts.append((current[0], name))
    return real_import_module(name, package)

builtins.__import__, importlib.import_module = spy, spy_module
required, optional = json.loads(sys.argv[1]), json.loads(sys.argv[2])
names = list(required) + [m for m in optional if importlib.util.find_spec(m) is not None]
for pkg in ("treedraft.heads", "treedraft.training"):  # every other submodule present
    if importlib.util.find_spec(pkg) is not None:
        spec_path = importlib.import_module(pkg).__path__
        names += [f"{pkg}.{m.name}" for m in pkgutil.iter_modules(spec_path)]
errors = {}
for name in dict.fromkeys(names):
    current[0] = name
    try:
        importlib.import_module(name)
    except Exception as e:  # report every failing module, not just the first
        errors[name] = f"{type(e).__name__}: {e}"
loaded = sorted(m for m, mod in sys.modules.items()
                if mod is not None and (m == "vllm" or m.startswith("vllm.")))
print(json.dumps({"imported": list(dict.fromkeys(names)), "attempts": attempts,
                  "errors": errors, "loaded": loaded}))
"""


def test_heads_and_training_do_not_import_vllm():
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(REQUIRED), json.dumps(OPTIONAL)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(REQUIRED) <= set(report["imported"])
    assert not report["errors"], f"modules failed to import with vllm blocked: {report['errors']}"
    assert not report["attempts"], f"(module, import) pairs that tried vllm: {report['attempts']}"
    assert not report["loaded"], f"vllm modules loaded: {report['loaded']}"
