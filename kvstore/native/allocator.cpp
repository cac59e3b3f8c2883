// OffsetAllocatorCore (see allocator.hpp): pure C++, no Python.
#include "allocator.hpp"

#include <algorithm>
#include <atomic>
#include <iterator>
#include <stdexcept>

namespace kvstore_native {

// One serial counter for every allocator of the process (see allocator.hpp).
static std::atomic<uint64_t> last_serial{0};

OffsetAllocatorCore::OffsetAllocatorCore(uint64_t capacity, uint64_t alignment)
    : capacity_(capacity), alignment_(alignment), align_shift_(0) {
    if (alignment == 0 || (alignment & (alignment - 1)) != 0)
        throw std::invalid_argument("alignment must be a power of two, got " +
                                    std::to_string(alignment));
    while ((uint64_t(1) << align_shift_) != alignment) ++align_shift_;
    if ((capacity >> align_shift_) >= kEmptyUnits)
        throw std::invalid_argument("capacity / alignment must be under 2**40 - 1, got " +
                                    std::to_string(capacity) + " / " + std::to_string(alignment));
    if (capacity) add_free(0, capacity);
}

bool OffsetAllocatorCore::allocate(uint64_t size, Allocation* out) {
    const uint64_t need = std::max<uint64_t>(size, 1);
    if (need > capacity_) return false;
    const uint64_t want = (need + alignment_ - 1) & ~(alignment_ - 1);  // no overflow: need <= capacity
    uint64_t start, length, reserved;
    auto it = by_size_.lower_bound({want, 0});
    if (it != by_size_.end()) {
        length = it->first;
        start = it->second;
        reserved = want;
    } else {
        // No aligned fit; the tail extent may still hold it, clipped at capacity.
        if (by_start_.empty()) return false;
        auto last = std::prev(by_start_.end());
        if (last->first + last->second != capacity_ || last->first + need > capacity_) return false;
        start = last->first;
        length = last->second;
        reserved = std::min(want, length);
    }
    remove_free(start, length);
    if (length > reserved) add_free(start + reserved, length - reserved);
    used_ += reserved;
    const uint64_t serial = last_serial.fetch_add(1, std::memory_order_relaxed) + 1;
    if (serial > kMaxSerial) throw std::overflow_error("allocation serials ran out");
    insert_live(Slot::make(start >> align_shift_, serial));
    *out = Allocation{start, size, reserved, serial};
    return true;
}

uint64_t OffsetAllocatorCore::reserved_for(uint64_t offset, uint64_t size) const {
    const uint64_t need = std::max<uint64_t>(size, 1);
    if (offset >= capacity_ || need > capacity_) return 0;   // never allocated so: no match
    const uint64_t want = (need + alignment_ - 1) & ~(alignment_ - 1);
    return std::min(want, capacity_ - offset);
}

void OffsetAllocatorCore::free(uint64_t offset, uint64_t serial, uint64_t size, uint64_t reserved) {
    size_t i = find_live(offset);
    if (i == live_.size() || live_[i].serial() != serial || reserved != reserved_for(offset, size))
        throw std::invalid_argument(
            "free of an allocation that is not live here (double free or foreign): offset " +
            std::to_string(offset) + ", serial " + std::to_string(serial));
    erase_live(i);
    used_ -= reserved;
    uint64_t start = offset, end = offset + reserved;
    auto right = by_start_.lower_bound(start);  // first free extent at or after start
    if (right != by_start_.begin()) {
        auto left = std::prev(right);
        if (left->first + left->second == start) {
            start = left->first;
            remove_free(left->first, left->second);
        }
    }
    right = by_start_.find(end);
    if (right != by_start_.end()) {
        uint64_t len = right->second;
        remove_free(end, len);
        end += len;
    }
    add_free(start, end - start);
}

void OffsetAllocatorCore::add_free(uint64_t start, uint64_t length) {
    by_size_.emplace(length, start);
    by_start_.emplace(start, length);
}

void OffsetAllocatorCore::remove_free(uint64_t start, uint64_t length) {
    by_size_.erase({length, start});
    by_start_.erase(start);
}

// ---------------------------------------------------------------- live table

size_t OffsetAllocatorCore::home(uint64_t units) const {
    // Fibonacci hashing of the offset in alignment units (Knuth, TAOCP vol. 3, 6.4).
    const uint64_t h = units * 0x9E3779B97F4A7C15ull;
    return size_t(h >> 32) & (live_.size() - 1);
}

size_t OffsetAllocatorCore::find_live(uint64_t offset) const {
    if (live_.empty() || (offset & (alignment_ - 1)) || offset >= capacity_) return live_.size();
    const uint64_t units = offset >> align_shift_;
    const size_t mask = live_.size() - 1;
    for (size_t i = home(units);; i = (i + 1) & mask) {
        if (live_[i].units() == units) return i;
        if (live_[i].empty()) return live_.size();
    }
}

void OffsetAllocatorCore::insert_live(const Slot& s) {
    if ((live_count_ + 1) * 4 > live_.size() * 3) grow_live();
    const size_t mask = live_.size() - 1;
    size_t i = home(s.units());
    while (!live_[i].empty()) i = (i + 1) & mask;
    live_[i] = s;
    ++live_count_;
}

void OffsetAllocatorCore::erase_live(size_t i) {
    // Backward-shift deletion: no tombstones, so probe lengths stay those of the live keys.
    const size_t mask = live_.size() - 1;
    size_t hole = i;
    for (size_t j = (i + 1) & mask; !live_[j].empty(); j = (j + 1) & mask) {
        size_t h = home(live_[j].units());
        // j may move to the hole unless its home lies cyclically in (hole, j].
        bool stays = hole <= j ? (hole < h && h <= j) : (hole < h || h <= j);
        if (!stays) {
            live_[hole] = live_[j];
            hole = j;
        }
    }
    live_[hole] = Slot::make(kEmptyUnits, 0);
    --live_count_;
}

void OffsetAllocatorCore::grow_live() {
    std::vector<Slot> old;
    old.swap(live_);
    live_.assign(old.empty() ? 16 : old.size() * 2, Slot::make(kEmptyUnits, 0));
    live_count_ = 0;
    for (const Slot& s : old)
        if (!s.empty()) insert_live(s);
}

std::string OffsetAllocatorCore::check() const {
    // Live ranges are not stored with their ends: each one runs to the next start
    // (free or live) or to capacity; the free extents must fit that tiling exactly.
    struct Start { uint64_t start, length; bool free; };   // length: free extents only
    std::vector<Start> starts;
    uint64_t free_sum = 0, live_n = 0;
    if (by_size_.size() != by_start_.size()) return "free indexes differ";
    for (auto& [start, length] : by_start_) {
        if (!by_size_.count({length, start})) return "free extent missing from the size index";
        starts.push_back({start, length, true});
        free_sum += length;
    }
    for (const Slot& s : live_) {
        if (s.empty()) continue;
        const uint64_t offset = s.units() << align_shift_;
        if (find_live(offset) == live_.size()) return "live slot unreachable by probing";
        if (s.serial() == 0 || s.serial() > last_serial.load()) return "serial out of range";
        starts.push_back({offset, 0, false});
        ++live_n;
    }
    if (live_n != live_count_) return "live count drifted";
    if (free_sum + used_ != capacity_) return "used + free != capacity";
    std::sort(starts.begin(), starts.end(),
              [](const Start& a, const Start& b) { return a.start < b.start; });
    uint64_t live_sum = 0;
    for (size_t k = 0; k < starts.size(); ++k) {
        const Start& r = starts[k];
        const uint64_t next = k + 1 < starts.size() ? starts[k + 1].start : capacity_;
        if (k == 0 && r.start != 0) return "gap at 0";
        if (next <= r.start) return "two ranges start at " + std::to_string(r.start);
        if (r.start & (alignment_ - 1)) return "unaligned range at " + std::to_string(r.start);
        const uint64_t length = next - r.start;
        if (r.free) {
            if (r.length != length) return "free extent at " + std::to_string(r.start) + " overlaps or leaves a gap";
            if (k > 0 && starts[k - 1].free)
                return "uncoalesced free extents meet at " + std::to_string(r.start);
        } else {
            live_sum += length;
        }
        if (next != capacity_ && (length & (alignment_ - 1)))
            return "unaligned length at " + std::to_string(r.start);
    }
    if (starts.empty() && capacity_) return "nothing covers [0, capacity)";
    if (live_sum != used_) return "used bytes drifted";
    return "";
}

}  // namespace kvstore_native
