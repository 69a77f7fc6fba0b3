/* Launch by a job launcher (issue 13): `mpirun -np 4 lockstep run ...`,
 * `srun -n 4 lockstep serve ...`. Every rank runs the same command line;
 * the launcher's environment says which rank this process is
 * (OMPI_COMM_WORLD_RANK/SIZE, PMI_RANK/PMI_SIZE, or SLURM_PROCID/SLURM_NTASKS
 * inside a job step). Rank 0 becomes the head, the others become workers
 * (lk_worker_serve, one session) with their standard output closed, so that
 * only the head writes it.
 *
 * Bootstrap (built with MPI): MPI_Init, every worker listens on a free port,
 * one MPI_Allgather of (hostname, port), rank 0 draws a fresh cluster key and
 * MPI_Bcast's it, MPI_Finalize — all before the model is touched, so no
 * later failure can leave a rank hanging in MPI_Finalize. The head then runs
 * the command as if given `--workers` (ranks on its own host by 127.0.0.1)
 * and `--key-file` (the key in a memfd: never on disk). The launcher is the
 * trust boundary: whoever can start ranks in the job gets the key.
 * `--tp/--pp` default to the job size as they do for --workers.
 *
 * With --transport mpi (on every rank's command line) MPI stays up instead
 * (MPI_THREAD_SERIALIZED, lk_mpi_adopt): the data links are MPI messages
 * (transport/mpi.c), the control links stay TCP and keep naming dead ranks.
 * lk_launch_end then calls MPI_Finalize after a clean run only, bounded in
 * time; after a failure the rank leaves without it and mpirun ends the job. */
#ifndef LK_LAUNCH_H
#define LK_LAUNCH_H

#include <stdbool.h>

/* Rank and size from the launcher's environment; false when not launched
 * by one (or a job of one rank). */
bool lk_launch_env(int *rank, int *size, const char **by);

/* Called by main before a cluster command (run, chat, serve, bench,
 * netbench) runs.
 * Not under a launcher: returns false and changes nothing. A worker rank:
 * serves, then returns true with its exit status in *rc. The head: returns
 * false with argc and argv extended by --workers and --key-file. A bootstrap
 * failure: true, the message on stderr, *rc 1 (2 for bad flags). */
bool lk_launch_from_env(const char *cmd, int *argc, char ***argv, int *rc);

/* Called by main with the command's exit status (and by a worker rank
 * itself): ends MPI when --transport mpi kept it (lk_mpi_end); no-op
 * otherwise. */
void lk_launch_end(int rc);

#endif
