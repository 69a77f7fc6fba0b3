/* Link emulation for a --local cluster (--emulate-link, issue 12): the head
 * puts one of diag's relays (src/diag/linkemu.c: a set one-way delay, rate
 * and jitter, in this process's threads) on every mesh link a rule covers,
 * so one machine rehearses a 10 GbE or an RDMA-class cluster, or one slow
 * pair among fast ones.
 *
 * Where the relays sit: in the mesh every rank connects to each lower rank's
 * address from MESH (transport/mesh.c). The head sends each worker r its own
 * copy of MESH in which, for every lower rank s whose link (s, r) is
 * emulated, s's address is replaced by a relay listening on loopback that
 * forwards to s. Those links are the data links: the step message, every
 * all-reduce, the pipeline hand-offs and the candidates go through them.
 * The control connections (LOAD, heartbeats) stay direct: they carry no
 * step. Emulated links must be TCP, so `auto` becomes `tcp` and a transport
 * that carries no TCP (shm, ucx) is refused. */
#include "cluster/proto.h"
#include "diag/diag.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct lk_emu {
    lk_diag_linkemu spec;
    lk_diag_relay **relays;  /* one per emulated pair, started at MESH */
    int n_relays;
};

lk_status lk_emu_open(const char *spec, int n_ranks, bool local, lk_mesh_shm *shm, lk_emu **out, char *err,
                      size_t errlen) {
    *out = NULL;
    if (!spec) return LK_OK;
    if (!local)
        return lk_fail(err, errlen, LK_ERR_ARG, "--emulate-link needs --local N: the relays run in the head's process "
                       "and listen on loopback, where remote workers cannot reach them");
    if (*shm != LK_MESH_SHM_AUTO && *shm != LK_MESH_SHM_OFF)
        return lk_fail(err, errlen, LK_ERR_ARG, "--emulate-link relays TCP links: give --transport tcp (or auto, which it "
                       "turns into tcp), not a transport that bypasses TCP (shm, ucx)");
    lk_emu *e = lk_xcalloc(1, sizeof *e);
    lk_status st = lk_diag_linkemu_parse(spec, n_ranks, &e->spec, err, errlen);
    if (st) {
        free(e);
        return st;
    }
    *shm = LK_MESH_SHM_OFF;
    *out = e;
    return LK_OK;
}

lk_status lk_emu_route(lk_emu *e, const lk_mesh_msg *all, int r, lk_mesh_msg *out, char *err, size_t errlen) {
    *out = *all;
    if (!e) return LK_OK;
    for (int s = 0; s < r; s++) {
        lk_diag_link_rule rule;
        if (!lk_diag_linkemu_pair(&e->spec, s, r, &rule)) continue;
        lk_diag_relay_cfg rc = {.listen = "127.0.0.1:0", .to = all->addrs[s], .delay_us = rule.delay_us,
                                .rate_gbps = rule.rate_gbps, .jitter_us = rule.jitter_us};
        lk_diag_relay *rl = NULL;
        int port = 0;
        char why[LK_ERRLEN];
        lk_status st = lk_diag_relay_start(&rc, &rl, &port, why, sizeof why);
        if (st) return lk_fail(err, errlen, st, "link emulation of ranks %d-%d: %s", s, r, why);
        e->relays = realloc(e->relays, sizeof *e->relays * (size_t)(e->n_relays + 1));
        LK_ASSERT(e->relays);
        e->relays[e->n_relays++] = rl;
        snprintf(out->addrs[s], LK_ADDR_LEN, "127.0.0.1:%d", port);
        char what[96];
        lk_diag_link_rule_describe(&rule, what, sizeof what);
        lk_log(LK_LOG_INFO, "link emulation: ranks %d-%d through 127.0.0.1:%d, %s", s, r, port, what);
    }
    return LK_OK;
}

void lk_emu_close(lk_emu *e) {
    if (!e) return;
    for (int i = 0; i < e->n_relays; i++) lk_diag_relay_stop(e->relays[i]);
    free(e->relays);
    free(e);
}
