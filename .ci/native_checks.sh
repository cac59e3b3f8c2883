#!/usr/bin/env bash
# Safety checks of the native core (kvstore/native/, issue 33), run by .ci/run
# after the README's test command, in its virtual environment:
#
#  1. A sanitizer build of the extension (AddressSanitizer and
#     UndefinedBehaviorSanitizer, no recovery) made in a temporary copy of the
#     tree, so the real install is untouched; the native unit tests and a short
#     `kvstore fuzz` run against it, with the sanitizer runtimes preloaded into
#     Python (ASAN_OPTIONS=detect_leaks=0: CPython keeps objects until exit by
#     design). Every sanitizer report is also written to a log folder, from
#     every process the fuzz run starts: a report anywhere fails the check.
#     (It compiles on one core while 2. runs on the other.)
#  2. libFuzzer: kvstore/native/fuzz/frames_fuzz.cpp (the header parser on
#     arbitrary streams; XXH3 streamed over any split == one-shot == copy_hashed),
#     kvstore/native/fuzz/inventory_fuzz.cpp (a SyncInventory chunk decoded,
#     re-encoded and applied to an entry table) and
#     kvstore/native/fuzz/serving_fuzz.cpp (the native GET service on a client's
#     arbitrary bytes), built with clang -fsanitize=fuzzer,address,undefined,
#     for $FUZZ_SECONDS together, a third each
#     (KVSTORE_FUZZ_SECONDS, default 60; 0 builds them only).
#
# Exit status: 0 when all pass, 1 otherwise. Needs clang and its runtimes
# (Debian: clang, libclang-rt-14-dev), installed with apt-get when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
FUZZ_SECONDS="${KVSTORE_FUZZ_SECONDS:-60}"
PY="${PYTHON:-python3}"

say() { echo "native-checks: $*" >&2; }
apt_install() {
    if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "$@" >/dev/null
}
if ! command -v clang++ >/dev/null 2>&1; then
    say "installing clang"
    apt_install clang
fi
command -v clang++ >/dev/null 2>&1 || { say "clang++ is required and could not be installed"; exit 1; }

WORK="$(mktemp -d)"
SAN_BUILD_PID=""
cleanup() {
    [ -z "$SAN_BUILD_PID" ] || kill "$SAN_BUILD_PID" 2>/dev/null || true
    rm -rf "$WORK" || true
}
trap cleanup EXIT

# ---- 1. the extension built with ASan and UBSan, in a copy of the tree ----
# (started first: it compiles on one core while the fuzzer runs on the other)
mkdir -p "$WORK/src"
git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$WORK/src"
cp -r kvstore/_proto "$WORK/src/kvstore/" 2>/dev/null || true      # generated at install
"$PY" -c "import pybind11" 2>/dev/null || "$PY" -m pip install -q "pybind11>=2.12"
CXX_BIN="$("$PY" -c "import sysconfig; print((sysconfig.get_config_var('CXX') or 'g++').split()[0])")"
SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all"
say "building kvstore._native with $SAN ($CXX_BIN), beside the fuzzing"
( cd "$WORK/src" && KVSTORE_NATIVE_CFLAGS="$SAN" KVSTORE_BUILD_JOBS=1 \
    exec "$PY" setup.py -q build_ext --inplace >"$WORK/san_build.log" 2>&1 ) &
SAN_BUILD_PID=$!

# ---- 2. the libFuzzer target ----
# libFuzzer and the sanitizer runtimes of clang are a package of their own on
# Debian (libclang-rt-<major>-dev); a first failed link installs it.
fuzz_build() {
    clang++ -std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
        -Ikvstore/native kvstore/native/fuzz/frames_fuzz.cpp kvstore/native/frames.cpp \
        kvstore/native/xxh3.cpp kvstore/native/io.cpp -o "$WORK/frames_fuzz" &&
    clang++ -std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
        -Ikvstore/native kvstore/native/fuzz/inventory_fuzz.cpp kvstore/native/inventory_wire.cpp \
        kvstore/native/entry_inventory.cpp kvstore/native/entry_table.cpp \
        kvstore/native/xxh3.cpp -o "$WORK/inventory_fuzz" &&
    clang++ -std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
        -Ikvstore/native kvstore/native/fuzz/serving_fuzz.cpp kvstore/native/serving.cpp \
        kvstore/native/frames.cpp -o "$WORK/serving_fuzz"
}
if ! fuzz_build 2>"$WORK/fuzz_build.log"; then
    major="$(clang++ -dumpversion | cut -d. -f1)"
    say "installing libclang-rt-${major}-dev (libFuzzer)"
    apt_install "libclang-rt-${major}-dev" || true
    fuzz_build || { cat "$WORK/fuzz_build.log" >&2; say "the fuzz target does not build"; exit 1; }
fi
# Seeds: one well-formed frame of each kind, so the fuzzer starts inside the format.
mkdir -p "$WORK/corpus"
"$PY" - "$WORK/corpus" <<'EOF'
import struct, sys
req, resp = struct.Struct("<BBHIQQQ"), struct.Struct("<BBHIQQQQQ")
seeds = {
    "put": req.pack(1, 2, 3, 2, 7, 5, 0) + b"keypahello",
    "get": req.pack(2, 0, 3, 0, 7, 0, 0) + b"key",
    "pipeline": (req.pack(3, 1, 1, 0, 1, 4096, 0) + b"a") + (req.pack(14, 0, 0, 0, 0, 32, 0) + bytes(32)),
    "reply": resp.pack(0, 0, 5, 0, 9, 1 << 20, 123, 4096, 77) + b"error",
    "long": bytes(range(256)) * 9,
}
for name, data in seeds.items():
    open(f"{sys.argv[1]}/{name}", "wb").write(data)
EOF
# Seeds of the inventory target: SyncInventory chunks as a node serializes them.
mkdir -p "$WORK/inv_corpus"
"$PY" - "$WORK/inv_corpus" <<'EOF'
import sys
from kvstore._native import encode_inventory
rows = [(f"{i % 5:032x}", i + 1, 64, 7, i % 4, i % 3 == 0, i % 4) for i in range(8)]
open(f"{sys.argv[1]}/chunk", "wb").write(encode_inventory("n0", "i", 5, 1, True, rows))
open(f"{sys.argv[1]}/odd", "wb").write(
    encode_inventory("", "", 0, 0, False, [("\u00e9-key", 2**63, 0, 0, 0, False, 0)]))
EOF
# Seeds of the GET service's target: pipelined GETs of served and unknown keys.
mkdir -p "$WORK/serving_corpus"
"$PY" - "$WORK/serving_corpus" <<'EOF'
import struct, sys
req = struct.Struct("<BBHIQQQ")
get = lambda key, oid=0: req.pack(2, 0, len(key), 0, oid, 0, 0) + key
open(f"{sys.argv[1]}/gets", "wb").write(get(b"a") + get(b"bb", 8) + get(b"k" * 512) + get(b"zz"))
open(f"{sys.argv[1]}/mixed", "wb").write(get(b"a") + req.pack(8, 0, 0, 0, 0, 0, 0) + get(b"a", 6))
EOF
HALF=$(( (FUZZ_SECONDS + 2) / 3 ))      # a third each
run_fuzz() {    # target corpus: a crash or a sanitizer report fails CI
    say "fuzzing $1 for ${HALF} s"
    if ! "$WORK/$1" -max_total_time="$HALF" -max_len=8192 -rss_limit_mb=2048 \
            -print_final_stats=1 -artifact_prefix="$WORK/" "$WORK/$2" >"$WORK/$1.log" 2>&1; then
        tail -n 60 "$WORK/$1.log" >&2
        say "FAILED: $1 found a crash or a sanitizer report (input: $WORK/crash-*)"
        exit 1
    fi
    grep -E "^stat::number_of_executed_units|^Done" "$WORK/$1.log" >&2 || true
}
if [ "$FUZZ_SECONDS" -gt 0 ]; then
    run_fuzz frames_fuzz corpus
    run_fuzz inventory_fuzz inv_corpus
    run_fuzz serving_fuzz serving_corpus
fi

# ---- 3. the native unit tests and a fuzz run against the sanitizer build ----
wait "$SAN_BUILD_PID" || { SAN_BUILD_PID=""; tail -n 40 "$WORK/san_build.log" >&2; say "the sanitizer build failed"; exit 1; }
SAN_BUILD_PID=""
PRELOAD="$("$CXX_BIN" -print-file-name=libasan.so):$("$CXX_BIN" -print-file-name=libubsan.so)"
mkdir -p "$WORK/reports"
san_env() {
    # The copy's kvstore (with the sanitized extension) comes first for this
    # process and every process it starts (the fuzz run's cluster).
    env PYTHONPATH="$WORK/src" LD_PRELOAD="$PRELOAD" \
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:log_path=$WORK/reports/asan" \
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$WORK/reports/ubsan" "$@"
}
( cd "$WORK/src" && san_env "$PY" -c "import kvstore._native as n, sys; sys.exit(0 if n.__file__.startswith('$WORK/src/') else 'not the sanitizer build: ' + n.__file__)" )

failed=0
say "native unit tests against the sanitizer build"
( cd "$WORK/src" && san_env "$PY" -m pytest -q -p no:cacheprovider \
    tests/unit/test_native_codec.py tests/unit/test_shm_copy.py \
    tests/unit/test_native_allocator.py tests/unit/test_allocator.py \
    tests/unit/test_native_eviction.py tests/unit/test_entry_table.py \
    tests/unit/test_master_index.py tests/unit/test_native_inventory.py \
    tests/unit/test_native_serving.py tests/unit/test_stored_object.py \
    tests/unit/test_key_map.py tests/unit/test_store_node.py \
    tests/integration/test_tcp_put_checksum.py \
    tests/integration/test_native_gets.py ) >&2 || failed=1
say "a short kvstore fuzz against the sanitizer build"
( cd "$WORK/src" && san_env "$PY" -m kvstore.tools.cli.cli fuzz --inputs 600 --seed 1 --json \
    --log-dir "$WORK/fuzz-logs" >"$WORK/kvfuzz.out" 2>"$WORK/kvfuzz.err" ) \
    || { tail -n 30 "$WORK/kvfuzz.out" "$WORK/kvfuzz.err" >&2; failed=1; }
"$PY" -c "import json,sys; r=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); \
print('native-checks: kvstore fuzz: passed', r['passed'], 'inputs', r['inputs'], \
      'process exits', r['process_exits'], file=sys.stderr)" "$WORK/kvfuzz.out" || failed=1
if compgen -G "$WORK/reports/*" >/dev/null; then
    for f in "$WORK"/reports/*; do say "sanitizer report $f:"; head -n 40 "$f" >&2; done
    failed=1
fi
say "done in $(( $(date +%s) - START )) s"
if [ "$failed" -ne 0 ]; then
    say "FAILED: a test failed or a sanitizer reported under the sanitizer build"
    exit 1
fi
