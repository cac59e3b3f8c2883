// OffsetAllocatorCore (see allocator.hpp): pure C++, no Python.
#include "allocator.hpp"

#include <algorithm>
#include <iterator>
#include <stdexcept>

namespace kvstore_native {

OffsetAllocatorCore::OffsetAllocatorCore(uint64_t capacity, uint64_t alignment)
    : capacity_(capacity), alignment_(alignment), align_shift_(0) {
    if (alignment == 0 || (alignment & (alignment - 1)) != 0)
        throw std::invalid_argument("alignment must be a power of two, got " +
                                    std::to_string(alignment));
    while ((uint64_t(1) << align_shift_) != alignment) ++align_shift_;
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
    ++serial_;
    insert_live({start, serial_, reserved});
    *out = Allocation{start, size, reserved, serial_};
    return true;
}

void OffsetAllocatorCore::free(uint64_t offset, uint64_t serial, uint64_t reserved) {
    size_t i = find_live(offset);
    if (i == live_.size() || live_[i].serial != serial || live_[i].reserved != reserved)
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

size_t OffsetAllocatorCore::home(uint64_t offset) const {
    // Fibonacci hashing of the offset in alignment units (Knuth, TAOCP vol. 3, 6.4).
    const uint64_t h = (offset >> align_shift_) * 0x9E3779B97F4A7C15ull;
    return size_t(h >> 32) & (live_.size() - 1);
}

size_t OffsetAllocatorCore::find_live(uint64_t offset) const {
    if (live_.empty()) return 0;
    const size_t mask = live_.size() - 1;
    for (size_t i = home(offset);; i = (i + 1) & mask) {
        if (live_[i].offset == offset) return i;
        if (live_[i].offset == kEmpty) return live_.size();
    }
}

void OffsetAllocatorCore::insert_live(const Slot& s) {
    if ((live_count_ + 1) * 4 > live_.size() * 3) grow_live();
    const size_t mask = live_.size() - 1;
    size_t i = home(s.offset);
    while (live_[i].offset != kEmpty) i = (i + 1) & mask;
    live_[i] = s;
    ++live_count_;
}

void OffsetAllocatorCore::erase_live(size_t i) {
    // Backward-shift deletion: no tombstones, so probe lengths stay those of the live keys.
    const size_t mask = live_.size() - 1;
    size_t hole = i;
    for (size_t j = (i + 1) & mask; live_[j].offset != kEmpty; j = (j + 1) & mask) {
        size_t h = home(live_[j].offset);
        // j may move to the hole unless its home lies cyclically in (hole, j].
        bool stays = hole <= j ? (hole < h && h <= j) : (hole < h || h <= j);
        if (!stays) {
            live_[hole] = live_[j];
            hole = j;
        }
    }
    live_[hole].offset = kEmpty;
    --live_count_;
}

void OffsetAllocatorCore::grow_live() {
    std::vector<Slot> old;
    old.swap(live_);
    live_.assign(old.empty() ? 16 : old.size() * 2, Slot{kEmpty, 0, 0});
    live_count_ = 0;
    for (const Slot& s : old)
        if (s.offset != kEmpty) insert_live(s);
}

std::string OffsetAllocatorCore::check() const {
    struct Range { uint64_t start, length; bool free; };
    std::vector<Range> ranges;
    uint64_t free_sum = 0, live_sum = 0, live_n = 0;
    if (by_size_.size() != by_start_.size()) return "free indexes differ";
    for (auto& [start, length] : by_start_) {
        if (!by_size_.count({length, start})) return "free extent missing from the size index";
        ranges.push_back({start, length, true});
        free_sum += length;
    }
    for (const Slot& s : live_) {
        if (s.offset == kEmpty) continue;
        if (find_live(s.offset) == live_.size()) return "live slot unreachable by probing";
        ranges.push_back({s.offset, s.reserved, false});
        live_sum += s.reserved;
        ++live_n;
        if (s.serial == 0 || s.serial > serial_) return "serial out of range";
    }
    if (live_n != live_count_) return "live count drifted";
    if (live_sum != used_) return "used bytes drifted";
    if (free_sum + used_ != capacity_) return "used + free != capacity";
    std::sort(ranges.begin(), ranges.end(),
              [](const Range& a, const Range& b) { return a.start < b.start; });
    uint64_t cursor = 0;
    bool prev_free = false;
    for (const Range& r : ranges) {
        if (r.start != cursor)
            return "gap or overlap at " + std::to_string(cursor) + " (next range starts at " +
                   std::to_string(r.start) + ")";
        if (r.length == 0) return "empty range at " + std::to_string(r.start);
        if (r.start & (alignment_ - 1)) return "unaligned range at " + std::to_string(r.start);
        if (r.free && prev_free) return "uncoalesced free extents meet at " + std::to_string(r.start);
        if (r.start + r.length != capacity_ && (r.length & (alignment_ - 1)))
            return "unaligned length at " + std::to_string(r.start);
        cursor = r.start + r.length;
        prev_free = r.free;
    }
    if (cursor != capacity_) return "ranges end at " + std::to_string(cursor);
    return "";
}

}  // namespace kvstore_native
