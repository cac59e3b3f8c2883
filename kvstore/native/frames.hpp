// The data protocol's fixed headers (kvstore/transfer/protocol.py) as pure C++:
//
//   request  (32 B, "<BBHIQQQ")   | op u8 | flags u8 | key_len u16 | parent_len u32
//                                 | object_id u64 | size u64 | checksum u64 |
//   response (48 B, "<BBHIQQQQQ") | code u8 | flags u8 | msg_len u16 | reserved u32
//                                 | object_id u64 | size u64 | checksum u64 | offset u64 | serial u64 |
//
// All integers little-endian. Decoding bounds every length and count taken
// from the wire against the caller's limits BEFORE anything is read or
// allocated for it, and names each violation with its own error code: a
// stream that sends one is not a peer of ours and is closed by the caller.
// No Python types: the fuzz target (fuzz/frames_fuzz.cpp) links this alone.
#pragma once
#include <cstddef>
#include <cstdint>

namespace kvstore_native::frames {

constexpr size_t kRequestBytes = 32;
constexpr size_t kResponseBytes = 48;

// Ops of protocol.Op, and rdma_wire.OP_RDMA_CONNECT.
enum class Op : uint8_t {
    kPut = 1, kGet = 2, kShmAlloc = 3, kShmCommit = 4, kShmAcquire = 5, kShmRelease = 6,
    kShmAbort = 7, kPing = 8, kPin = 9, kUnpin = 10, kPrefetch = 11, kStats = 12,
    kAuthHello = 13, kAuthProve = 14, kDrop = 15, kShmTouch = 16, kRdmaConnect = 32,
};

struct Request {
    uint8_t op;
    uint8_t flags;        // PUT / SHM_ALLOC: the replica count asked for; else 0
    uint16_t key_len;     // bytes of key after the header
    uint32_t parent_len;  // bytes of parent key after the key
    uint64_t object_id;
    uint64_t size;        // value bytes (PUT, AUTH_PROVE, RDMA_CONNECT), reservation (SHM_ALLOC),
                          // or the op's argument (PIN ttl_ms, UNPIN kind, PREFETCH deadline_ms)
    uint64_t checksum;    // xxh3-64 of the value, 0 when not known
};

struct Response {
    uint8_t code;         // kvstore_pb2.Code, 0 = OK
    uint8_t flags;
    uint16_t msg_len;     // bytes of error message after the header
    uint32_t reserved;
    uint64_t object_id;
    uint64_t size;
    uint64_t checksum;
    uint64_t offset;
    uint64_t serial;
};

// What the receiver accepts; every bound is inclusive.
struct Limits {
    uint32_t max_key_bytes;      // key_len
    uint32_t max_parent_bytes;   // parent_len
    uint64_t max_value_bytes;    // size of a PUT, SHM_ALLOC or AUTH_PROVE
    uint64_t max_connect_bytes;  // size of an RDMA_CONNECT (its connection blob)
    uint32_t max_message_bytes;  // msg_len of a response
};

enum class FrameError : int {
    kOk = 0,
    kShort = 1,            // fewer bytes than a header
    kUnknownOp = 2,        // op not in Op
    kKeyTooLong = 3,       // key_len > max_key_bytes
    kParentTooLong = 4,    // parent_len > max_parent_bytes
    kValueTooLarge = 5,    // size > max_value_bytes (or max_connect_bytes) for an op with a value
    kMessageTooLong = 6,   // msg_len > max_message_bytes
    kBadFlags = 7,         // flags set on an op that takes none
};

// A short, stable name of ``e`` ("key_too_long"), for errors and metrics.
const char* error_name(FrameError e) noexcept;

// Whether ``op`` is one of Op.
bool known_op(uint8_t op) noexcept;

// Whether the op's ``size`` counts value bytes that follow (or are reserved).
bool op_carries_value(uint8_t op) noexcept;

// Decode and check the request header in ``in[0..len)``; ``out`` is filled
// (as far as decoded) even when an error is returned.
FrameError decode_request(const uint8_t* in, size_t len, const Limits& limits,
                          Request* out) noexcept;

// Decode and check the response header in ``in[0..len)``.
FrameError decode_response(const uint8_t* in, size_t len, const Limits& limits,
                           Response* out) noexcept;

// Write the header into ``out`` (kRequestBytes / kResponseBytes of room).
void encode_request(const Request& r, uint8_t* out) noexcept;
void encode_response(const Response& r, uint8_t* out) noexcept;

}  // namespace kvstore_native::frames
