// The DRAM (and GPU) tier's offset allocator: best fit over [0, capacity), in C++.
//
// Pure C++ (no Python types), so native tests and the fuzz target link it
// alone; allocator.cpp holds the algorithm and the thin pybind binding, and
// kvstore/store/allocator.py is its Python face (same contract as before).
//
//     0                                                         capacity
//     |--A--|....free....|--B--|--C--|.......free.......|--D--|..free..|
//     ^ every extent starts on an `alignment` boundary
//
// Invariants (check() verifies them all):
//   * live allocations and free extents tile [0, capacity) exactly:
//         used + free == capacity
//   * free extents are fully coalesced: no two touch
//   * every extent length is a multiple of `alignment`, except the one that
//     ends at capacity when capacity is not a multiple (the tail)
//
// Data structures (n live allocations, f free extents; f <= n + 1):
//   by_size_   std::set<(length, start)>   best fit: first length >= request,
//                                          lowest start breaks ties      O(log f)
//   by_start_  std::map<start, length>     neighbours of a freed range   O(log f)
//   live_      open-addressing table       offset -> serial              O(1)
//              (linear probing, backward-shift deletion: Knuth, TAOCP
//              vol. 3, 6.4, Algorithm R), 12 bytes a slot (the offset in
//              alignment units, 40 bits, and the serial, 56), at most 3/4 full
// A live allocation costs 16-32 bytes here (the table's slot over its load),
// with no allocation of its own; a free extent costs two tree nodes. So
// capacity / alignment must stay under 2**40 - 1 (64 TiB at 64-byte alignment).
//
// The reserved bytes of a live allocation are not stored: they follow from its
// offset and size by the rounding rule below, and free() is handed the size by
// the caller's handle. A handle is trusted for its size once its (offset,
// serial) names a live allocation here: serials are unique in the process
// (one counter for every allocator), so a stale handle (double free) or one of
// another allocator never matches.
//
// Sizes round up to `alignment` (the reserved bytes); a request taken from the
// tail extent is clipped at capacity instead, so allocate(largest_free())
// always succeeds. A 0-byte request reserves one unit (clipped the same way):
// every live allocation has its own offset. The serial (1, 2, ...) names one
// lifetime of a range: a freed handle whose offset was reused does not free
// the newer allocation. Serials increase, unique among every allocator of the
// process (shared-memory readers tell ranges apart by them).
//
// Thread safety: none; the owner (the node, under its lock) serialises calls.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace kvstore_native {

struct Allocation {
    uint64_t offset = 0;    // start, a multiple of the alignment
    uint64_t size = 0;      // bytes asked for
    uint64_t reserved = 0;  // bytes taken from the free space; >= size, >= 1
    uint64_t serial = 0;    // unique among the process's allocations, ever (from 1)
};

class OffsetAllocatorCore {
 public:
    // Raises std::invalid_argument: alignment is not a power of two, or
    // capacity / alignment is 2**40 - 1 or more.
    OffsetAllocatorCore(uint64_t capacity, uint64_t alignment);

    // Reserves room for `size` bytes; false (and *out untouched) when no free
    // extent holds it, fragmentation included. O(log f).
    bool allocate(uint64_t size, Allocation* out);

    // Returns the range of the live allocation (offset, serial) of `size` bytes
    // (its handle's; `reserved` must be what the rounding rule gives), merging
    // it with its free neighbours. O(log f).
    // Raises std::invalid_argument: no such live allocation (double free,
    // foreign), or sizes that are not its own.
    void free(uint64_t offset, uint64_t serial, uint64_t size, uint64_t reserved);

    // What an allocation of `size` bytes at `offset` reserves: the size rounded
    // up to the alignment (at least one unit), clipped at capacity.
    uint64_t reserved_for(uint64_t offset, uint64_t size) const;

    uint64_t capacity() const { return capacity_; }
    uint64_t alignment() const { return alignment_; }
    uint64_t used() const { return used_; }
    uint64_t free_bytes() const { return capacity_ - used_; }
    uint64_t largest_free() const { return by_size_.empty() ? 0 : by_size_.rbegin()->first; }
    uint64_t num_allocations() const { return live_count_; }
    uint64_t num_free_extents() const { return by_size_.size(); }

    // Bytes this object holds on the heap for its live table (the per-allocation cost).
    uint64_t live_table_bytes() const { return live_.capacity() * sizeof(Slot); }

    // Every invariant above, O(n + f); "" when they hold, else what broke.
    std::string check() const;

 private:
    // A live table slot in 12 bytes: the offset in alignment units (kEmptyUnits:
    // unused) in 40 bits, the serial in 56.
    struct Slot {
        uint32_t w[3];
        uint64_t units() const { return w[0] | uint64_t(w[1] & 0xFF) << 32; }
        uint64_t serial() const { return uint64_t(w[1] >> 8) | uint64_t(w[2]) << 24; }
        bool empty() const { return units() == kEmptyUnits; }
        static Slot make(uint64_t units, uint64_t serial) {
            return Slot{{uint32_t(units), uint32_t(units >> 32 & 0xFF) | uint32_t(serial << 8),
                         uint32_t(serial >> 24)}};
        }
    };
    static constexpr uint64_t kEmptyUnits = (uint64_t(1) << 40) - 1;
    static constexpr uint64_t kMaxSerial = (uint64_t(1) << 56) - 1;

    void add_free(uint64_t start, uint64_t length);
    void remove_free(uint64_t start, uint64_t length);
    size_t home(uint64_t units) const;
    size_t find_live(uint64_t offset) const;  // its slot, or live_.size() when absent
    void insert_live(const Slot& s);
    void erase_live(size_t i);
    void grow_live();

    uint64_t capacity_;
    uint64_t alignment_;
    unsigned align_shift_;
    uint64_t used_ = 0;
    std::set<std::pair<uint64_t, uint64_t>> by_size_;  // (length, start)
    std::map<uint64_t, uint64_t> by_start_;            // start -> length
    std::vector<Slot> live_;                           // power-of-two size (or empty)
    uint64_t live_count_ = 0;
};

}  // namespace kvstore_native
