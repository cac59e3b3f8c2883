// The node's native GET service (serving.hpp).
#include "serving.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <unordered_set>

#include <sys/socket.h>
#include <sys/uio.h>

#include "frames.hpp"

namespace kvstore_native::serving {

namespace {

constexpr uint8_t kGet = static_cast<uint8_t>(frames::Op::kGet);
constexpr uint8_t kShmTouch = static_cast<uint8_t>(frames::Op::kShmTouch);

int64_t now_ns() noexcept {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

double now_s() noexcept {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

}  // namespace

// ------------------------------------------------------------------ Index

Index::Index(const uint8_t* base, size_t length, size_t max_copies)
    : base_(base), length_(length), max_copies_(max_copies) {}

bool Index::publish(std::string_view key, const Copy& copy) {
    if (copy.offset > length_ || copy.size > length_ - copy.offset) return false;
    std::lock_guard<std::mutex> lock(mu_);
    std::string k(key);
    auto it = by_key_.find(k);
    if (it != by_key_.end()) {
        if (it->second.copy.serial == copy.serial) return true;
        uint32_t ignored;
        withdraw_locked(it->second.copy.serial, &ignored);   // the key's older copy
    }
    if (keys_.count(copy.serial) || by_key_.size() >= max_copies_) return false;
    auto [pos, _] = by_key_.emplace(std::move(k), Entry{copy, 0});
    keys_[copy.serial] = &pos->first;
    return true;
}

void Index::withdraw_locked(uint64_t serial, uint32_t* readers) {
    *readers = 0;
    auto k = keys_.find(serial);
    if (k != keys_.end()) {
        auto it = by_key_.find(*k->second);
        uint32_t r = it->second.readers;
        keys_.erase(k);
        by_key_.erase(it);
        if (r > 0) draining_[serial] = r;
        *readers = r;
        return;
    }
    auto d = draining_.find(serial);
    if (d != draining_.end()) *readers = d->second;
}

uint32_t Index::withdraw(uint64_t serial) {
    std::lock_guard<std::mutex> lock(mu_);
    uint32_t readers;
    withdraw_locked(serial, &readers);
    return readers;
}

std::vector<uint64_t> Index::take_released() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<uint64_t> out;
    out.swap(released_);
    return out;
}

void Index::set_lease(double until_s) { lease_until_.store(until_s); }

size_t Index::size() {
    std::lock_guard<std::mutex> lock(mu_);
    return by_key_.size();
}

Index::Entry* Index::servable_locked(std::string_view key, uint64_t object_id) {
    if (now_s() >= lease_until_.load()) return nullptr;   // fenced: Python answers
    auto it = by_key_.find(std::string(key));
    if (it == by_key_.end()) return nullptr;
    if (object_id != 0 && object_id != it->second.copy.object_id) return nullptr;
    return &it->second;
}

bool Index::serves(std::string_view key, uint64_t object_id) {
    std::lock_guard<std::mutex> lock(mu_);
    return servable_locked(key, object_id) != nullptr;
}

bool Index::acquire(std::string_view key, uint64_t object_id, Copy* out) {
    std::lock_guard<std::mutex> lock(mu_);
    Entry* e = servable_locked(key, object_id);
    if (e == nullptr) return false;
    e->readers += 1;
    *out = e->copy;
    gets_.fetch_add(1);
    return true;
}

bool Index::touch(std::string_view key, uint64_t object_id, Copy* out) {
    std::lock_guard<std::mutex> lock(mu_);
    Entry* e = servable_locked(key, object_id);
    if (e == nullptr) return false;
    *out = e->copy;
    gets_.fetch_add(1);
    return true;
}

void Index::release(uint64_t serial) {
    std::lock_guard<std::mutex> lock(mu_);
    auto k = keys_.find(serial);
    if (k != keys_.end()) {
        by_key_.find(*k->second)->second.readers -= 1;
        return;
    }
    auto d = draining_.find(serial);
    if (d != draining_.end() && --d->second == 0) {
        draining_.erase(d);
        released_.push_back(serial);
    }
}

bool Index::take_poller(int limit) {
    int n = pollers_.load();
    while (n < limit) {
        if (pollers_.compare_exchange_weak(n, n + 1)) return true;
    }
    return false;
}

void Index::give_poller() { pollers_.fetch_sub(1); }

// ------------------------------------------------------------------ serve_gets

namespace {

// The replies gathered for one sendmsg: a header and the value per GET, a header
// per SHM_TOUCH.
class Batch {
public:
    Batch(Index& index, const Options& opt, Result& res)
        : index_(index), opt_(opt), res_(res) {
        headers_.resize(opt.gather_frames * frames::kResponseBytes);
        iov_.reserve(opt.gather_frames * 2);
        held_.reserve(opt.gather_frames);
        started_.reserve(opt.gather_frames);
    }
    ~Batch() { drop(); }

    bool empty() const { return started_.empty(); }
    bool full() const {
        return started_.size() >= opt_.gather_frames || bytes_ >= opt_.gather_bytes;
    }

    // A GET's reply: OK with the copy's fields, then its value from the segment.
    void add(const Copy& c, int64_t started_ns) {
        header(c.object_id, c.size, c.checksum, started_ns, false);
        if (c.size) iov_.push_back({const_cast<uint8_t*>(index_.base() + c.offset), c.size});
        held_.push_back(c.serial);
        bytes_ += c.size;
    }

    // An SHM_TOUCH's reply: OK with the frame's object_id, nothing else (as Python's).
    void add_touch(uint64_t object_id, int64_t started_ns) {
        header(object_id, 0, 0, started_ns, true);
    }

    // Send everything; false (``error`` set) when the socket failed. Readers are
    // released either way.
    bool send(int fd, int* error) {
        bool ok = true;
        size_t at = 0;
        while (at < iov_.size()) {
            msghdr m{};
            m.msg_iov = iov_.data() + at;
            m.msg_iovlen = std::min<size_t>(iov_.size() - at, 1024);
            ssize_t n = ::sendmsg(fd, &m, MSG_NOSIGNAL);
            if (n < 0) {
                if (errno == EINTR) continue;
                *error = errno;
                ok = false;
                break;
            }
            size_t left = static_cast<size_t>(n);
            while (at < iov_.size() && left >= iov_[at].iov_len) left -= iov_[at++].iov_len;
            if (left) {
                iov_[at].iov_base = static_cast<uint8_t*>(iov_[at].iov_base) + left;
                iov_[at].iov_len -= left;
            }
        }
        if (ok) {
            int64_t done = now_ns();
            for (auto [t, touch] : started_) {
                double s = (done - t) * 1e-9;
                size_t b = std::lower_bound(opt_.buckets.begin(), opt_.buckets.end(), s)
                           - opt_.buckets.begin();
                (touch ? res_.touch_seconds : res_.seconds) += s;
                (touch ? res_.touch_histogram : res_.histogram)[b] += 1;
            }
        }
        drop();
        return ok;
    }

private:
    void header(uint64_t object_id, uint64_t size, uint64_t checksum, int64_t started_ns,
                bool touch) {
        uint8_t* h = headers_.data() + started_.size() * frames::kResponseBytes;
        frames::Response r{};
        r.object_id = object_id;
        r.size = size;
        r.checksum = checksum;
        frames::encode_response(r, h);
        iov_.push_back({h, frames::kResponseBytes});
        started_.push_back({started_ns, touch});
    }

    void drop() {
        for (uint64_t serial : held_) index_.release(serial);
        held_.clear();
        started_.clear();
        iov_.clear();
        bytes_ = 0;
    }

    Index& index_;
    const Options& opt_;
    Result& res_;
    std::vector<uint8_t> headers_;
    std::vector<iovec> iov_;
    std::vector<uint64_t> held_;                      // serials read (GETs), released after
    std::vector<std::pair<int64_t, bool>> started_;   // per reply: its frame's time, a touch
    size_t bytes_ = 0;
};

}  // namespace

Result serve_gets(Index& index, int fd, uint8_t* buf, size_t cap, size_t start, size_t end,
                  Options& opt) noexcept {
    Result res;
    res.histogram.assign(opt.buckets.size() + 1, 0);
    res.touch_histogram.assign(opt.buckets.size() + 1, 0);
    std::unordered_set<uint64_t> touched;      // serials already in res.touches
    const int64_t began = now_ns();
    int64_t& answered = opt.answered_ns;       // when the last batch went out
    bool& eager = opt.eager;                   // the client came back within poll_ns
    size_t committed = start;                  // frames before it are answered (sent)
    try {
        Batch batch(index, opt, res);
        auto finish = [&](Status s) {
            res.status = s;
            res.start = start;
            res.end = end;
            return res;
        };
        auto flush = [&]() -> bool {
            if (batch.empty()) return true;
            if (!batch.send(fd, &res.error)) return false;
            answered = now_ns();
            committed = start;
            return true;
        };
        while (true) {
            const size_t avail = end - start;
            if (avail >= frames::kRequestBytes) {
                const uint8_t* h = buf + start;
                const bool touch = h[0] == kShmTouch;
                if ((h[0] != kGet && !touch) || h[1] != 0) {   // not ours (or malformed)
                    if (!flush()) return finish(Status::kSendError);
                    return finish(Status::kHandoff);
                }
                frames::Request rq;
                frames::Limits lim{static_cast<uint32_t>(opt.max_key_bytes), 0, 0, 0, 0};
                if (frames::decode_request(h, avail, lim, &rq) != frames::FrameError::kOk
                        || rq.key_len == 0) {
                    if (!flush()) return finish(Status::kSendError);
                    return finish(Status::kHandoff);
                }
                const size_t frame = frames::kRequestBytes + rq.key_len;
                if (avail >= frame) {
                    if (res.gets >= opt.max_gets || now_ns() - began >= opt.max_ns) {
                        if (!flush()) return finish(Status::kSendError);
                        return finish(Status::kYield);
                    }
                    std::string_view key(reinterpret_cast<const char*>(h) + frames::kRequestBytes,
                                         rq.key_len);
                    Copy c;
                    if (index.epoch() != opt.epoch
                            || !(touch ? index.touch(key, rq.object_id, &c)
                                       : index.acquire(key, rq.object_id, &c))) {
                        if (!flush()) return finish(Status::kSendError);
                        return finish(Status::kHandoff);
                    }
                    if (touch)
                        batch.add_touch(rq.object_id, now_ns());
                    else
                        batch.add(c, now_ns());
                    start += frame;
                    res.gets += 1;
                    res.bytes += c.size;
                    if (touched.insert(c.serial).second) {
                        res.touches.push_back(c.slot);
                        res.touches.push_back(static_cast<int64_t>(c.serial));
                    }
                    if (batch.full() && !flush()) return finish(Status::kSendError);
                    continue;
                }
            }
            // Not a whole frame at hand: answer what was gathered, then receive.
            if (!flush()) return finish(Status::kSendError);
            if (start == end) {
                start = end = 0;
            } else if (cap - end < frames::kRequestBytes + opt.max_key_bytes) {
                std::memmove(buf, buf + start, end - start);
                end -= start;
                start = 0;
            }
            committed = start;
            const bool idle = start == end;
            ssize_t n = -1;
            if (idle && eager && opt.poll_ns > 0 && index.take_poller(opt.poll_limit)) {
                const int64_t until = now_ns() + opt.poll_ns;
                do {
                    n = ::recv(fd, buf + end, cap - end, MSG_DONTWAIT);
                } while (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                         && now_ns() < until);
                index.give_poller();
            }
            // Before sleeping, hand the reads served so far to Python for accounting
            // (counters, recency, metrics): exact whenever the connection waits.
            if (n < 0 && idle && res.gets > 0) return finish(Status::kYield);
            if (n < 0) n = ::recv(fd, buf + end, cap - end, 0);
            if (n > 0) {
                if (idle) eager = answered != 0 && now_ns() - answered < opt.poll_ns;
                end += static_cast<size_t>(n);
                continue;
            }
            if (n == 0) return finish(Status::kClosed);
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                // SO_RCVTIMEO ran out: idle, wait on (as Python's idle read does);
                // inside a frame, Python's reader decides (its stall rules).
                if (idle) continue;
                return finish(Status::kHandoff);
            }
            if (errno == EINTR) return finish(Status::kHandoff);   // Python runs the handlers
            res.error = errno;
            return finish(Status::kRecvError);
        }
    } catch (...) {
        // std::bad_alloc: the frames not answered yet stay unread (the batch's
        // readers were released by its destructor) and Python's loop serves them.
        res.status = Status::kHandoff;
        res.start = committed;
        res.end = end;
        return res;
    }
}

}  // namespace kvstore_native::serving
