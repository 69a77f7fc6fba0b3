# Sourced first by every tests/test_*.sh (`. "$(dirname "$0")/lib.sh"`;
# tests run from the repository root, tests/run.sh sets LOCKSTEP): what
# tests/lk_test.h is to the C tests. Each check prints one line that
# tests/run.sh counts: "PASS name", "FAIL name" (then its evidence,
# indented) or "SKIP name: why".
#
#   L            the program under test: $LOCKSTEP, else build/lockstep
#   RD, TD       the repository's test data and the shared set (lk_td.sh;
#                td_need NAME REL... skips when the shared set lacks one)
#   lk_tmp NAME  T=/tmp/lk_NAME.XXXXXX, a fresh folder; on exit every pid in
#                PIDS is stopped (SIGTERM, then waited for) and T removed.
#                A test with more to undo defines cleanup() itself, calls
#                lk_cleanup from it and traps it.
#   ok NAME / no NAME [LINE...]                   PASS, or FAIL and the evidence
#                                                 (no also sets FAILED=1)
#   expect NAME CODE CMD...  CMD (stdin /dev/null, output in $T/out and
#                            $T/err) exits with CODE
#   has / hasnt NAME FILE REGEX                   a line of FILE matches (or none does)
#   says NAME REGEX          the last expect's stderr matches
#   same NAME FILE1 FILE2    the files are equal
#   pyt NAME EXPR            the JSON in $T/out (as d) makes the Python EXPR true;
#                            $CHK counts d's doctor checks whose fields match
#   ids [FIELD] < JSON lines FIELD's array of each line (default generated_ids),
#                            comma-separated, one line each
#   listen_port LOG [PID]    waits (up to 10 s, or until PID is gone) for a
#                            worker's "listening on ... (port N)" line in LOG;
#                            prints N, or nothing
#   free_port                a TCP port free on 127.0.0.1 now
L=${LOCKSTEP:-build/lockstep}
. "$(dirname "${BASH_SOURCE[0]}")/lk_td.sh"

PIDS=()
lk_cleanup() {
    local p
    for p in ${PIDS[@]+"${PIDS[@]}"}; do kill "$p" 2>/dev/null; done
    for p in ${PIDS[@]+"${PIDS[@]}"}; do wait "$p" 2>/dev/null; done
    if [ -n "${T:-}" ]; then rm -rf "$T"; fi
}
lk_tmp() {
    T=$(mktemp -d "/tmp/lk_$1.XXXXXX")
    trap lk_cleanup EXIT
}

FAILED=0
ok() { echo "PASS $1"; }
no() { echo "FAIL $1"; FAILED=1; shift; for l in "$@"; do echo "  $l"; done; }
expect() {
    local name=$1 code=$2; shift 2
    "$@" </dev/null >"$T/out" 2>"$T/err"; local rc=$?
    if [ "$rc" -eq "$code" ]; then ok "$name"; else no "$name" "exit $rc, want $code" "$(tail -n 5 "$T/err")" "$(tail -n 8 "$T/out")"; fi
}
has() {
    if grep -Eq -- "$3" "$2"; then ok "$1"; else no "$1" "no line matching '$3' in:" "$(head -n 12 "$2")"; fi
}
hasnt() {
    if grep -Eq -- "$3" "$2"; then no "$1" "a line matches '$3':" "$(grep -E -- "$3" "$2" | head -n 3)"; else ok "$1"; fi
}
says() { if grep -Eq -- "$2" "$T/err"; then ok "$1"; else no "$1" "stderr lacks /$2/" "$(tail -n 3 "$T/err")"; fi; }
same() {
    if cmp -s "$2" "$3"; then ok "$1"; else no "$1" "$2 and $3 differ:" "$(head -c 300 "$2")" "---" "$(head -c 300 "$3")"; fi
}
pyt() {
    if [ -s "$T/out" ] && python3 -c "import json,re,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if ($2) else 1)" "$T/out" \
        >/dev/null 2>&1; then ok "$1"; else no "$1" "false: $2" "$(head -c 1500 "$T/out")"; fi
}
# chk(d, check=..., result=..., node=..., detail=REGEX) -> how many of d's checks match
CHK='(lambda d, **k: sum(1 for c in d["checks"] if all((re.search(v, c[f]) if f == "detail" else c[f] == v) for f, v in k.items())))'
ids() { sed -n "s/.*\"${1:-generated_ids}\": *\[\([^]]*\)\].*/\1/p" | tr -d ' '; }

listen_port() {
    local port= _
    for _ in $(seq 100); do
        port=$(sed -n 's/.*listening on .*(port \([0-9]*\)).*/\1/p' "$1" 2>/dev/null | head -n 1)
        [ -n "$port" ] && break
        if [ -n "${2:-}" ] && ! kill -0 "$2" 2>/dev/null; then break; fi
        sleep 0.1
    done
    echo "$port"
}
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
