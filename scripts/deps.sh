#!/usr/bin/env bash
# Installs the Debian packages lockstep builds and tests with (as root, or via sudo).
set -euo pipefail
pkgs="build-essential clang libsodium-dev libjansson-dev libicu-dev libmicrohttpd-dev iproute2 procps curl"
# the HPC stack (issue 13): UCX for --transport ucx, Open MPI for mpirun launch
pkgs="$pkgs libucx-dev openmpi-bin libopenmpi-dev"
# tests/test_slurm.sh starts a private single-host Slurm; its daemons are
# only installed where asked (CI: LK_DEPS_SLURM=1), not on every machine that
# runs demo.sh (on a systemd host the packages start munge at install)
[ "${LK_DEPS_SLURM:-}" = 1 ] && pkgs="$pkgs slurmctld slurmd slurm-client munge"
missing=""
for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
# Node.js and npm run the server's client tests (the official openai package);
# a machine that has them from elsewhere (nodesource) keeps its own.
command -v node >/dev/null 2>&1 || missing="$missing nodejs"
command -v npm >/dev/null 2>&1 || missing="$missing npm"
[ -z "$missing" ] && exit 0
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends $missing
