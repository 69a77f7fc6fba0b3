#!/usr/bin/env bash
# Launch under mpirun (issue 13): `mpirun -np N lockstep run ...` writes
# exactly what one process writes, for -np 2 (tp 2), -np 3 (tp 3 and pp 3),
# -np 4 (tp 2 x pp 2), -np 2 over --transport ucx (when built with UCX) and a
# batch of prompts; only rank 0 writes standard output (--json is one
# object); flags that name another cluster are refused on every rank; a
# killed worker is named and the job ends within seconds (no hang in
# MPI_Finalize); serve answers a completion with the one-process text.
# --transport mpi (data links as MPI messages): refused outside mpirun;
# stories260K under -np 2 (tp), -np 3 (tp 3, pp 3), -np 4 (tp 2 x pp 2) and
# a synthetic model under -np 2 and -np 4 (tp 2 x pp 2) equal one process;
# a batch; every link reports MPI; netbench runs over it; a killed worker is
# named and the job ends within seconds (no hang in MPI_Finalize), and a
# frozen one too; serve over it.
# SKIPs when mpirun is missing or the build has no MPI. Run from the
# repository root by tests/run.sh with LOCKSTEP set.
set -u
. "$(dirname "$0")/lib.sh"
lk_tmp mpi
MP=
cleanup() {
    [ -n "$MP" ] && kill "$MP" 2>/dev/null
    wait 2>/dev/null
    lk_cleanup
}
trap cleanup EXIT

M=$RD/models/stories260K.gguf

if ! command -v mpirun >/dev/null 2>&1; then
    echo "SKIP mpi: mpirun not found (openmpi-bin, scripts/deps.sh)"
    exit 0
fi
# As if started by Open MPI as rank 0 of 2: a build without MPI says so; one
# with MPI refuses --local before starting anything.
OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=2 "$L" run -m "$M" -p hi --local 2 >"$T/out" 2>"$T/err"
rc=$?
if grep -q 'built without MPI' "$T/err"; then
    if [ "$rc" -eq 2 ] && grep -q 'started by mpirun (Open MPI) as 2 ranks, but lockstep was built without MPI (install libopenmpi-dev and rebuild)' "$T/err"
    then ok mpi_not_built_error; else no mpi_not_built_error "exit $rc" "$(cat "$T/err")"; fi
    echo "SKIP mpi: lockstep was built without MPI (install libopenmpi-dev and rebuild)"
    exit 0
fi
if [ "$rc" -eq 2 ] && grep -q 'the job.s ranks are the cluster, so --workers, --local and --key-file do not apply' "$T/err"
then ok mpi_refuses_local; else no mpi_refuses_local "exit $rc" "$(cat "$T/err")"; fi

# Open MPI as root needs --allow-run-as-root; 4 ranks on 2 cores need --oversubscribe
MPIRUN="mpirun --allow-run-as-root --oversubscribe -x LSAN_OPTIONS -x ASAN_OPTIONS"
# Under the ASan build: Open MPI's own allocations from MPI_Init are never
# freed (tests/lsan_mpi.supp says which libraries, and why); their stacks
# only reach those libraries with the slow unwinder.
export LSAN_OPTIONS="${LSAN_OPTIONS:+$LSAN_OPTIONS:}suppressions=$PWD/tests/lsan_mpi.supp:print_suppressions=0"
export ASAN_OPTIONS="${ASAN_OPTIONS:-}"
case "$L" in */asan/*) ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}fast_unwind_on_malloc=0" ;; esac
export OMPI_MCA_btl_base_warn_component_unused=0
"$L" run -m "$M" -p "Once upon a time" -n 24 --temp 0 >"$T/one.txt" 2>"$T/one.err"
layouts=("2" "3" "3 --pp 3" "4 --tp 2 --pp 2")
grep -q 'built without UCX' <("$L" run -m "$M" -p hi -n 1 --transport ucx 2>&1) || layouts+=("2 --transport ucx")
for lay in "${layouts[@]}"; do
    np=${lay%% *}
    rest=${lay#"$np"}
    name=mpi_np$(echo "$lay" | tr -dc 'a-z0-9')
    # shellcheck disable=SC2086
    if timeout 60 $MPIRUN -np "$np" "$L" run -m "$M" -p "Once upon a time" -n 24 --temp 0 $rest >"$T/many.txt" 2>"$T/many.err" &&
       cmp -s "$T/one.txt" "$T/many.txt"; then ok "$name"
    else no "$name" "$(head -c 200 "$T/many.txt")" "$(grep -v info "$T/many.err" | tail -n 4)"; fi
done
has mpi_head_says_so "$T/many.err" 'started by mpirun \(Open MPI\): rank 0 of [0-9] is the head; workers 127\.0\.0\.1:[0-9]+'

# a batch, --json: one object per prompt, from rank 0 alone
printf 'Once upon a time\nThe little dog\nLily wanted to\n' >"$T/prompts.txt"
"$L" run -m "$M" --prompts-file "$T/prompts.txt" -n 12 --temp 0 --json 2>/dev/null | ids >"$T/oneb.txt"
timeout 60 $MPIRUN -np 2 "$L" run -m "$M" --prompts-file "$T/prompts.txt" -n 12 --temp 0 --json >"$T/manyb.json" 2>"$T/many.err"
ids <"$T/manyb.json" >"$T/manyb.txt"
if [ "$(wc -l <"$T/oneb.txt")" -eq 3 ] && cmp -s "$T/oneb.txt" "$T/manyb.txt" && [ "$(wc -l <"$T/manyb.json")" -eq 3 ]
then ok mpi_np2_batch_json_rank0_only; else no mpi_np2_batch_json_rank0_only "$(head -c 300 "$T/manyb.json")"; fi

# --transport mpi: outside a job it is refused, naming why
"$L" run -m "$M" -p hi -n 1 --transport mpi >"$T/out" 2>"$T/err"
rc=$?
if [ "$rc" -eq 2 ] && grep -q 'transport mpi needs a job started by mpirun or srun' "$T/err"; then ok mpi_transport_outside_job
else no mpi_transport_outside_job "exit $rc" "$(cat "$T/err")"; fi
# the data over MPI: every layout and a synthetic model give the one-process tokens
mruns=("$M|2" "$M|3" "$M|3 --pp 3" "$M|4 --tp 2 --pp 2")
S=$TD/synth/synth-llama-q8_0.gguf
if td_need mpi_transport_synth synth/synth-llama-q8_0.gguf; then
    "$L" run -m "$S" -p "Once upon a time" -n 24 --temp 0 >"$T/one_synth.txt" 2>"$T/one.err"
    mruns+=("$S|2" "$S|4 --tp 2 --pp 2")
fi
for mr in "${mruns[@]}"; do
    model=${mr%%|*}
    lay=${mr#*|}
    np=${lay%% *}
    rest=${lay#"$np"}
    ref=$T/one.txt
    [ "$model" = "$S" ] && ref=$T/one_synth.txt
    name=mpi_transport_$(basename "$model" .gguf | tr -dc 'a-z0-9')_np$(echo "$lay" | tr -dc 'a-z0-9')
    # shellcheck disable=SC2086
    if timeout 60 $MPIRUN -np "$np" "$L" run -m "$model" -p "Once upon a time" -n 24 --temp 0 --transport mpi $rest \
        >"$T/many.txt" 2>"$T/many.err" && cmp -s "$ref" "$T/many.txt"; then ok "$name"
    else no "$name" "$(head -c 200 "$T/many.txt")" "$(grep -v info "$T/many.err" | tail -n 4)"; fi
done
# the last run (4 ranks): every rank reports an MPI link to each of its peers (12 lines)
if [ "$(grep -Ec '^lockstep: mpi link to rank [0-3] \(.*\): MPI rank [0-3] -> [0-3], ' "$T/many.err")" -eq 12 ]
then ok mpi_transport_links_reported; else no mpi_transport_links_reported "$(grep 'link to' "$T/many.err" | head -n 4)"; fi
timeout 60 $MPIRUN -np 3 "$L" run -m "$M" --prompts-file "$T/prompts.txt" -n 12 --temp 0 --json --transport mpi \
    >"$T/manyb.json" 2>"$T/many.err"
ids <"$T/manyb.json" >"$T/manyb.txt"
if [ "$(wc -l <"$T/oneb.txt")" -eq 3 ] && cmp -s "$T/oneb.txt" "$T/manyb.txt"
then ok mpi_transport_np3_batch; else no mpi_transport_np3_batch "$(head -c 300 "$T/manyb.json")" "$(grep -v info "$T/many.err" | tail -n 3)"; fi
timeout 60 $MPIRUN -np 2 "$L" netbench --transport mpi --sizes 64,16K --iters 50 >"$T/nb.txt" 2>"$T/nb.err"
if grep -q 'data over mpi' "$T/nb.txt" && grep -Eq '^16 KiB +[0-9.]+ ' "$T/nb.txt"; then ok mpi_transport_netbench
else no mpi_transport_netbench "$(cat "$T/nb.txt")" "$(grep -v info "$T/nb.err" | tail -n 3)"; fi

# a worker killed mid-run: named by the head, the job over within seconds;
# over MPI also a frozen one (SIGSTOP: the head must not wait for it in
# MPI_Finalize)
for case in "KILL|" "KILL|--transport mpi" "STOP|--transport mpi"; do
    sig=${case%%|*}
    tflag=${case#*|}
    tn=mpi_dead_worker${tflag:+_over_mpi}
    want='lost worker rank 1'
    [ "$sig" = STOP ] && tn=mpi_frozen_worker_over_mpi want='worker rank 1 .* stopped answering heartbeats'
    # shellcheck disable=SC2086
    $MPIRUN -np 2 "$L" run -m "$M" -p "Once upon a time" -n 1000000 --ctx 16384 --ignore-eos --temp 0 $tflag >/dev/null 2>"$T/dead.err" &
    MP=$!
    for _ in $(seq 100); do grep -q 'cluster: 2 ranks' "$T/dead.err" && break; sleep 0.05; done
    sleep 0.3
    wk=
    for c in $(pgrep -P "$MP"); do
        tr '\0' '\n' <"/proc/$c/environ" 2>/dev/null | grep -qx OMPI_COMM_WORLD_RANK=1 && wk=$c
    done
    t0=$(date +%s%N)
    [ -n "$wk" ] && kill -"$sig" "$wk"
    for _ in $(seq 200); do kill -0 "$MP" 2>/dev/null || break; sleep 0.05; done
    ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    if kill -0 "$MP" 2>/dev/null; then no "$tn" "mpirun still running 10 s after the kill"; kill "$MP"; kill -CONT "$wk"
    elif [ -z "$wk" ]; then no "$tn" "no rank 1 process under mpirun" "$(tail -n 3 "$T/dead.err")"
    elif grep -q "$want" "$T/dead.err" && [ "$ms" -lt 5000 ]; then ok "$tn"
    else no "$tn" "$ms ms" "$(grep -v info "$T/dead.err" | tail -n 4)"; fi
    wait "$MP" 2>/dev/null
    MP=
done

# serve under mpirun: the head answers; its text is the one-process text
for tflag in "" "--transport mpi"; do
    sfx=${tflag:+_over_mpi}
    port=$(free_port)
    # shellcheck disable=SC2086
    $MPIRUN -np 2 "$L" serve -m "$M" --port "$port" $tflag >"$T/serve.out" 2>"$T/serve.err" &
    MP=$!
    for _ in $(seq 200); do grep -q 'ready at' "$T/serve.err" "$T/serve.out" 2>/dev/null && break; sleep 0.05; done
    curl -s -m 20 "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
        -d '{"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}' >"$T/resp.json"
    want=$(head -c 40 "$T/one.txt")
    if grep -qF "\"text\":\"$want" "$T/resp.json" || grep -qF "\"text\": \"$want" "$T/resp.json"; then ok "mpi_serve_np2$sfx"
    else no "mpi_serve_np2$sfx" "$(head -c 300 "$T/resp.json")" "$(grep -v info "$T/serve.err" | tail -n 3)"; fi
    kill "$MP" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$MP" 2>/dev/null || break; sleep 0.05; done
    if kill -0 "$MP" 2>/dev/null; then no "mpi_serve_stops$sfx" "still running 5 s after SIGTERM"; else ok "mpi_serve_stops$sfx"; fi
    wait "$MP" 2>/dev/null
    MP=
done
