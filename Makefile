# lockstep build. `make` -> build/lockstep; `make test` -> every test, plain and
# under ASan+UBSan, ending with the runner's "N passed, N failed" line.
# Every .c under src/ is part of the build (folders mirror the parts of docs/ARCHITECTURE.md);
# src/cli/ holds the program's entry point, everything else is the library that
# the tests link. SIMD variants are selected per function with target
# attributes and dispatched at run time, so no file needs special flags.
CC      ?= cc
OPT     ?= -O2
CFLAGS  += -std=c11 -D_GNU_SOURCE -g $(OPT) -Wall -Wextra -Wno-unused-parameter -pthread -Isrc
# No multiply-add the source does not write (fmaf, _mm*_fmadd_ps): clang, and
# gcc outside strict ISO mode, fuse a*b+c where the target has FMA, so the
# same scalar code would give other bits on an Arm node or in an AVX2
# function than on the scalar level (docs/ARCHITECTURE.md, "Every level
# gives the same bits").
CFLAGS  += -ffp-contract=off
LDLIBS  += -lmicrohttpd -lsodium -ljansson -licuuc -lm -pthread
SAN     := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
# Optional HPC stack, used when its Debian -dev package is there (issue 13):
# UCX (libucx-dev) for --transport ucx, MPI (libopenmpi-dev) for mpirun launch.
# NO_UCX=1 / NO_MPI=1 build without them.
ifeq ($(NO_UCX),)
UCX_LIBS := $(shell pkg-config --libs ucx 2>/dev/null)
endif
ifneq ($(UCX_LIBS),)
CFLAGS  += -DLK_HAVE_UCX $(shell pkg-config --cflags ucx)
LDLIBS  += $(UCX_LIBS)
endif
ifeq ($(NO_MPI),)
MPI_LIBS := $(shell pkg-config --libs ompi-c 2>/dev/null)
endif
ifneq ($(MPI_LIBS),)
CFLAGS  += -DLK_HAVE_MPI $(shell pkg-config --cflags ompi-c)
LDLIBS  += $(MPI_LIBS)
endif

SRC      := $(shell find src -name '*.c' | sort)
LIB_SRC  := $(filter-out src/cli/%,$(SRC))
CLI_SRC  := $(filter src/cli/%,$(SRC))
TEST_SRC := $(wildcard tests/test_*.c)
HDR      := $(shell find src -name '*.h') $(wildcard tests/*.h)
# B: the build folder (several people building at once each use their own).
B        ?= build
# One line per file; V=1 prints the whole commands.
ifeq ($(V),1)
Q :=
else
Q := @
endif
# make install [PREFIX=/usr/local] [DESTDIR=]: the program into $(DESTDIR)$(PREFIX)/bin.
PREFIX   ?= /usr/local

all: $(B)/lockstep

# Header dependencies: objects and test programs are compiled with -MMD,
# which writes the headers each one includes into a .d file beside it, read
# here, so a header change rebuilds only what includes it (with several
# people building at once, every header edit used to rebuild everything
# everywhere). What has no .d yet (never built, or built before this rule)
# depends on every header, as before.
DEP = -MMD -MP -MT $@ -MF $(basename $@).d
deps = $(foreach o,$(1),$(if $(wildcard $(basename $(o)).d),,$(eval $(o): $(HDR))))
-include $(shell find $(B) -name '*.d' 2>/dev/null)

# --- plain build -------------------------------------------------------------
$(call deps,$(patsubst src/%.c,$(B)/obj/%.o,$(SRC)))
$(B)/obj/%.o: src/%.c
	@mkdir -p $(dir $@)
	@$(if $(Q),echo "  CC      $<")
	$(Q)$(CC) $(CFLAGS) $(DEP) -c $< -o $@
$(B)/liblockstep.a: $(patsubst src/%.c,$(B)/obj/%.o,$(LIB_SRC))
	@rm -f $@; ar rcs $@ $^
$(B)/lockstep: $(patsubst src/%.c,$(B)/obj/%.o,$(CLI_SRC)) $(B)/liblockstep.a
	@$(if $(Q),echo "  LINK    $@")
	$(Q)$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS)
$(call deps,$(patsubst tests/%.c,$(B)/tests/%,$(TEST_SRC)))
$(B)/tests/%: tests/%.c $(B)/liblockstep.a
	@mkdir -p $(dir $@)
	@$(if $(Q),echo "  TEST    $@")
	$(Q)$(CC) $(CFLAGS) $(DEP) -Itests $< $(B)/liblockstep.a -o $@ $(LDLIBS) -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc

# micro-benchmarks, built on demand only: make B=build $(B)/bench/bench_quant
$(B)/bench/%: bench/%.c $(B)/liblockstep.a $(HDR)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $< $(B)/liblockstep.a -o $@ $(LDLIBS)

# --- sanitizer build (ASan + UBSan) -----------------------------------------
$(call deps,$(patsubst src/%.c,$(B)/asan/obj/%.o,$(SRC)))
$(B)/asan/obj/%.o: src/%.c
	@mkdir -p $(dir $@)
	@$(if $(Q),echo "  CC asan $<")
	$(Q)$(CC) $(CFLAGS) $(SAN) $(DEP) -c $< -o $@
$(B)/asan/liblockstep.a: $(patsubst src/%.c,$(B)/asan/obj/%.o,$(LIB_SRC))
	@rm -f $@; ar rcs $@ $^
$(B)/asan/lockstep: $(patsubst src/%.c,$(B)/asan/obj/%.o,$(CLI_SRC)) $(B)/asan/liblockstep.a
	@$(if $(Q),echo "  LINK    $@")
	$(Q)$(CC) $(CFLAGS) $(SAN) $^ -o $@ $(LDLIBS)
$(call deps,$(patsubst tests/%.c,$(B)/asan/tests/%,$(TEST_SRC)))
$(B)/asan/tests/%: tests/%.c $(B)/asan/liblockstep.a
	@mkdir -p $(dir $@)
	@$(if $(Q),echo "  TEST    $@")
	$(Q)$(CC) $(CFLAGS) $(SAN) $(DEP) -Itests $< $(B)/asan/liblockstep.a -o $@ $(LDLIBS) -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc

TESTS      := $(patsubst tests/%.c,$(B)/tests/%,$(TEST_SRC))
ASAN_TESTS := $(patsubst tests/%.c,$(B)/asan/tests/%,$(TEST_SRC))

tests: $(B)/lockstep $(B)/asan/lockstep $(TESTS) $(ASAN_TESTS)
test: tests
	@B=$(B) tests/run.sh
asan: $(B)/asan/lockstep $(ASAN_TESTS)
install: $(B)/lockstep
	install -d $(DESTDIR)$(PREFIX)/bin
	install -m 755 $(B)/lockstep $(DESTDIR)$(PREFIX)/bin/lockstep
uninstall:
	rm -f $(DESTDIR)$(PREFIX)/bin/lockstep
# --- fuzzing (clang: libFuzzer + ASan + UBSan) -------------------------------
# make fuzz -> $(B)/fuzz/fuzz_* and their seed corpora, generated from the test
# data into $(B)/fuzz/seeds/NAME/; fuzz/README.md says how to run them.
FUZZ_CC  ?= clang
FUZZ     := $(patsubst fuzz/%.c,$(B)/fuzz/%,$(wildcard fuzz/fuzz_*.c))
$(call deps,$(patsubst src/%.c,$(B)/fuzz/obj/%.o,$(SRC)))
$(B)/fuzz/obj/%.o: src/%.c
	@mkdir -p $(dir $@)
	@$(if $(Q),echo "  CC fuzz $<")
	$(Q)$(FUZZ_CC) $(CFLAGS) $(SAN) $(DEP) -fsanitize=fuzzer-no-link -c $< -o $@
# quant/'s kernels and quantisers come from the plain build: they parse
# nothing, and instrumented the SIMD ones take many minutes to compile.
FUZZ_PLAIN := $(wildcard src/quant/quant_*.c)
$(B)/fuzz/liblockstep.a: $(patsubst src/%.c,$(B)/fuzz/obj/%.o,$(filter-out $(FUZZ_PLAIN),$(LIB_SRC))) \
                         $(patsubst src/%.c,$(B)/obj/%.o,$(FUZZ_PLAIN))
	@rm -f $@; ar rcs $@ $^
$(B)/fuzz/fuzz_%: fuzz/fuzz_%.c $(wildcard fuzz/*.h) $(B)/fuzz/liblockstep.a $(HDR)
	@$(if $(Q),echo "  FUZZ    $@")
	$(Q)$(FUZZ_CC) $(CFLAGS) $(SAN) -fsanitize=fuzzer $< $(B)/fuzz/liblockstep.a -o $@ $(LDLIBS)
$(B)/fuzz/seedgen: fuzz/seedgen.c $(B)/liblockstep.a $(HDR)
	$(Q)$(CC) $(CFLAGS) $< $(B)/liblockstep.a -o $@ $(LDLIBS)
fuzz: $(FUZZ) $(B)/fuzz/seedgen
	@rm -rf $(B)/fuzz/seeds && $(B)/fuzz/seedgen $(B)/fuzz/seeds
.PHONY: fuzz

clean:
	rm -rf build

.PHONY: all tests test asan install uninstall clean
.SECONDARY:
