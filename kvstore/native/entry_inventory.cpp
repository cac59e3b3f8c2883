// An inventory chunk's common cases applied to the entry table (see entry_inventory.hpp).
#include "entry_inventory.hpp"

#include <algorithm>

namespace kvstore_native {

namespace {

inline bool hex32(std::string_view k) {
    if (k.size() != 32) return false;
    for (char ch : k)
        if (!((ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f'))) return false;
    return true;
}

inline uint8_t clamp_replicas(uint64_t n) {
    return uint8_t(std::max<uint64_t>(1, std::min<uint64_t>(n, 255)));
}

}  // namespace

InventoryApplied inventory_apply(EntryTable& t, const InventoryChunk& c, size_t start,
                                 size_t end, const InventoryApplyArgs& a) {
    InventoryApplied out;
    end = std::min(end, c.size());
    size_t i = std::min(start, end);
    // The keys of the next kAhead items are made (hex parsed, hashed) and their buckets
    // prefetched before they are looked up: at 10M entries a find is a cache miss.
    // A ring of twice that: preparing item i + kAhead never overwrites item i's key.
    constexpr size_t kAhead = 8, kRing = 2 * kAhead;
    KeyRef ahead[kRing];
    bool hex[kRing] = {};
    auto prepare = [&](size_t j) {
        if (j >= end) return;
        hex[j % kRing] = hex32(c.key(j));
        if (!hex[j % kRing]) return;
        ahead[j % kRing] = make_key(c.key(j));
        t.prefetch(ahead[j % kRing]);
    };
    for (size_t j = i; j < i + kAhead; ++j) prepare(j);
    for (; i < end; ++i) {
        prepare(i + kAhead);
        if (c.repeated[i] || (a.defer && a.defer[i])) break;
        if (!hex[i % kRing]) break;                  // the caller validates other keys
        uint8_t owned = a.owned[c.key_hash[i] % kKeySlots];
        if (owned == 0) continue;                     // another shard's key: skipped
        if (owned != 1) break;
        const KeyRef& k = ahead[i % kRing];
        Slot s = t.find(k);
        if (s != kNoSlot && t.rec(s).object_id != c.object_id[i]) break;   // another version
        if (c.pending[i]) {
            // Not applied by a master yet: its replayed STORED decides; an entry of this
            // very version (applied here, its answer lost) is kept.
            if (s != kNoSlot && a.listed) a.listed[s] = 1;
            continue;
        }
        out.max_object_id = std::max(out.max_object_id, c.object_id[i]);
        uint8_t tier = uint8_t(c.tier[i] ? c.tier[i] : 2);          // unset: DRAM
        if (s == kNoSlot) {
            if (t.positions() >= kNoSlot - 1 && t.size() == t.positions()) break;   // full
            if (t.size() >= a.max_objects) ++out.over_limit;        // indexed all the same
            s = t.insert(k, c.size_bytes[i], c.checksum[i], c.object_id[i], a.now_ms,
                         clamp_replicas(c.replica_num[i]), a.node, tier);
            out.inserted += 1;
            out.inserted_bytes += c.size_bytes[i];
        } else {
            if (t.has_replica(s, a.node)) t.set_tier(s, a.node, tier);
            else t.add_replica(s, a.node, tier);
            // A rebuilt index learns how many replicas were wanted from what the nodes
            // say their puts asked for, and at least as many as it finds.
            EntryRecord& r = t.rec(s);
            r.replica_num = clamp_replicas(std::max<uint64_t>(
                {r.replica_num, r.num_replicas, c.replica_num[i]}));
        }
        if (a.listed) a.listed[s] = 1;
    }
    out.stop = i;
    return out;
}

}  // namespace kvstore_native
