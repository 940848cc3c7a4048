#!/usr/bin/env bash
# Install everything the whole test suite needs, on a fresh Linux machine with Python 3.10+:
#   * Debian's chromium (the HTML report is rendered headless in a test);
#   * torch 2.13.0 (CPU build) before anything else, because an unpinned torch pulls a
#     multi-GB CUDA build; then vcluster with its test, torch, jax and mpi extras (mpi:
#     mpi4py and the mpich wheel with its mpiexec, ~15 MB, for `bench collectives --mpi`).
# Idempotent: what is already installed is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v chromium >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=""
        if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
        export DEBIAN_FRONTEND=noninteractive
        $SUDO apt-get update -qq
        $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
    else
        echo "install-test-deps: no chromium and no apt-get; the HTML screenshot test will fail" >&2
    fi
fi

python -m pip install -q 'torch==2.13.0'
python -m pip install -q -e '.[test,torch,jax,mpi]'
