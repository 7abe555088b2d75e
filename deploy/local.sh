#!/usr/bin/env bash
# Starts a local Baton cluster (router + prefill + decode workers, one process each).
# Usage: deploy/local.sh [--model tiny|DIR] [--prefill N] [--decode M] [--port PORT] [--config FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
make venv >/dev/null
exec .venv/bin/baton serve "$@"
