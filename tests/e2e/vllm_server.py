"""The e2e tests' name for the vLLM-on-CPU launcher, which lives in bench/vllm_server.py (the fidelity
benchmark starts servers the same way, and bench code does not import from tests/)."""

from bench.vllm_server import *  # noqa: F403  (re-export: the tests import these names from here)
