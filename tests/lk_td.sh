# Sourced by the tests/test_*.sh scripts: where the test data lives (as
# tests/lk_test.h does for the C tests).
#   RD  the repository's own small set (testdata/: the stories260K models and
#       their llama.cpp references), always there
#   TD  the larger shared set: LK_TESTDATA, default ../shared/testdata
# td_need NAME REL...: true when every REL is under TD; otherwise prints
# "SKIP NAME: needs TD/REL ..." (tests/run.sh counts and lists it) and is false.
RD=testdata
TD=${LK_TESTDATA:-../shared/testdata}
td_need() {
    local name=$1 r; shift
    for r in "$@"; do
        if [ ! -e "$TD/$r" ]; then echo "SKIP $name: needs $TD/$r (not found; set LK_TESTDATA)"; return 1; fi
    done
}
