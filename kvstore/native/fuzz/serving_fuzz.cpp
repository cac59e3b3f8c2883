// libFuzzer target of the native GET service: serve_gets on arbitrary client bytes
// (GET and SHM_TOUCH frames are served, anything else handed back).
// Built by .ci/native_checks.sh with
//   clang++ -fsanitize=fuzzer,address,undefined serving_fuzz.cpp serving.cpp frames.cpp
// and run for a bounded time; any trap, sanitizer report or leak fails CI.
//
// Each input is what a client sends on one connection (then it stops sending).
// The served keys are "a", "bb" and a 512-byte key; the input's first byte
// also withdraws one of them midway. Properties checked:
//  1. serve_gets reads only inside its buffer and the segment, and always ends
//     (the peer's end of stream: kClosed) with start <= end <= cap.
//  2. Every reply sent is a 48-byte OK header with the served copy's size, then
//     exactly that many bytes of it (an SHM_TOUCH's: size 0, nothing after), in
//     the order of the frames answered.
//  3. A handed-back frame is left unread at ``start``; the Python loop's
//     part is played by skipping one byte of it (it would consume the frame).
//  4. No reader is left on a copy: withdrawing every key afterwards finds none.
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "frames.hpp"
#include "serving.hpp"

using namespace kvstore_native;

namespace {

void check(bool ok) {
    if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static std::vector<uint8_t> segment(64 * 1024, 0x5a);
    serving::Index index(segment.data(), segment.size(), 8);
    index.set_lease(1e300);
    const std::string big(512, 'k');
    check(index.publish("a", {0, 100, 1, 7, 1, 0}));
    check(index.publish("bb", {4096, 0, 2, 8, 2, 1}));
    check(index.publish(big, {8192, 5000, 3, 9, 3, 2}));

    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return 0;
    int buf_bytes = 4 << 20;
    setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &buf_bytes, sizeof buf_bytes);
    setsockopt(sv[1], SOL_SOCKET, SO_RCVBUF, &buf_bytes, sizeof buf_bytes);
    setsockopt(sv[1], SOL_SOCKET, SO_SNDBUF, &buf_bytes, sizeof buf_bytes);
    setsockopt(sv[0], SOL_SOCKET, SO_RCVBUF, &buf_bytes, sizeof buf_bytes);
    size_t sent = 0;
    while (sent < size) {
        ssize_t n = ::send(sv[0], data + sent, size - sent, MSG_DONTWAIT);
        if (n <= 0) break;
        sent += static_cast<size_t>(n);
    }
    shutdown(sv[0], SHUT_WR);

    serving::Options opt;
    opt.poll_ns = 0;
    opt.max_gets = 3;                       // yields often: the loop resumes from start/end
    opt.buckets = {0.001};
    std::vector<uint8_t> buf(2048);
    size_t start = 0, end = 0;
    uint64_t answered = 0;
    std::vector<uint8_t> out;                 // what the client receives
    uint8_t chunk[65536];
    auto drain = [&]() {
        ssize_t n;
        while ((n = ::recv(sv[0], chunk, sizeof chunk, MSG_DONTWAIT)) > 0)
            out.insert(out.end(), chunk, chunk + n);
    };
    for (int rounds = 0; rounds < 100000; ++rounds) {
        if (rounds == 2 && size > 0) index.withdraw(1 + data[0] % 3);
        serving::Result r = serving::serve_gets(index, sv[1], buf.data(), buf.size(), start, end, opt);
        check(r.start <= r.end && r.end <= buf.size());
        answered += r.gets;
        drain();                            // a call sends at most max_gets replies
        start = r.start;
        end = r.end;
        if (r.status == serving::Status::kClosed || r.status == serving::Status::kRecvError ||
            r.status == serving::Status::kSendError)
            break;
        if (r.status == serving::Status::kHandoff) {
            if (start == end) continue;     // a signal: call again
            start += 1;                     // the Python loop's part: consume (a byte of) it
        }
    }

    // The replies: OK headers, each followed by its copy's bytes.
    drain();
    size_t at = 0;
    uint64_t replies = 0;
    while (at < out.size()) {
        check(out.size() - at >= frames::kResponseBytes);
        frames::Response rs;
        frames::Limits lim{512, 512, 0, 0, 4096};
        check(frames::decode_response(out.data() + at, out.size() - at, lim, &rs) ==
              frames::FrameError::kOk);
        check(rs.code == 0 && (rs.size == 100 || rs.size == 0 || rs.size == 5000));
        at += frames::kResponseBytes;
        check(out.size() - at >= rs.size);
        for (size_t i = 0; i < rs.size; ++i) check(out[at + i] == 0x5a);
        at += rs.size;
        replies += 1;
    }
    check(replies == answered);
    for (uint64_t serial = 1; serial <= 3; ++serial) check(index.withdraw(serial) == 0);
    check(index.take_released().empty());
    close(sv[0]);
    close(sv[1]);
    return 0;
}
