#include "cli/cli.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void lk_args_usage(const char *cmd, const char *synopsis, const lk_opt *opts) {
    printf("usage: lockstep %s %s\n\noptions:\n", cmd, synopsis);
    for (const lk_opt *o = opts; o && o->name; o++) {
        char left[64];
        snprintf(left, sizeof left, "%s%s%s%s%s", o->alias ? o->alias : "", o->alias ? ", " : "",
                 o->name, o->metavar ? " " : "", o->metavar ? o->metavar : "");
        printf("  %-26s %s\n", left, o->help);
    }
    printf("  %-26s %s\n", "-h, --help", "show this help");
    printf("  %-26s %s\n", "--version", "print the version and exit");
}

void lk_print_version(void) {
    printf("lockstep %s (built %s)\n", LK_VERSION, __DATE__);
}

static const lk_opt *find_opt(const lk_opt *opts, const char *name, size_t len) {
    for (const lk_opt *o = opts; o && o->name; o++) {
        if (strlen(o->name) == len && !strncmp(o->name, name, len)) return o;
        if (o->alias && strlen(o->alias) == len && !strncmp(o->alias, name, len)) return o;
    }
    return NULL;
}

int lk_args_parse(const char *cmd, const char *synopsis, const lk_opt *opts,
                  int argc, char **argv, const char **pos, int max_pos) {
    int npos = 0;
    bool only_pos = false;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!only_pos && (!strcmp(a, "-h") || !strcmp(a, "--help"))) {
            lk_args_usage(cmd, synopsis, opts);
            return LK_ARGS_HELP;
        }
        if (!only_pos && !strcmp(a, "--version")) {
            lk_print_version();
            return LK_ARGS_VERSION;
        }
        if (!only_pos && !strcmp(a, "--")) { only_pos = true; continue; }
        if (only_pos || a[0] != '-' || a[1] == 0 || (a[1] >= '0' && a[1] <= '9')) {
            if (npos >= max_pos) {
                fprintf(stderr, "lockstep %s: unexpected argument '%s' (see 'lockstep %s --help')\n", cmd, a, cmd);
                return LK_ARGS_ERROR;
            }
            pos[npos++] = a;
            continue;
        }
        const char *eq = strchr(a, '=');
        size_t nlen = eq ? (size_t)(eq - a) : strlen(a);
        const lk_opt *o = find_opt(opts, a, nlen);
        if (!o) {
            fprintf(stderr, "lockstep %s: unknown option '%.*s' (see 'lockstep %s --help')\n", cmd, (int)nlen, a, cmd);
            return LK_ARGS_ERROR;
        }
        if (o->kind == LK_OPT_FLAG) {
            if (eq) {
                fprintf(stderr, "lockstep %s: option %s takes no value\n", cmd, o->name);
                return LK_ARGS_ERROR;
            }
            *(bool *)o->dst = true;
            continue;
        }
        const char *val = eq ? eq + 1 : NULL;
        if (!val) {
            if (i + 1 >= argc) {
                fprintf(stderr, "lockstep %s: option %s needs a value (%s)\n", cmd, o->name, o->metavar ? o->metavar : "value");
                return LK_ARGS_ERROR;
            }
            val = argv[++i];
        }
        char *end = NULL;
        errno = 0;
        switch (o->kind) {
        case LK_OPT_STR: *(const char **)o->dst = val; break;
        case LK_OPT_INT: {
            long long v = strtoll(val, &end, 10);
            if (errno || end == val || *end) {
                fprintf(stderr, "lockstep %s: option %s expects an integer, got '%s'\n", cmd, o->name, val);
                return LK_ARGS_ERROR;
            }
            *(int64_t *)o->dst = v;
            break;
        }
        case LK_OPT_F64: {
            double v = strtod(val, &end);
            if (errno || end == val || *end || v != v) {
                fprintf(stderr, "lockstep %s: option %s expects a number, got '%s'\n", cmd, o->name, val);
                return LK_ARGS_ERROR;
            }
            *(double *)o->dst = v;
            break;
        }
        case LK_OPT_FLAG: break;
        }
    }
    return npos;
}

bool lk_parse_units(const char *s, double *num, double *mul, bool *b) {
    char *end;
    errno = 0;
    *num = strtod(s, &end);
    if (end == s || errno) return false;
    *mul = 1;
    switch (*end) {
    case 'k': case 'K': *mul = 1024.0; end++; break;
    case 'm': case 'M': *mul = 1048576.0; end++; break;
    case 'g': case 'G': *mul = 1073741824.0; end++; break;
    case 't': case 'T': *mul = 1099511627776.0; end++; break;
    }
    if (*mul > 1 && *end == 'i') end++; /* "GiB" */
    *b = *end == 'B' || *end == 'b';
    if (*b) end++;
    return *end == 0;
}
