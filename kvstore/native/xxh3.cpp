// XXH3-64 from the xxHash specification (doc/xxhash_spec.md of the xxHash
// project; the section names below are the spec's). See xxh3.hpp.
//
// Layout of the long-input state (inputs over 240 bytes), spec "for large inputs":
//
//   input   | stripe 0 | stripe 1 | ... | stripe 15 | stripe 16 | ... | last bytes |
//   secret  |  +0      |  +8      | ... |  +120     |  +0       | ... | last 64 B at +121
//              \______ one block (1024 B): then a scramble ______/
//
// Every stripe before the last byte is accumulated at secret offset
// (index % 16) * 8, with a scramble after each 16th; the last 64 bytes of the
// input are accumulated once more at offset 121, whether or not they overlap
// stripes already taken. Streaming and one-shot share that one rule.
#include "xxh3.hpp"

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVSTORE_XXH3_X86 1
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "xxh3.cpp reads lanes as host integers: little-endian hosts only"
#endif

namespace kvstore_native::xxh3 {
namespace {

constexpr uint64_t P32_1 = 0x9E3779B1U;
constexpr uint64_t P32_2 = 0x85EBCA77U;
constexpr uint64_t P32_3 = 0xC2B2AE3DU;
constexpr uint64_t P64_1 = 0x9E3779B185EBCA87ULL;
constexpr uint64_t P64_2 = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t P64_3 = 0x165667B19E3779F9ULL;
constexpr uint64_t P64_4 = 0x85EBCA77C2B2AE63ULL;
constexpr uint64_t P64_5 = 0x27D4EB2F165667C5ULL;
constexpr uint64_t PMX_1 = 0x165667919E3779F9ULL;
constexpr uint64_t PMX_2 = 0x9FB21C651E98DF25ULL;

constexpr size_t kSecretBytes = 192;
constexpr size_t kStripeBytes = 64;
constexpr size_t kStripesPerBlock = (kSecretBytes - 64) / 8;        // 16
constexpr size_t kLastStripeSecret = kSecretBytes - 71;             // 121
constexpr size_t kMergeSecret = 11;

// The spec's default secret ("Seed and Secret").
alignas(64) constexpr uint8_t kDefaultSecret[kSecretBytes] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

inline uint64_t rd64(const uint8_t* p) noexcept { uint64_t v; std::memcpy(&v, p, 8); return v; }
inline uint32_t rd32(const uint8_t* p) noexcept { uint32_t v; std::memcpy(&v, p, 4); return v; }
inline void wr64(uint8_t* p, uint64_t v) noexcept { std::memcpy(p, &v, 8); }
inline uint64_t rotl64(uint64_t x, int r) noexcept { return (x << r) | (x >> (64 - r)); }
inline uint32_t bswap32(uint32_t x) noexcept { return __builtin_bswap32(x); }
inline uint64_t bswap64(uint64_t x) noexcept { return __builtin_bswap64(x); }

// The low and high halves of a 64x64 -> 128-bit product, xor-ed ("fold").
inline uint64_t mul_fold(uint64_t a, uint64_t b) noexcept {
    unsigned __int128 m = static_cast<unsigned __int128>(a) * b;
    return static_cast<uint64_t>(m) ^ static_cast<uint64_t>(m >> 64);
}

// Spec "Final Mixing Step": avalanche() and avalanche_XXH64().
inline uint64_t avalanche(uint64_t x) noexcept {
    x ^= x >> 37;
    x *= PMX_1;
    return x ^ (x >> 32);
}
inline uint64_t avalanche_xxh64(uint64_t x) noexcept {
    x ^= x >> 33;
    x *= P64_2;
    x ^= x >> 29;
    x *= P64_3;
    return x ^ (x >> 32);
}

// ---- small inputs (0-16 bytes), always with the default secret and the seed ----
uint64_t hash_0to16(const uint8_t* in, size_t len, const uint8_t* s, uint64_t seed) noexcept {
    if (len > 8) {                                             // 9-16
        uint64_t lo = ((rd64(s + 24) ^ rd64(s + 32)) + seed) ^ rd64(in);
        uint64_t hi = ((rd64(s + 40) ^ rd64(s + 48)) - seed) ^ rd64(in + len - 8);
        return avalanche(len + bswap64(lo) + hi + mul_fold(lo, hi));
    }
    if (len >= 4) {                                            // 4-8
        uint64_t first = rd32(in), last = rd32(in + len - 4);
        uint64_t mseed = seed ^ (static_cast<uint64_t>(bswap32(static_cast<uint32_t>(seed))) << 32);
        uint64_t v = ((rd64(s + 8) ^ rd64(s + 16)) - mseed) ^ (last | (first << 32));
        v ^= rotl64(v, 49) ^ rotl64(v, 24);
        v *= PMX_2;
        v ^= (v >> 35) + len;
        v *= PMX_2;
        return v ^ (v >> 28);
    }
    if (len > 0) {                                             // 1-3
        uint32_t combined = static_cast<uint32_t>(in[len - 1]) | (static_cast<uint32_t>(len) << 8)
                          | (static_cast<uint32_t>(in[0]) << 16)
                          | (static_cast<uint32_t>(in[len >> 1]) << 24);
        uint64_t v = (static_cast<uint64_t>(rd32(s) ^ rd32(s + 4)) + seed) ^ combined;
        return avalanche_xxh64(v);
    }
    return avalanche_xxh64(seed ^ rd64(s + 56) ^ rd64(s + 64));   // empty
}

// ---- medium inputs (17-240 bytes) ----
inline uint64_t mix16(const uint8_t* in, const uint8_t* s, uint64_t seed) noexcept {
    return mul_fold(rd64(in) ^ (rd64(s) + seed), rd64(in + 8) ^ (rd64(s + 8) - seed));
}

uint64_t hash_17to128(const uint8_t* in, size_t len, const uint8_t* s, uint64_t seed) noexcept {
    uint64_t acc = len * P64_1;
    size_t rounds = ((len - 1) >> 5) + 1;
    for (size_t i = rounds; i-- > 0;) {
        acc += mix16(in + 16 * i, s + 32 * i, seed);
        acc += mix16(in + len - 16 * i - 16, s + 32 * i + 16, seed);
    }
    return avalanche(acc);
}

uint64_t hash_129to240(const uint8_t* in, size_t len, const uint8_t* s, uint64_t seed) noexcept {
    uint64_t acc = len * P64_1;
    size_t chunks = len >> 4;
    for (size_t i = 0; i < 8; ++i) acc += mix16(in + 16 * i, s + 16 * i, seed);
    acc = avalanche(acc);
    for (size_t i = 8; i < chunks; ++i) acc += mix16(in + 16 * i, s + 16 * (i - 8) + 3, seed);
    acc += mix16(in + len - 16, s + 119, seed);
    return avalanche(acc);
}

uint64_t hash_short(const uint8_t* in, size_t len, uint64_t seed) noexcept {
    const uint8_t* s = kDefaultSecret;
    if (len <= 16) return hash_0to16(in, len, s, seed);
    if (len <= 128) return hash_17to128(in, len, s, seed);
    return hash_129to240(in, len, s, seed);
}

// ---- large inputs (> 240 bytes) ----
// consume(): accumulate() of the spec for ``n`` consecutive stripes onto a state
// that has taken ``*in_block`` stripes of its current block (the secret moves
// by 8 bytes per stripe), with the scramble (spec "Step 2-2") at each block's
// end. With ``out`` the stripes are also stored there as they are loaded: the
// copy and the hash are one pass over the bytes (copy_hashed).
//
// One loop, built for AVX-512, AVX2, SSE2 and portably; the CPU picks at load
// time. All give the same sums: the eight 64-bit lanes are independent.
using ConsumeFn = void (*)(uint64_t* acc, size_t* in_block, const uint8_t* in, size_t n,
                           const uint8_t* secret, uint8_t* out) noexcept;

inline void scramble_portable(uint64_t* acc, const uint8_t* s) noexcept {
    for (size_t i = 0; i < 8; ++i) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= rd64(s + 8 * i);
        acc[i] = a * P32_1;
    }
}

inline void accumulate_portable(uint64_t* acc, const uint8_t* in, const uint8_t* s) noexcept {
    for (size_t i = 0; i < 8; ++i) {
        uint64_t d = rd64(in + 8 * i);
        uint64_t v = d ^ rd64(s + 8 * i);
        acc[i ^ 1] += d;
        acc[i] += (v & 0xFFFFFFFFULL) * (v >> 32);
    }
}

void consume_portable(uint64_t* acc, size_t* in_block, const uint8_t* in, size_t n,
                      const uint8_t* secret, uint8_t* out) noexcept {
    size_t k = *in_block;
    for (size_t i = 0; i < n; ++i, in += kStripeBytes) {
        if (out != nullptr) {
            std::memcpy(out, in, kStripeBytes);
            out += kStripeBytes;
        }
        accumulate_portable(acc, in, secret + 8 * k);
        if (++k == kStripesPerBlock) {
            scramble_portable(acc, secret + kSecretBytes - 64);
            k = 0;
        }
    }
    *in_block = k;
}

#ifdef KVSTORE_XXH3_X86
// The same loop over W-byte vectors (16, 32, 64): ``V`` wraps the ISA's
// intrinsics. Per lane: v = data ^ secret; acc += lo32(v) * hi32(v) (a shift,
// not a shuffle, for the high half: shuffles share one port with the swap);
// acc[i ^ 1] += data (swap the 64-bit lanes of each pair). The scramble's
// multiply by a 32-bit prime is two 32x32 products: lo * p + (hi * p << 32).
// Measured here (Xeon, AVX-512), 64 KiB in cache: 37 -> 50 GB/s on unaligned
// data from the empty asm, which keeps the compiler from loading each stripe a
// second time as the swap's memory operand (a split load twice over), and
// unrolling by 4; python-xxhash does 53 on the same buffers.
#define KVSTORE_XXH3_CONSUME(NAME, TARGET, VEC, LANES, LOAD, STORE, XOR, ADD, MUL32, SRL, SLL,  \
                             SWAP, SET1)                                                         \
    template <bool kCopy>                                                                        \
    TARGET void NAME##_impl(uint64_t* acc, size_t* in_block, const uint8_t* in, size_t n,       \
                            const uint8_t* secret, uint8_t* out) noexcept {                      \
        VEC a[LANES];                                                                            \
        for (int j = 0; j < LANES; ++j) a[j] = LOAD(acc + j * (8 / LANES));                      \
        const VEC prime = SET1(static_cast<long long>(P32_1));                                   \
        size_t k = *in_block;                                                                    \
        while (n > 0) {                                                                          \
            size_t take = kStripesPerBlock - k < n ? kStripesPerBlock - k : n;                   \
            const uint8_t* s = secret + 8 * k;                                                   \
            _Pragma("GCC unroll 4")                                                              \
            for (size_t i = 0; i < take; ++i, in += kStripeBytes, s += 8) {                      \
                for (int j = 0; j < LANES; ++j) {                                                \
                    VEC d = LOAD(in + j * (64 / LANES));                                         \
                    __asm__("" : "+v"(d)); /* one load of d: see above */                        \
                    if (kCopy) STORE(out + j * (64 / LANES), d);                                 \
                    VEC v = XOR(d, LOAD(s + j * (64 / LANES)));                                  \
                    a[j] = ADD(a[j], ADD(MUL32(v, SRL(v, 32)), SWAP(d)));                        \
                }                                                                                \
                if (kCopy) out += kStripeBytes;                                                  \
            }                                                                                    \
            n -= take;                                                                           \
            k += take;                                                                           \
            if (k == kStripesPerBlock) {                                                         \
                const uint8_t* sc = secret + kSecretBytes - 64;                                  \
                for (int j = 0; j < LANES; ++j) {                                                \
                    VEC x = XOR(XOR(a[j], SRL(a[j], 47)), LOAD(sc + j * (64 / LANES)));          \
                    a[j] = ADD(MUL32(x, prime), SLL(MUL32(SRL(x, 32), prime), 32));              \
                }                                                                                \
                k = 0;                                                                           \
            }                                                                                    \
        }                                                                                        \
        for (int j = 0; j < LANES; ++j) STORE(acc + j * (8 / LANES), a[j]);                      \
        *in_block = k;                                                                           \
    }                                                                                            \
    void NAME(uint64_t* acc, size_t* in_block, const uint8_t* in, size_t n,                      \
              const uint8_t* secret, uint8_t* out) noexcept {                                    \
        if (out != nullptr) NAME##_impl<true>(acc, in_block, in, n, secret, out);                \
        else NAME##_impl<false>(acc, in_block, in, n, secret, out);                              \
    }

#define KV_LOAD128(p) _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
#define KV_STORE128(p, v) _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v)
#define KV_SWAP128(d) _mm_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2))
KVSTORE_XXH3_CONSUME(consume_sse2, , __m128i, 4, KV_LOAD128, KV_STORE128, _mm_xor_si128,
                     _mm_add_epi64, _mm_mul_epu32, _mm_srli_epi64, _mm_slli_epi64, KV_SWAP128,
                     _mm_set1_epi64x)

#define KV_LOAD256(p) _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
#define KV_STORE256(p, v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v)
#define KV_SWAP256(d) _mm256_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2))
KVSTORE_XXH3_CONSUME(consume_avx2, __attribute__((target("avx2"))), __m256i, 2, KV_LOAD256,
                     KV_STORE256, _mm256_xor_si256, _mm256_add_epi64, _mm256_mul_epu32,
                     _mm256_srli_epi64, _mm256_slli_epi64, KV_SWAP256, _mm256_set1_epi64x)

#define KV_LOAD512(p) _mm512_loadu_si512(reinterpret_cast<const void*>(p))
#define KV_STORE512(p, v) _mm512_storeu_si512(reinterpret_cast<void*>(p), v)
#define KV_SWAP512(d) _mm512_shuffle_epi32(d, static_cast<_MM_PERM_ENUM>(_MM_SHUFFLE(1, 0, 3, 2)))
KVSTORE_XXH3_CONSUME(consume_avx512, __attribute__((target("avx512f"))), __m512i, 1, KV_LOAD512,
                     KV_STORE512, _mm512_xor_si512, _mm512_add_epi64, _mm512_mul_epu32,
                     _mm512_srli_epi64, _mm512_slli_epi64, KV_SWAP512, _mm512_set1_epi64)
#endif

// The widest build the CPU runs; KVSTORE_XXH3_ISA (portable, sse2, avx2, avx512)
// picks a narrower one, so that tests check every build on one machine.
ConsumeFn pick_consume() noexcept {
    const char* want = std::getenv("KVSTORE_XXH3_ISA");
    bool any = want == nullptr || *want == '\0';
    auto is = [want](const char* name) { return want != nullptr && std::strcmp(want, name) == 0; };
    if (is("portable")) return consume_portable;
#ifdef KVSTORE_XXH3_X86
    __builtin_cpu_init();
    if ((any || is("avx512")) && __builtin_cpu_supports("avx512f")) return consume_avx512;
    if ((any || is("avx512") || is("avx2")) && __builtin_cpu_supports("avx2")) return consume_avx2;
    return consume_sse2;
#else
    (void)any;
    return consume_portable;
#endif
}

// Chosen once, at load time (constant afterwards: no race).
const ConsumeFn consume_stripes = pick_consume();

void consume(uint64_t* acc, size_t* in_block, const uint8_t* in, size_t n,
             const uint8_t* secret) noexcept {
    if (n > 0) consume_stripes(acc, in_block, in, n, secret, nullptr);
}

inline void init_acc(uint64_t* acc) noexcept {
    const uint64_t init[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    std::memcpy(acc, init, sizeof init);
}

// Spec "Step 4. Finalization" (finalMerge) for XXH3-64.
uint64_t merge(const uint64_t* acc, const uint8_t* secret, uint64_t total) noexcept {
    const uint8_t* s = secret + kMergeSecret;
    uint64_t r = total * P64_1;
    for (size_t i = 0; i < 4; ++i)
        r += mul_fold(acc[2 * i] ^ rd64(s + 16 * i), acc[2 * i + 1] ^ rd64(s + 16 * i + 8));
    return avalanche(r);
}

// Spec "Seed and Secret": deriveSecret(seed).
void derive_secret(uint8_t* out, uint64_t seed) noexcept {
    for (size_t i = 0; i < kSecretBytes / 16; ++i) {
        wr64(out + 16 * i, rd64(kDefaultSecret + 16 * i) + seed);
        wr64(out + 16 * i + 8, rd64(kDefaultSecret + 16 * i + 8) - seed);
    }
}

// The long form over ``in``; with ``out``, ``in`` is copied there in the same pass.
uint64_t hash_long(const uint8_t* in, size_t len, const uint8_t* secret, uint8_t* out) noexcept {
    alignas(64) uint64_t acc[8];
    init_acc(acc);
    size_t in_block = 0;
    size_t stripes = (len - 1) / kStripeBytes;
    consume_stripes(acc, &in_block, in, stripes, secret, out);
    size_t done = stripes * kStripeBytes;
    if (out != nullptr) std::memcpy(out + done, in + done, len - done);
    accumulate_portable(acc, in + len - kStripeBytes, secret + kLastStripeSecret);
    return merge(acc, secret, len);
}

}  // namespace

uint64_t hash64(const void* data, size_t len, uint64_t seed) noexcept {
    const uint8_t* in = static_cast<const uint8_t*>(data);
    if (len <= 240) return hash_short(in, len, seed);
    if (seed == 0) return hash_long(in, len, kDefaultSecret, nullptr);
    alignas(64) uint8_t secret[kSecretBytes];
    derive_secret(secret, seed);
    return hash_long(in, len, secret, nullptr);
}

uint64_t copy_hash64(void* dst, const void* src, size_t len, uint64_t seed) noexcept {
    const uint8_t* in = static_cast<const uint8_t*>(src);
    uint8_t* out = static_cast<uint8_t*>(dst);
    if (len <= 240) {
        if (len > 0) std::memcpy(out, in, len);
        return hash_short(out, len, seed);
    }
    if (seed == 0) return hash_long(in, len, kDefaultSecret, out);
    alignas(64) uint8_t secret[kSecretBytes];
    derive_secret(secret, seed);
    return hash_long(in, len, secret, out);
}

void State::reset(uint64_t seed) noexcept {
    init_acc(acc_);
    if (seed == 0) std::memcpy(secret_, kDefaultSecret, kSecretBytes);
    else derive_secret(secret_, seed);
    buffered_ = 0;
    total_ = 0;
    seed_ = seed;
    stripe_in_block_ = 0;
}

void State::update(const void* data, size_t len) noexcept {
    if (len == 0) return;
    const uint8_t* in = static_cast<const uint8_t*>(data);
    total_ += len;
    if (len <= kBufferBytes - buffered_) {       // still no byte after the buffer: keep all
        std::memcpy(buffer_ + buffered_, in, len);
        buffered_ += len;
        return;
    }
    if (buffered_ > 0) {                         // fill the buffer; bytes follow it
        size_t fill = kBufferBytes - buffered_;
        std::memcpy(buffer_ + buffered_, in, fill);
        in += fill;
        len -= fill;
        consume(acc_, &stripe_in_block_, buffer_, kBufferBytes / kStripeBytes, secret_);
        std::memcpy(last_stripe_, buffer_ + kBufferBytes - kStripeBytes, kStripeBytes);
        buffered_ = 0;
    }
    if (len > kBufferBytes) {                    // straight from the input, leaving 1..64 bytes
        size_t n = (len - 1) / kStripeBytes;
        consume(acc_, &stripe_in_block_, in, n, secret_);
        std::memcpy(last_stripe_, in + (n - 1) * kStripeBytes, kStripeBytes);
        in += n * kStripeBytes;
        len -= n * kStripeBytes;
    }
    std::memcpy(buffer_, in, len);               // 1..kBufferBytes bytes, not consumed yet
    buffered_ = len;
}

uint64_t State::digest() const noexcept {
    if (total_ <= 240) return hash_short(buffer_, static_cast<size_t>(total_), seed_);
    alignas(64) uint64_t acc[8];
    std::memcpy(acc, acc_, sizeof acc);
    size_t in_block = stripe_in_block_;
    // buffered_ >= 1 here: a stripe is consumed only once a byte after it arrived.
    consume(acc, &in_block, buffer_, (buffered_ - 1) / kStripeBytes, secret_);
    uint8_t last[kStripeBytes];
    if (buffered_ >= kStripeBytes) {
        std::memcpy(last, buffer_ + buffered_ - kStripeBytes, kStripeBytes);
    } else {                                     // the tail of the stripe consumed before
        std::memcpy(last, last_stripe_ + buffered_, kStripeBytes - buffered_);
        std::memcpy(last + kStripeBytes - buffered_, buffer_, buffered_);
    }
    accumulate_portable(acc, last, secret_ + kLastStripeSecret);
    return merge(acc, secret_, total_);
}

}  // namespace kvstore_native::xxh3
