// XXH3-64: the checksum of every value kvstore stores and moves.
//
// Written from the published specification, "xxHash fast digest algorithm"
// (doc/xxhash_spec.md of the xxHash project, sections "XXH3 Algorithm
// Overview" to "for large inputs"); no code of any implementation is used.
// The results are bit-identical to python-xxhash's ``xxh3_64`` (intdigest),
// which is what the project's checksums were computed with, for any seed.
//
// Pure C++ (no Python types): the fuzz target and native tests link it alone.
#pragma once
#include <cstddef>
#include <cstdint>

namespace kvstore_native::xxh3 {

// The XXH3-64 of ``len`` bytes at ``data`` (``data`` may be null when len is 0).
uint64_t hash64(const void* data, size_t len, uint64_t seed = 0) noexcept;

// Copy ``len`` bytes from ``src`` to ``dst`` (not overlapping) and return their
// XXH3-64, in one pass: each 64-byte stripe is stored to ``dst`` from the
// registers it was loaded into for the hash (the bytes are read once).
uint64_t copy_hash64(void* dst, const void* src, size_t len, uint64_t seed = 0) noexcept;

// Streaming XXH3-64: feed a value in pieces of any sizes (several recv calls,
// copies chunk by chunk); digest() equals hash64 of the concatenation, whatever
// the split. Never allocates; about 700 bytes; copyable (a copy forks the hash).
class State {
public:
    explicit State(uint64_t seed = 0) noexcept { reset(seed); }

    // Start again from empty input with ``seed``.
    void reset(uint64_t seed = 0) noexcept;
    // Append ``len`` bytes at ``data`` to the input.
    void update(const void* data, size_t len) noexcept;
    // The hash of everything appended so far (the state is left as it was).
    uint64_t digest() const noexcept;
    // Bytes appended so far.
    uint64_t total_bytes() const noexcept { return total_; }

    static constexpr size_t kBufferBytes = 256;   // 4 stripes; >= 240 (the short forms)

private:
    // Stripes are consumed only once a byte after them arrived: the last
    // stripe of the input is handled apart by the finalisation (spec, Step 3).
    alignas(64) uint64_t acc_[8];
    alignas(64) uint8_t secret_[192];      // default secret, or derived from the seed
    alignas(64) uint8_t buffer_[kBufferBytes];
    uint8_t last_stripe_[64];              // the 64 bytes consumed last (before buffer_)
    size_t buffered_;                      // bytes in buffer_, 0..kBufferBytes
    uint64_t total_;
    uint64_t seed_;
    size_t stripe_in_block_;               // stripes of the current block consumed, 0..15
};

}  // namespace kvstore_native::xxh3
