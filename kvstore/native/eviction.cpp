// EvictionCore and GhostHistory (see eviction.hpp): pure C++, no Python.
#include "eviction.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace kvstore_native {

uint64_t fnv1a64(std::string_view bytes) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (unsigned char c : bytes) {
        h ^= c;
        h *= 0x100000001b3ull;
    }
    return h ? h : 1;   // 0 marks an empty ghost cell
}

// ------------------------------------------------------------------ ghosts

size_t GhostHistory::home(uint64_t fp) const {
    return size_t((fp * 0x9E3779B97F4A7C15ull) >> 32) & (index_.size() - 1);
}

size_t GhostHistory::find(uint64_t fp) const {
    if (index_.empty()) return 0;
    const size_t mask = index_.size() - 1;
    for (size_t i = home(fp);; i = (i + 1) & mask) {
        if (index_[i] == 0) return index_.size();
        if (fps_[index_[i] - 1] == fp) return i;
    }
}

void GhostHistory::unindex(size_t cell) {
    const size_t mask = index_.size() - 1;
    size_t hole = cell;
    for (size_t j = (cell + 1) & mask; index_[j] != 0; j = (j + 1) & mask) {
        const size_t h = home(fps_[index_[j] - 1]);
        const bool stays = hole <= j ? (hole < h && h <= j) : (hole < h || h <= j);
        if (!stays) {
            index_[hole] = index_[j];
            hole = j;
        }
    }
    index_[hole] = 0;
}

void GhostHistory::forget(size_t cell) {
    fps_[index_[cell] - 1] = 0;
    unindex(cell);
    --live_;
}

void GhostHistory::reindex(size_t cells) {
    index_.assign(cells, 0);
    const size_t ring_mask = fps_.size() - 1, mask = cells - 1;
    for (uint64_t p = head_; p < tail_; ++p) {
        const size_t r = size_t(p) & ring_mask;
        if (fps_[r] == 0) continue;
        size_t i = home(fps_[r]);
        while (index_[i] != 0) i = (i + 1) & mask;
        index_[i] = uint32_t(r + 1);
    }
}

void GhostHistory::relayout(size_t capacity) {
    std::vector<uint64_t> fps(capacity, 0);
    std::vector<uint32_t> freqs(capacity, 0);
    size_t n = 0;
    for (uint64_t p = head_; p < tail_; ++p) {
        const size_t r = size_t(p) & (fps_.size() - 1);
        if (fps_[r] == 0) continue;
        fps[n] = fps_[r];
        freqs[n++] = freqs_[r];
    }
    fps_.swap(fps);
    freqs_.swap(freqs);
    head_ = 0;
    tail_ = n;
    reindex(index_.empty() ? 16 : index_.size());
}

uint32_t GhostHistory::take(uint64_t fp) {
    const size_t cell = find(fp);
    if (cell == index_.size()) return 0;
    const uint32_t freq = freqs_[index_[cell] - 1];
    forget(cell);
    return freq;
}

void GhostHistory::put(uint64_t fp, uint32_t freq) {
    const size_t cell = find(fp);
    if (cell != index_.size()) forget(cell);          // refreshed: the newest now
    const size_t capacity = fps_.size();
    while (head_ < tail_ && fps_[size_t(head_) & (capacity - 1)] == 0) ++head_;
    if (tail_ - head_ == capacity) {
        // Full: compact in place when half of it is dead, else twice the room.
        relayout(capacity == 0 ? 16 : live_ * 2 <= capacity ? capacity : capacity * 2);
    }
    if ((live_ + 1) * 4 > index_.size() * 3) reindex(index_.empty() ? 16 : index_.size() * 2);
    const size_t r = size_t(tail_++) & (fps_.size() - 1);
    fps_[r] = fp;
    freqs_[r] = freq;
    const size_t mask = index_.size() - 1;
    size_t i = home(fp);
    while (index_[i] != 0) i = (i + 1) & mask;
    index_[i] = uint32_t(r + 1);
    ++live_;
}

void GhostHistory::trim(size_t limit) {
    while (live_ > limit && head_ < tail_) {
        const uint64_t fp = fps_[size_t(head_++) & (fps_.size() - 1)];
        if (fp != 0) forget(find(fp));
    }
}

std::string GhostHistory::check() const {
    if (fps_.size() & (fps_.size() - 1)) return "ghost ring not a power of two";
    if (tail_ - head_ > fps_.size()) return "ghost ring overfull";
    size_t n = 0;
    for (uint64_t p = head_; p < tail_; ++p) {
        const uint64_t fp = fps_[size_t(p) & (fps_.size() - 1)];
        if (fp == 0) continue;
        ++n;
        const size_t cell = find(fp);
        if (cell == index_.size() || index_[cell] - 1 != (size_t(p) & (fps_.size() - 1)))
            return "ghost not indexed at its ring position";
    }
    size_t cells = 0;
    for (uint32_t c : index_) cells += c != 0;
    if (n != live_ || cells != live_) return "ghost count drifted";
    return "";
}

// ------------------------------------------------------------------ core

EvictionCore::EvictionCore(const PolicyParams& params)
    : p_(params), clock_(-std::numeric_limits<double>::infinity()) {
    int k = int(params.kind);
    if (k < 0 || k > 3) throw std::invalid_argument("unknown policy kind " + std::to_string(k));
}

void EvictionCore::reach(int64_t slot) {
    while (slots() <= size_t(slot)) {
        std::unique_ptr<Entry[]> chunk(new Entry[kChunk]);
        for (size_t i = 0; i < kChunk; ++i)
            chunk[i] = Entry{0.0, 0.0, 0, 0, -1, 0, 0, 0, 0, -1};
        chunks_.push_back(std::move(chunk));
    }
}

bool EvictionCore::tracked(int64_t slot) const {
    if (slot < 0 || size_t(slot) >= slots()) return false;
    return at(slot).seq != 0;
}

bool EvictionCore::contains(int64_t slot) const {
    if (p_.kind == PolicyKind::NONE)
        return slot >= 0 && size_t(slot) < none_size_.size() && none_size_[size_t(slot)] != 0;
    return tracked(slot);
}

uint64_t EvictionCore::size_of(int64_t slot) const {
    if (p_.kind == PolicyKind::NONE) return contains(slot) ? none_size_[size_t(slot)] - 1 : 0;
    return tracked(slot) ? at(slot).size : 0;
}

uint32_t EvictionCore::freq(int64_t slot) const { return tracked(slot) ? at(slot).freq : 0; }

int32_t EvictionCore::live_parent(const Entry& e) const {
    if (e.parent < 0 || !tracked(e.parent) || at(e.parent).gen != e.parent_gen) return -1;
    return e.parent;
}

double EvictionCore::credit_s() const {
    const double full = p_.protect_s, knee = p_.fade_ratio * full;
    return retention_ <= knee ? full : full * knee / retention_;
}

void EvictionCore::insert(int64_t slot, uint64_t size, double now, int64_t parent, uint64_t fp) {
    if (slot < 0 || slot > kMaxSlot)
        throw std::invalid_argument("slot out of range: " + std::to_string(slot));
    if (p_.kind == PolicyKind::NONE) {
        if (none_size_.size() <= size_t(slot)) none_size_.resize(size_t(slot) + 1, 0);
        if (none_size_[size_t(slot)]) return;
        none_size_[size_t(slot)] = size + 1;
        ++count_;
        used_ += size;
        return;
    }
    if (tracked(slot)) {
        access(slot, now);
        return;
    }
    clock_ = std::max(clock_, now);
    reach(slot);
    const int32_t par = tracked(parent) ? int32_t(parent) : -1;
    Entry& e = at(slot);
    e = Entry{now, 0.0, ++seq_, size, par, par >= 0 ? at(par).gen : 0, e.gen + 1, 0, 1, -1};
    ++count_;
    used_ += size;
    if (par >= 0) {
        ++at(par).children;
        if (p_.leaf_first) heap_remove(par);   // an inner node leaves the heap
    }
    if (p_.kind == PolicyKind::DEFAULT && fp && ghosts_.size()) e.freq += ghosts_.take(fp);
    push(int32_t(slot));
}

void EvictionCore::access(int64_t slot, double now) {
    if (p_.kind == PolicyKind::NONE || !tracked(slot)) return;
    clock_ = std::max(clock_, now);
    Entry& e = at(slot);
    ++e.freq;
    e.last_access = now;
    e.seq = ++seq_;
    push(int32_t(slot));
}

void EvictionCore::prefetch(int64_t slot, double now) {
    if (p_.kind != PolicyKind::DEFAULT || !tracked(slot)) return;
    Entry& e = at(slot);
    if (now < e.last_access) return;
    clock_ = std::max(clock_, now);
    e.last_access = now;
    e.seq = ++seq_;
    push(int32_t(slot));
}

void EvictionCore::remove(int64_t slot, uint64_t fp) {
    if (p_.kind == PolicyKind::NONE) {
        if (!contains(slot)) return;
        used_ -= none_size_[size_t(slot)] - 1;
        none_size_[size_t(slot)] = 0;
        --count_;
        return;
    }
    if (!tracked(slot)) return;
    heap_remove(int32_t(slot));
    Entry& e = at(slot);
    used_ -= e.size;
    --count_;
    if (slot == proposed_) {
        proposed_ = -1;
        if (p_.kind == PolicyKind::DEFAULT) {   // an eviction: the frontier's age feeds retention
            double age = clock_ - (e.last_access + e.score);
            retention_ += p_.retention_weight * (std::max(age, 0.0) - retention_);
        }
    }
    const int32_t par = live_parent(e);
    e.seq = 0;
    if (par >= 0) {
        Entry& pe = at(par);
        --pe.children;
        if (p_.leaf_first && pe.children == 0) push(par);   // a leaf again
    }
    if (p_.kind == PolicyKind::DEFAULT && p_.ghost_factor > 0 && fp) {   // fp 0: no key given
        ghosts_.put(fp, e.freq);
        size_t limit = std::max<size_t>(size_t(p_.ghost_factor * double(count_)), 64);
        ghosts_.trim(limit);
    }
}

int64_t EvictionCore::pop() {
    if (heap_.empty()) return -1;
    int32_t top = heap_[0];
    heap_remove(top);
    return top;
}

void EvictionCore::restore(const std::vector<int64_t>& held) {
    proposed_ = -1;
    for (int64_t slot : held) {
        if (!tracked(slot)) continue;
        const Entry& e = at(slot);
        if (e.heap_pos >= 0 || (p_.leaf_first && e.children > 0)) continue;   // requeued since
        requeue(int32_t(slot));
    }
}

// ------------------------------------------------------------------ heap

bool EvictionCore::less(int32_t a, int32_t b) const {
    const Entry& x = at(a);
    const Entry& y = at(b);
    switch (p_.kind) {
        case PolicyKind::LFU:
            if (x.freq != y.freq) return x.freq < y.freq;
            if (x.last_access != y.last_access) return x.last_access < y.last_access;
            return x.seq < y.seq;
        case PolicyKind::DEFAULT: {
            double px = x.last_access + x.score, py = y.last_access + y.score;
            if (px != py) return px < py;
            return x.seq < y.seq;
        }
        default:
            if (x.last_access != y.last_access) return x.last_access < y.last_access;
            return x.seq < y.seq;
    }
}

void EvictionCore::push(int32_t slot) {
    Entry& e = at(slot);
    if (p_.leaf_first && e.children > 0) {
        heap_remove(slot);
        return;
    }
    if (p_.kind == PolicyKind::DEFAULT) e.score = e.freq > 1 ? credit_s() : 0.0;
    if (e.heap_pos < 0) {
        requeue(slot);
    } else {
        sift_up(size_t(e.heap_pos));
        sift_down(size_t(at(slot).heap_pos));
    }
}

void EvictionCore::requeue(int32_t slot) {
    heap_.push_back(slot);
    place(heap_.size() - 1, slot);
    sift_up(heap_.size() - 1);
}

void EvictionCore::heap_remove(int32_t slot) {
    Entry& e = at(slot);
    if (e.heap_pos < 0) return;
    size_t i = size_t(e.heap_pos);
    e.heap_pos = -1;
    int32_t last = heap_.back();
    heap_.pop_back();
    if (i == heap_.size()) return;
    place(i, last);
    sift_up(i);
    sift_down(size_t(at(last).heap_pos));
}

void EvictionCore::sift_up(size_t i) {
    int32_t s = heap_[i];
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (!less(s, heap_[up])) break;
        place(i, heap_[up]);
        i = up;
    }
    place(i, s);
}

void EvictionCore::sift_down(size_t i) {
    int32_t s = heap_[i];
    const size_t n = heap_.size();
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && less(heap_[c + 1], heap_[c])) ++c;
        if (!less(heap_[c], s)) break;
        place(i, heap_[c]);
        i = c;
    }
    place(i, s);
}

// ------------------------------------------------------------------ inspecting

size_t EvictionCore::native_bytes() const {
    return chunks_.size() * kChunk * sizeof(Entry) + chunks_.capacity() * sizeof(void*) +
           heap_.capacity() * sizeof(int32_t) + none_size_.capacity() * sizeof(uint64_t) +
           ghosts_.bytes();
}

std::string EvictionCore::check() const {
    if (p_.kind == PolicyKind::NONE) {
        size_t n = 0;
        uint64_t used = 0;
        for (uint64_t s : none_size_)
            if (s) ++n, used += s - 1;
        if (n != count_) return "count drifted";
        if (used != used_) return "used bytes drifted";
        return heap_.empty() ? "" : "NONE has a heap";
    }
    std::vector<uint32_t> children(slots(), 0);
    size_t n = 0;
    uint64_t used = 0;
    for (size_t s = 0; s < slots(); ++s) {
        const Entry& e = at(int64_t(s));
        if (!e.seq) {
            if (e.heap_pos >= 0) return "untracked slot " + std::to_string(s) + " in the heap";
            continue;
        }
        ++n;
        used += e.size;
        int32_t par = live_parent(e);
        if (par >= 0) ++children[size_t(par)];
    }
    if (n != count_) return "count drifted";
    if (used != used_) return "used bytes drifted";
    for (size_t s = 0; s < slots(); ++s) {
        const Entry& e = at(int64_t(s));
        if (!e.seq) continue;
        if (e.children != children[s]) return "children of slot " + std::to_string(s) + " drifted";
        bool should = !(p_.leaf_first && e.children > 0);
        if ((e.heap_pos >= 0) != should)
            return "slot " + std::to_string(s) + (should ? " missing from" : " wrongly in") + " the heap";
    }
    for (size_t i = 0; i < heap_.size(); ++i) {
        if (at(heap_[i]).heap_pos != int32_t(i)) return "heap position drifted";
        if (i > 0 && less(heap_[i], heap_[(i - 1) / 2])) return "heap order broken";
    }
    return ghosts_.check();
}

}  // namespace kvstore_native
