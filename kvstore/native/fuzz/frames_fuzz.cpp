// libFuzzer target of the native codec: the header parser on arbitrary streams
// and XXH3-64 streaming against one-shot. Built by .ci/native_checks.sh with
//   clang++ -fsanitize=fuzzer,address,undefined frames_fuzz.cpp frames.cpp xxh3.cpp io.cpp
// and run for a bounded time; any trap, sanitizer report or leak fails CI.
//
// Properties checked on every input:
//  1. decode_request / decode_response never read past the input, and an
//     accepted header honours every limit; encode(decode(x)) == x.
//  2. Parsing the input as a pipelined stream of requests (header, key,
//     parent, value) consumes only bounded lengths and terminates.
//  3. XXH3-64 of the input is the same one-shot, streamed over a split chosen
//     by the input itself, and through copy_hashed; with a seed too.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "frames.hpp"
#include "io.hpp"
#include "xxh3.hpp"

using namespace kvstore_native;

namespace {

const frames::Limits kLimits{512, 512, 64u << 20, 4096, 4096};

void check(bool ok) {
    if (!ok) __builtin_trap();
}

void headers(const uint8_t* data, size_t size) {
    frames::Request req;
    frames::FrameError e = frames::decode_request(data, size, kLimits, &req);
    if (e == frames::FrameError::kOk) {
        check(frames::known_op(req.op));
        check(req.key_len <= kLimits.max_key_bytes && req.parent_len <= kLimits.max_parent_bytes);
        if (frames::op_carries_value(req.op)) check(req.size <= kLimits.max_value_bytes);
    }
    if (size >= frames::kRequestBytes) {
        uint8_t again[frames::kRequestBytes];
        frames::encode_request(req, again);
        check(std::memcmp(again, data, frames::kRequestBytes) == 0);
    } else {
        check(e == frames::FrameError::kShort);
    }
    frames::Response resp;
    e = frames::decode_response(data, size, kLimits, &resp);
    if (e == frames::FrameError::kOk) check(resp.msg_len <= kLimits.max_message_bytes);
    if (size >= frames::kResponseBytes) {
        uint8_t again[frames::kResponseBytes];
        frames::encode_response(resp, again);
        check(std::memcmp(again, data, frames::kResponseBytes) == 0);
    }
}

// A node's frame loop over the input: every length is bounded before it is used.
void stream(const uint8_t* data, size_t size) {
    size_t pos = 0;
    uint64_t sink = 0;
    while (pos < size) {
        frames::Request req;
        if (frames::decode_request(data + pos, size - pos, kLimits, &req) != frames::FrameError::kOk)
            return;
        pos += frames::kRequestBytes;
        size_t names = static_cast<size_t>(req.key_len) + req.parent_len;
        if (names > size - pos) return;                 // the stream ended inside the frame
        sink += xxh3::hash64(data + pos, names);        // read the names (in bounds)
        pos += names;
        if (frames::op_carries_value(req.op) && req.op != static_cast<uint8_t>(frames::Op::kShmAlloc)) {
            if (req.size > size - pos) return;
            sink ^= xxh3::hash64(data + pos, static_cast<size_t>(req.size));
            pos += static_cast<size_t>(req.size);
        }
    }
    (void)sink;
}

void hashes(const uint8_t* data, size_t size) {
    uint64_t seed = 0;
    if (size >= 8 && (data[0] & 1)) std::memcpy(&seed, data + size - 8, 8);
    uint64_t whole = xxh3::hash64(data, size, seed);
    // Split points from the input: each byte (mod 97, plus a long jump now and
    // then) is the next piece's length, so splits around stripes (64 B), the
    // buffer (256 B) and blocks (1024 B) all occur.
    xxh3::State state(seed);
    size_t pos = 0, i = 0;
    while (pos < size) {
        size_t piece = data[i % size] % 97;
        if (data[(i + 1) % size] > 250) piece += 1024;
        ++i;
        if (piece == 0) {                  // an empty update changes nothing...
            state.update(data + pos, 0);
            piece = 1;                     // ...and the split must go on
        }
        if (piece > size - pos) piece = size - pos;
        state.update(data + pos, piece);
        pos += piece;
    }
    check(state.total_bytes() == size);
    check(state.digest() == whole);
    std::vector<uint8_t> copy(size);
    check(io::copy_hashed(copy.data(), data, size, seed) == whole);
    check(size == 0 || std::memcmp(copy.data(), data, size) == 0);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    // An exact-size heap copy: ASan catches a read one byte past the input.
    std::vector<uint8_t> input(data, data + size);
    const uint8_t* p = size ? input.data() : nullptr;
    headers(p, size);
    stream(p, size);
    hashes(p, size);
    return 0;
}
