#!/usr/bin/env bash
# Builds llama.cpp from source (CPU, Release, GGML_NATIVE=ON) to compare lockstep
# against: llama-server, llama-bench, llama-cli, llama-completion (plus
# llama-tokenize and llama-quantize). Nothing but the Debian and npm registries
# is reached: the source is the squashed llama.cpp snapshot
# de3ff815ea7d559ee917f063901b8986f038abc6 (ggml 0.25.1) that the npm package
# node-llama-cpp@3.22.1 ships as llama/gitRelease.bundle (the same snapshot that
# made shared/testdata/reference/).
#
#   scripts/llamacpp.sh [--dir DIR] [--src-dir SRCDIR] [--jobs N] [--tarball FILE]
#     --dir DIR        the llama.cpp checkout; binaries land in DIR/build/bin
#                      (default /tmp/llama.cpp)
#     --src-dir SRCDIR where the npm package is fetched and unpacked
#                      (default /tmp/llamacpp-src)
#     --jobs N         parallel compile jobs (default 2)
#     --tarball FILE   also write FILE (.tar.gz): the source tree without build/
#                      and .git, to carry to another machine
#
# Idempotent: each step (Debian packages, npm pack, bundle extraction, clone,
# cmake configure, build) is skipped when its result is already there; the build
# itself is incremental. It runs under `nice -n 10`. Takes about 15-25 minutes on
# a 2-core machine the first time.
#
# Options worth knowing: the server's web UI is not embedded
# (LLAMA_USE_PREBUILT_UI=OFF: it would be downloaded at build time, and nothing
# outside the package registries can be reached); tests and examples are not
# built. LLAMA_CURL is passed as asked but this snapshot has dropped it (HTTPS
# goes through OpenSSL).
set -euo pipefail

DIR=/tmp/llama.cpp
SRC=/tmp/llamacpp-src
JOBS=2
TARBALL=""
PKG=node-llama-cpp@3.22.1
COMMIT=de3ff815ea7d559ee917f063901b8986f038abc6
TARGETS="llama-server llama-bench llama-cli llama-completion llama-tokenize llama-quantize"

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
    case "$1" in
        --dir) DIR=$2; shift 2 ;;
        --src-dir) SRC=$2; shift 2 ;;
        --jobs) JOBS=$2; shift 2 ;;
        --tarball) TARBALL=$2; shift 2 ;;
        -h|--help) usage 0 ;;
        *) echo "llamacpp.sh: unknown option $1" >&2; usage 2 >&2 ;;
    esac
done
log() { echo "llamacpp.sh: $*"; }

# 1. Debian build dependencies (npm: nodesource's nodejs carries its own).
missing=""
for p in build-essential cmake git libssl-dev; do
    dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
command -v node >/dev/null 2>&1 || missing="$missing nodejs"
command -v npm >/dev/null 2>&1 || missing="$missing npm"
if [ -n "$missing" ]; then
    log "installing Debian packages:$missing"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    # shellcheck disable=SC2086
    $SUDO apt-get install -y -qq --no-install-recommends $missing
fi

# 2. The npm package and the git bundle inside it.
mkdir -p "$SRC"
BUNDLE="$SRC/package/llama/gitRelease.bundle"
if [ ! -s "$BUNDLE" ]; then
    TGZ=$(ls "$SRC"/node-llama-cpp-3.22.1.tgz 2>/dev/null || true)
    if [ -z "$TGZ" ]; then
        log "fetching $PKG from npm"
        (cd "$SRC" && npm pack --silent "$PKG" >/dev/null)
        TGZ="$SRC/node-llama-cpp-3.22.1.tgz"
    fi
    log "extracting llama/gitRelease.bundle"
    tar -xzf "$TGZ" -C "$SRC" package/llama/gitRelease.bundle
fi

# 3. Clone the bundle and check the snapshot.
if [ ! -d "$DIR/.git" ]; then
    log "cloning the bundle into $DIR"
    git -c advice.detachedHead=false clone -q "$BUNDLE" "$DIR"
fi
head=$(git -C "$DIR" rev-parse HEAD)
if [ "$head" != "$COMMIT" ]; then
    echo "llamacpp.sh: $DIR is at $head, expected $COMMIT" >&2
    exit 1
fi

# 4. Configure (once) and build.
B="$DIR/build"
if [ ! -f "$B/CMakeCache.txt" ]; then
    log "configuring $B"
    nice -n 10 cmake -S "$DIR" -B "$B" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF >/dev/null
fi
need=0
for t in $TARGETS; do [ -x "$B/bin/$t" ] || need=1; done
if [ "$need" = 1 ]; then
    log "building ($JOBS jobs, nice 10): $TARGETS"
    start=$(date +%s)
    # shellcheck disable=SC2086
    nice -n 10 cmake --build "$B" --config Release -j "$JOBS" --target $TARGETS
    log "built in $(( $(date +%s) - start )) s"
else
    log "binaries already built (delete $B/bin to rebuild)"
fi

# 5. Optional source tarball (no build/, no .git).
if [ -n "$TARBALL" ]; then
    if [ -s "$TARBALL" ]; then
        log "tarball already there: $TARBALL"
    else
        tar -czf "$TARBALL" -C "$(dirname "$DIR")" --exclude="$(basename "$DIR")/build" \
            --exclude="$(basename "$DIR")/.git" "$(basename "$DIR")"
        log "wrote $TARBALL ($(du -h "$TARBALL" | cut -f1))"
    fi
fi

"$B/bin/llama-server" --version 2>&1 | grep -m1 '^version' || true
for t in $TARGETS; do echo "$B/bin/$t"; done
