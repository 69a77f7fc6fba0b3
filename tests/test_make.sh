#!/usr/bin/env bash
# The build's user-facing targets: `make install` puts the program where
# PREFIX and DESTDIR say and it runs from there; the default output is one
# line per file (V=1 for whole commands). Run by tests/run.sh.
set -u
. "$(dirname "$0")/lib.sh"
B=$(dirname "$L")
lk_tmp make
if make -s install B="$B" DESTDIR="$T" PREFIX=/opt/lk >"$T/out" 2>&1 && [ -x "$T/opt/lk/bin/lockstep" ]; then
    ok install
else no install "$(tail -n 3 "$T/out")"; fi
if "$T/opt/lk/bin/lockstep" --help 2>&1 | grep -q 'run one language model'; then ok installed_runs; else no installed_runs; fi
make -s uninstall B="$B" DESTDIR="$T" PREFIX=/opt/lk >/dev/null 2>&1
if [ ! -e "$T/opt/lk/bin/lockstep" ]; then ok uninstall; else no uninstall; fi
# one line per file: a dry run of one object prints the short form, V=1 the command
make -n -B B="$T/b" "$T/b/obj/common/common.o" >"$T/q" 2>&1
make -n -B V=1 B="$T/b" "$T/b/obj/common/common.o" >"$T/v" 2>&1
if grep -q '^echo "  CC      src/common/common.c"' "$T/q" && grep -q -- '-c src/common/common.c' "$T/v"; then ok quiet_build_lines
else no quiet_build_lines "$(cat "$T/q" | head -n 3)"; fi
