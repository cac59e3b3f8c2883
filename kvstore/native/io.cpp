// The fused per-byte operations (see io.hpp). Pure C++: codec_bind.cpp binds them.
#include "io.hpp"

#include <cerrno>
#include <chrono>
#include <cstring>

#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>

namespace kvstore_native::io {

uint64_t copy_hashed(void* dst, const void* src, size_t len, uint64_t seed) noexcept {
    return xxh3::copy_hash64(dst, src, len, seed);
}

namespace {

// Bytes asked of one recv: what arrives is hashed before the next call, while
// it is still in L2.
constexpr size_t kRecvBytes = 256 * 1024;

using Clock = std::chrono::steady_clock;

// Wait until ``fd`` is readable, at most ``timeout_ms``; EINTR goes to the hook.
RecvStatus wait_readable(int fd, int timeout_ms, bool (*on_eintr)(void*), void* ctx,
                         int* error) noexcept {
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    int left_ms = timeout_ms;
    for (;;) {
        pollfd p{fd, POLLIN, 0};
        int r = ::poll(&p, 1, left_ms);
        if (r > 0) return RecvStatus::kOk;      // readable, or an error recv will report
        if (r == 0) return RecvStatus::kTimedOut;
        if (errno != EINTR) {
            *error = errno;
            return RecvStatus::kError;
        }
        if (!on_eintr(ctx)) return RecvStatus::kInterrupted;
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
        if (left.count() <= 0) return RecvStatus::kTimedOut;
        left_ms = static_cast<int>(left.count());
    }
}

}  // namespace

RecvResult recv_hashed(int fd, uint8_t* dst, size_t len, xxh3::State& state, int timeout_ms,
                       bool (*on_eintr)(void*), void* ctx) noexcept {
    size_t got = 0;
    while (got < len) {
        size_t want = len - got < kRecvBytes ? len - got : kRecvBytes;
        ssize_t k = ::recv(fd, dst + got, want, 0);
        if (k > 0) {
            state.update(dst + got, static_cast<size_t>(k));
            got += static_cast<size_t>(k);
            continue;
        }
        if (k == 0) return {RecvStatus::kClosed, got, 0};
        int e = errno;
        if (e == EINTR) {
            if (!on_eintr(ctx)) return {RecvStatus::kInterrupted, got, 0};
            continue;
        }
        if (e == EAGAIN || e == EWOULDBLOCK) {
            if (timeout_ms <= 0) return {RecvStatus::kWouldBlock, got, 0};
            int error = 0;
            RecvStatus w = wait_readable(fd, timeout_ms, on_eintr, ctx, &error);
            if (w != RecvStatus::kOk) return {w, got, error};
            continue;
        }
        return {RecvStatus::kError, got, e};
    }
    return {RecvStatus::kOk, got, 0};
}

}  // namespace kvstore_native::io
