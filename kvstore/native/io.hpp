// The fused per-byte operations of the data path: copy and hash in one pass,
// receive from a socket and hash while the bytes are in the cache.
//
// Pure C++ (no Python types): io.cpp binds them for Python with the GIL
// released; the fuzz target and native tests may link them alone.
#pragma once
#include <cstddef>
#include <cstdint>

#include "xxh3.hpp"

namespace kvstore_native::io {

// Copy ``len`` bytes from ``src`` to ``dst`` (not overlapping) and return the
// XXH3-64 (``seed``) of them, in one pass: each 64-byte stripe is loaded once,
// stored to ``dst`` and hashed from the same registers (xxh3::copy_hash64).
uint64_t copy_hashed(void* dst, const void* src, size_t len, uint64_t seed = 0) noexcept;

// Why recv_hashed stopped.
enum class RecvStatus : int {
    kOk = 0,          // all bytes received
    kClosed = 1,      // the peer closed the stream first (recv returned 0)
    kTimedOut = 2,    // no byte within the timeout (poll)
    kWouldBlock = 3,  // EAGAIN without a timeout of ours (SO_RCVTIMEO, or a non-blocking fd)
    kError = 4,       // recv or poll failed with ``error`` (errno)
    kInterrupted = 5, // EINTR and the on_eintr hook said stop (a signal handler raised)
};

struct RecvResult {
    RecvStatus status;
    size_t received;  // bytes received (and hashed) by this call
    int error;        // errno for kError, else 0
};

// Receive exactly ``len`` bytes from the stream socket ``fd`` into ``dst``,
// feeding each piece to ``state`` as soon as it arrived.
//
// ``timeout_ms``: < 0 waits as the fd does (blocking, or its SO_RCVTIMEO:
// EAGAIN ends with kWouldBlock); 0: never waits (kWouldBlock); > 0: a
// non-blocking fd (a Python socket with a timeout) waits up to that long for
// each piece in poll(), as CPython's sock_recv_into does for each call.
// EINTR calls ``on_eintr(ctx)`` (run the signal handlers) and retries unless it
// returns false.
RecvResult recv_hashed(int fd, uint8_t* dst, size_t len, xxh3::State& state, int timeout_ms,
                       bool (*on_eintr)(void*), void* ctx) noexcept;

}  // namespace kvstore_native::io
