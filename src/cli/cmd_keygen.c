/* lockstep keygen: prints a fresh cluster key (64 hex digits). Every node of
 * a cluster gets the same file; the handshake proves possession of it
 * without ever sending it. */
#include "cli/cli.h"
#include "cluster/cluster.h"

#include <stdio.h>
#include <string.h>

int lk_cmd_keygen(int argc, char **argv) {
    const lk_opt opts[] = {{0}};
    int np = lk_args_parse("keygen", "> cluster.key", opts, argc, argv, NULL, 0);
    if (np == LK_ARGS_HELP || np == LK_ARGS_VERSION) return 0;
    if (np < 0) return 2;
    char hex[2 * LK_KEY_BYTES + 1];
    lk_key_generate(hex);
    printf("%s\n", hex);
    memset(hex, 0, sizeof hex);
    return fflush(stdout) == 0 ? 0 : 1;
}
