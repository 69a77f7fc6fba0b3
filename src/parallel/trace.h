/* trace — Chrome trace events (chrome://tracing, Perfetto) of what each rank
 * of this host does in every step: the step, its compute stretches and its
 * collectives (all-reduce per layer, gather of candidates, broadcast,
 * barrier, argmax), one process track per rank (pid = mesh rank).
 *
 * Owns a process-wide sink (a singleton, like the log level): `run --trace
 * FILE` turns it on before the cluster starts, so the ranks --local forks
 * inherit it; each process appends its events, one JSON object per line, to
 * FILE.part.<os pid>, and the head merges the parts into FILE (a
 * {"traceEvents": [...]} object) after the cluster closed. Workers of
 * --workers run in other processes started elsewhere: they are not traced.
 * Clocks: CLOCK_MONOTONIC, common to every process of one host, so the
 * tracks line up without any exchange.
 *
 * A step ends where the rank's work on it last reached: its last
 * collective, or the end of lk_step_run / lk_step_collect, which say so
 * (lk_trace_work); so a rank whose step has no collective (one node, or a
 * pipeline stage of one rank) still shows how long its steps took. With
 * steps in flight (pipeline), rank 0 collects an older step inside the
 * newer one's span.
 *
 * Callers: parallel/comm.c (every collective, when on), step/step.c (a
 * mark at the start of each step, its work's ends), cli (start, finish). The per-step cost
 * when on: a few formatted lines into a buffer and one write per step;
 * when off: one branch per collective. One thread per process records
 * (the rank's step thread); a mutex keeps a stray second one safe. */
#ifndef LK_TRACE_H
#define LK_TRACE_H

#include "common/lk_common.h"

extern bool lk_trace_on; /* set by lk_trace_start, never cleared in a forked rank */

/* Turns tracing on for this process and the ranks it forks from now on;
 * removes stale parts of an earlier trace of the same FILE. An unwritable
 * FILE is an error naming it. */
lk_status lk_trace_start(const char *path, char *err, size_t errlen);

/* A step begins on this rank (step number, tokens it carries): closes the
 * previous step's span at the end of its last event. */
void lk_trace_step(int rank, uint64_t no, int n_tokens);

/* The open step's work on this rank reached now: the stretch since its
 * previous event becomes a "compute" span, and the step lasts at least
 * until now. */
void lk_trace_work(int rank);

/* A collective ran from t0 to t1 (lk_time_ns): op "all-reduce", "gather",
 * ...; what as the caller named it; layer -1 when none. The stretch since
 * the step's previous event becomes a "compute" span. */
void lk_trace_comm(int rank, const char *op, const char *what, int layer, size_t bytes, uint64_t t0, uint64_t t1);

/* Head only, after the cluster closed: writes FILE from every part (and
 * removes them); *n_ranks and *n_events (may be NULL) say what it holds. */
lk_status lk_trace_finish(int *n_ranks, int *n_events, char *err, size_t errlen);

#endif
