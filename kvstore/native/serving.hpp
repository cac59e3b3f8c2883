// The node's native GET service: DRAM copies a data connection may send without
// Python, and the loop that serves a connection's GET frames from them (and the
// SHM_TOUCH frames of same-host readers that copied one without the node).
//
// Pure C++ (no Python types): serving_bind.cpp binds it with the GIL released.
// Step 2 of docs/data-plane.md "Next" for GET (issue 33): a connection's frame
// loop stays Python's, which hands the socket to serve_gets() whenever it has
// no reply pending, and takes it back at the first frame that is not a GET of
// a served copy (left unread in the buffer, for the Python loop).
//
//     Python (the node's lock held)                 serve_gets (any connection thread)
//     publish(key, serial, offset, ...)  a read     acquire(key) -> readers + 1, copy fields
//     withdraw(serial) -> readers still sending     sendmsg(header, segment + offset)
//       (before the range is hidden or freed;       release(serial) -> readers - 1; the last
//        readers > 0: the free waits for them)        of a withdrawn copy -> released()
//     take_released() -> serials to free now
//     set_lease(until): nothing is served past it (the node's fence, lease.py)
//
// Why the bytes sent are the object's: a range is freed (and may be reused)
// only after withdraw() said no native reader is on it, or after the last one
// released it (take_released); a reader acquires only a copy in the key map,
// under the same mutex; objects are immutable. So a range being sent is never
// written (the rule the node's ``obj.refs`` keeps for its Python readers).
//
// Thread safety: every Index method takes its one mutex; serve_gets holds it
// only inside acquire and release, never across a system call.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvstore_native::serving {

// What serve_gets needs of a copy, taken under the mutex.
struct Copy {
    uint64_t offset = 0;      // in the segment
    uint64_t size = 0;        // value bytes
    uint64_t checksum = 0;    // xxh3-64 of the value
    uint64_t object_id = 0;   // the version
    uint64_t serial = 0;      // the DRAM allocation's serial (unique per node lifetime)
    int64_t slot = -1;        // the object's slot in the node's table (read accounting)
};

class Index {
public:
    // ``base``/``length``: the DRAM segment (a copy's range must lie inside it);
    // at most ``max_copies`` servable at once (about 200 B of memory each).
    Index(const uint8_t* base, size_t length, size_t max_copies);

    // A copy becomes servable under ``key`` (replacing another serial of that key,
    // which counts as withdrawn). False when its range is not inside the segment,
    // or max_copies are served (it stays Python's to send).
    bool publish(std::string_view key, const Copy& copy);
    // No new reader of ``serial``; returns the readers still sending from it (its
    // range must not be reused until take_released() lists it).
    uint32_t withdraw(uint64_t serial);
    // Serials withdrawn with readers whose last reader has left since the last call.
    std::vector<uint64_t> take_released();
    // Until when (CLOCK_MONOTONIC seconds) copies may be served; <= now: none.
    void set_lease(double until_s);
    size_t size();                        // copies servable now
    // The token file's generation: serve_gets hands every GET back once it moved
    // past the one its caller checked the connection's token against.
    uint64_t epoch() const { return epoch_.load(); }
    void bump_epoch() { epoch_.fetch_add(1); }
    uint64_t gets() const { return gets_.load(); }   // copies acquired (GETs answered)

    // Whether a GET of ``key`` (object_id 0: any version) would be served now.
    bool serves(std::string_view key, uint64_t object_id);

    // serve_gets' side: a reader on the copy of ``key`` (object_id 0: any version).
    bool acquire(std::string_view key, uint64_t object_id, Copy* out);
    // A read made without the node (a same-host copy: SHM_TOUCH), counted as a GET;
    // no reader is taken (nothing is sent from the copy).
    bool touch(std::string_view key, uint64_t object_id, Copy* out);
    void release(uint64_t serial);

    const uint8_t* base() const { return base_; }
    bool take_poller(int limit);          // a busy-poll slot (at most ``limit`` at once)
    void give_poller();

private:
    struct Entry {
        Copy copy;
        uint32_t readers = 0;
    };
    void withdraw_locked(uint64_t serial, uint32_t* readers);
    // The servable entry of ``key`` (object_id 0: any version), or null (also fenced).
    Entry* servable_locked(std::string_view key, uint64_t object_id);

    const uint8_t* base_;
    size_t length_;
    size_t max_copies_;
    std::mutex mu_;
    std::unordered_map<std::string, Entry> by_key_;           // servable copies
    std::unordered_map<uint64_t, const std::string*> keys_;   // serial -> its key in by_key_
    std::unordered_map<uint64_t, uint32_t> draining_;         // withdrawn, readers > 0
    std::vector<uint64_t> released_;
    std::atomic<double> lease_until_{0.0};
    std::atomic<int> pollers_{0};
    std::atomic<uint64_t> gets_{0};
    std::atomic<uint64_t> epoch_{0};
};

// How serve_gets ended.
enum class Status : int {
    kHandoff = 0,    // a frame for Python at ``start`` (or a partial one, or a signal)
    kYield = 1,      // served its quota (max_gets / max_ns), or would sleep with reads
                     // not accounted yet: account, then call again
    kClosed = 2,     // the peer closed the connection (recv returned 0)
    kRecvError = 3,  // recv failed: ``error`` is errno
    kSendError = 4,  // sendmsg failed (EAGAIN: SO_SNDTIMEO ran out): ``error`` is errno
};

struct Options {
    int64_t poll_ns = 200000;     // busy-poll this long for a client back that soon
    int poll_limit = 1;           // connections busy-polling at once (Index::take_poller)
    uint64_t max_gets = 4096;     // per call, then kYield
    int64_t max_ns = 50000000;    // per call, then kYield (at the next frame boundary)
    size_t max_key_bytes = 512;
    size_t gather_bytes = 4 << 20;   // values held back for one sendmsg, at most
    size_t gather_frames = 255;      // replies per sendmsg, at most (2 iovecs each)
    std::vector<double> buckets;     // the request histogram's bounds (seconds)
    uint64_t epoch = 0;              // Index::epoch() the caller checked the token against
    // Carried from call to call (one Options per connection):
    int64_t answered_ns = 0;         // when the last replies went out (CLOCK_MONOTONIC)
    bool eager = false;              // the client came back within poll_ns of them
};

struct Result {
    Status status = Status::kHandoff;
    int error = 0;
    size_t start = 0, end = 0;           // the buffer's unread bytes now
    uint64_t gets = 0, bytes = 0;        // served by this call
    std::vector<uint64_t> histogram;     // per bucket, then +Inf (GETs)
    double seconds = 0;                  // summed time of the gets (frame read -> sent)
    std::vector<uint64_t> touch_histogram;   // the same for SHM_TOUCH frames
    double touch_seconds = 0;
    std::vector<int64_t> touches;        // (slot, serial) pairs of the copies read, once each
                                         // (by a GET or an SHM_TOUCH)
};

// Serve the GET frames of connection ``fd`` (a blocking stream socket; its
// SO_RCVTIMEO / SO_SNDTIMEO apply) from ``index``: frames are parsed from
// ``buf[start:end]`` and more are received into ``buf`` (``cap`` bytes; unread
// bytes are moved to its front when room runs out). A GET whose key is served
// (and whose object_id is 0 or the copy's) is answered OK with the value from
// the segment; an SHM_TOUCH of a served copy is answered OK (header only) and
// counted as a read, as Python's loop does; anything else (another op, a parent
// key, an unknown or withdrawn key, a fenced node, an oversized frame) ends the
// call with kHandoff, the frame unread. Replies are gathered while more frames
// are at hand and sent before any wait or return.
Result serve_gets(Index& index, int fd, uint8_t* buf, size_t cap, size_t start, size_t end,
                  Options& opt) noexcept;

}  // namespace kvstore_native::serving
