// The master shard's compact entry table (see entry_table.hpp for the layout).
#include "entry_table.hpp"

#include <algorithm>
#include <cstring>
#include <queue>

namespace kvstore_native {

namespace {

// MurmurHash3's 64-bit finalizer (Austin Appleby, public domain).
inline uint64_t fmix64(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

inline int hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

const char kHexDigits[] = "0123456789abcdef";

uint64_t hash_packed(const uint8_t* p) {
    uint64_t a, b;
    std::memcpy(&a, p, 8);
    std::memcpy(&b, p + 8, 8);
    return fmix64(a ^ fmix64(b + 0x9e3779b97f4a7c15ULL));
}

uint64_t hash_raw(std::string_view s) {
    uint64_t h = 0x5bd1e995ULL ^ s.size();
    size_t i = 0;
    for (; i + 8 <= s.size(); i += 8) {
        uint64_t w;
        std::memcpy(&w, s.data() + i, 8);
        h = fmix64(h ^ w) + 0x9e3779b97f4a7c15ULL;
    }
    uint64_t tail = 0;
    std::memcpy(&tail, s.data() + i, s.size() - i);
    return fmix64(h ^ tail ^ 0x2545f4914f6cdd1dULL);
}

inline uint8_t tier_at(const EntryRecord& r, int i) { return (r.tiers >> (2 * i)) & 3; }
inline void set_tier_at(EntryRecord& r, int i, uint8_t t) {
    r.tiers = uint8_t((r.tiers & ~(3 << (2 * i))) | ((t & 3) << (2 * i)));
}

}  // namespace

KeyRef make_key(std::string_view raw) {
    KeyRef k;
    k.raw = raw;
    if (raw.size() == 32) {
        bool hex = true;
        for (int i = 0; i < 16 && hex; ++i) {
            int hi = hex_value(raw[2 * i]), lo = hex_value(raw[2 * i + 1]);
            if (hi < 0 || lo < 0) hex = false;
            else k.packed[i] = uint8_t(hi << 4 | lo);
        }
        if (hex) {
            k.hex = true;
            k.hash = hash_packed(k.packed);
            return k;
        }
    }
    k.hash = hash_raw(raw);
    return k;
}

EntryTable::EntryTable() {
    for (auto& p : parts_) p.buckets.assign(8, Bucket{kNoSlot, 0});
}

bool EntryTable::matches(Slot s, const KeyRef& k) const {
    const EntryRecord& r = rec(s);
    if (k.hex) return (r.flags & kHexKey) && std::memcmp(r.key, k.packed, 16) == 0;
    if (r.flags & kHexKey) return false;
    auto it = other_keys_.find(s);
    return it != other_keys_.end() && it->second == k.raw;
}

uint64_t EntryTable::slot_hash(Slot s) const {
    const EntryRecord& r = rec(s);
    if (r.flags & kHexKey) return hash_packed(r.key);
    return hash_raw(other_keys_.at(s));
}

Slot EntryTable::find(const KeyRef& k) const {
    const Part& p = parts_[k.hash & (kParts - 1)];
    size_t mask = p.buckets.size() - 1;
    uint32_t tag = uint32_t(k.hash >> 32);
    for (size_t i = (k.hash >> 8) & mask;; i = (i + 1) & mask) {
        const Bucket& b = p.buckets[i];
        if (b.slot == kNoSlot) return kNoSlot;
        if (b.tag == tag && matches(b.slot, k)) return b.slot;
    }
}

void EntryTable::bucket_insert(Part& p, Slot s, uint64_t h) {
    size_t mask = p.buckets.size() - 1;
    size_t i = (h >> 8) & mask;
    while (p.buckets[i].slot != kNoSlot) i = (i + 1) & mask;
    p.buckets[i] = Bucket{s, uint32_t(h >> 32)};
    ++p.count;
}

void EntryTable::grow(Part& p) {
    std::vector<Bucket> old(p.buckets.size() * 2, Bucket{kNoSlot, 0});
    old.swap(p.buckets);
    p.count = 0;
    for (const Bucket& b : old)
        if (b.slot != kNoSlot) bucket_insert(p, b.slot, slot_hash(b.slot));
}

void EntryTable::bucket_erase(Part& p, Slot s, uint64_t h) {
    size_t mask = p.buckets.size() - 1;
    size_t i = (h >> 8) & mask;
    while (p.buckets[i].slot != s) i = (i + 1) & mask;   // it is there: the caller holds it
    // Backward-shift deletion: move each later member of the run whose home is
    // not between the hole and it into the hole (no tombstones).
    size_t hole = i;
    for (size_t j = (i + 1) & mask; p.buckets[j].slot != kNoSlot; j = (j + 1) & mask) {
        size_t home = (slot_hash(p.buckets[j].slot) >> 8) & mask;
        bool between = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
        if (!between) {
            p.buckets[hole] = p.buckets[j];
            hole = j;
        }
    }
    p.buckets[hole] = Bucket{kNoSlot, 0};
    --p.count;
}

Slot EntryTable::insert(const KeyRef& k, uint64_t size_bytes, uint64_t checksum,
                        uint64_t object_id, int64_t created_ms, uint8_t replica_num,
                        uint16_t node, uint8_t tier) {
    Slot s;
    if (!free_.empty()) {
        s = free_.back();
        free_.pop_back();
    } else {
        s = Slot(high_++);
        if ((s >> kChunkBits) >= chunks_.size())
            chunks_.emplace_back(new EntryRecord[size_t(1) << kChunkBits]);
    }
    EntryRecord& r = rec(s);
    std::memset(&r, 0, sizeof r);
    r.size_bytes = size_bytes;
    r.checksum = checksum;
    r.object_id = object_id;
    r.created_ms = created_ms;
    r.replica_num = replica_num;
    r.flags = kUsed;
    r.nodes[0] = node;
    set_tier_at(r, 0, tier);
    r.num_replicas = 1;
    if (k.hex) {
        r.flags |= kHexKey;
        std::memcpy(r.key, k.packed, 16);
    } else {
        other_keys_.emplace(s, std::string(k.raw));
        count_tenant(k.raw, size_bytes, +1);
    }
    Part& p = parts_[k.hash & (kParts - 1)];
    if ((p.count + 1) * 10 > p.buckets.size() * 7) grow(p);
    bucket_insert(p, s, k.hash);
    ++count_;
    count(s, +1);
    return s;
}

void EntryTable::remove(Slot s) {
    count(s, -1);
    uint64_t h = slot_hash(s);
    bucket_erase(parts_[h & (kParts - 1)], s, h);
    if (!(rec(s).flags & kHexKey)) {
        auto it = other_keys_.find(s);
        if (it != other_keys_.end()) {
            count_tenant(it->second, rec(s).size_bytes, -1);
            other_keys_.erase(it);
        }
    }
    overflow_.erase(s);
    rec(s).flags = 0;
    free_.push_back(s);
    --count_;
}

std::string_view EntryTable::key_tenant(std::string_view key) {
    if (key.size() < 3 || key[0] != '@') return {};
    size_t n = 1;
    for (; n < key.size() && n <= 65; ++n) {
        char c = key[n];
        if (c == '/') break;
        if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '.' || c == '-'))
            return {};
    }
    if (n == 1 || n > 65 || n >= key.size() || key[n] != '/') return {};
    return key.substr(1, n - 1);
}

void EntryTable::count_tenant(std::string_view key, uint64_t size_bytes, int sign) {
    std::string_view t = key_tenant(key);
    if (t.empty()) return;
    if (sign > 0) {
        Held& h = tenants_[std::string(t)];
        h.objects += 1;
        h.bytes += size_bytes;
        return;
    }
    auto it = tenants_.find(std::string(t));
    if (it == tenants_.end()) return;
    it->second.objects -= 1;
    it->second.bytes -= size_bytes;
    if (it->second.objects == 0) tenants_.erase(it);
}

std::pair<uint64_t, uint64_t> EntryTable::tenant_usage(std::string_view name) const {
    auto it = tenants_.find(std::string(name));
    if (it == tenants_.end()) return {0, 0};
    return {it->second.objects, it->second.bytes};
}

std::vector<std::pair<std::string, std::pair<uint64_t, uint64_t>>> EntryTable::tenants() const {
    std::vector<std::pair<std::string, std::pair<uint64_t, uint64_t>>> out;
    out.reserve(tenants_.size());
    for (const auto& [name, h] : tenants_) out.push_back({name, {h.objects, h.bytes}});
    return out;
}

void EntryTable::append_key(Slot s, std::string& out) const {
    const EntryRecord& r = rec(s);
    if (r.flags & kHexKey) {
        for (int i = 0; i < 16; ++i) {
            out.push_back(kHexDigits[r.key[i] >> 4]);
            out.push_back(kHexDigits[r.key[i] & 15]);
        }
    } else {
        out += other_keys_.at(s);
    }
}

std::string EntryTable::key(Slot s) const {
    std::string out;
    append_key(s, out);
    return out;
}

void EntryTable::replicas(Slot s, std::vector<ReplicaRef>& out) const {
    out.clear();
    const EntryRecord& r = rec(s);
    int inl = std::min<int>(r.num_replicas, kInlineReplicas);
    for (int i = 0; i < inl; ++i) out.push_back(ReplicaRef{r.nodes[i], tier_at(r, i)});
    if (r.num_replicas > kInlineReplicas) {
        const auto& extra = overflow_.at(s).extra;
        out.insert(out.end(), extra.begin(), extra.end());
    }
}

EntryTable::Overflow& EntryTable::overflow(Slot s) {
    rec(s).flags |= kOverflow;
    return overflow_[s];
}

void EntryTable::drop_overflow_if_empty(Slot s) {
    auto it = overflow_.find(s);
    if (it != overflow_.end() && it->second.extra.empty() && it->second.repair_target == kNoNode) {
        overflow_.erase(it);
        rec(s).flags &= ~kOverflow;
    }
}

void EntryTable::set_replicas(Slot s, const std::vector<ReplicaRef>& reps) {
    count(s, -1);
    EntryRecord& r = rec(s);
    r.num_replicas = uint8_t(std::min<size_t>(reps.size(), 255));
    r.tiers = 0;
    for (int i = 0; i < kInlineReplicas; ++i) {
        if (i < int(reps.size())) {
            r.nodes[i] = reps[i].node;
            set_tier_at(r, i, reps[i].tier);
        } else {
            r.nodes[i] = kNoNode;
        }
    }
    if (reps.size() > kInlineReplicas) {
        overflow(s).extra.assign(reps.begin() + kInlineReplicas,
                                 reps.begin() + std::min<size_t>(reps.size(), 255));
    } else if (r.flags & kOverflow) {
        overflow_[s].extra.clear();
        drop_overflow_if_empty(s);
    }
    count(s, +1);
}

bool EntryTable::has_replica(Slot s, uint16_t node) const {
    const EntryRecord& r = rec(s);
    int inl = std::min<int>(r.num_replicas, kInlineReplicas);
    for (int i = 0; i < inl; ++i)
        if (r.nodes[i] == node) return true;
    if (r.num_replicas > kInlineReplicas)
        for (const auto& x : overflow_.at(s).extra)
            if (x.node == node) return true;
    return false;
}

void EntryTable::add_replica(Slot s, uint16_t node, uint8_t tier) {
    std::vector<ReplicaRef> reps;
    replicas(s, reps);
    reps.push_back(ReplicaRef{node, tier});
    set_replicas(s, reps);
}

bool EntryTable::remove_replica(Slot s, uint16_t node) {
    std::vector<ReplicaRef> reps;
    replicas(s, reps);
    auto it = std::remove_if(reps.begin(), reps.end(),
                             [node](const ReplicaRef& x) { return x.node == node; });
    if (it == reps.end()) return false;
    reps.erase(it, reps.end());
    set_replicas(s, reps);
    return true;
}

bool EntryTable::set_tier(Slot s, uint16_t node, uint8_t tier) {
    EntryRecord& r = rec(s);
    int inl = std::min<int>(r.num_replicas, kInlineReplicas);
    for (int i = 0; i < inl; ++i)
        if (r.nodes[i] == node) {
            set_tier_at(r, i, tier);
            return true;
        }
    if (r.num_replicas > kInlineReplicas)
        for (auto& x : overflow_.at(s).extra)
            if (x.node == node) {
                x.tier = tier;
                return true;
            }
    return false;
}

void EntryTable::live_replicas(Slot s, const uint8_t* alive, size_t n_alive,
                               std::vector<ReplicaRef>& out) const {
    replicas(s, out);
    out.erase(std::remove_if(out.begin(), out.end(),
                             [&](const ReplicaRef& x) {
                                 return x.node >= n_alive || !alive[x.node];
                             }),
              out.end());
}

bool EntryTable::visible(Slot s, const uint8_t* alive, size_t n_alive) const {
    const EntryRecord& r = rec(s);
    int inl = std::min<int>(r.num_replicas, kInlineReplicas);
    for (int i = 0; i < inl; ++i)
        if (r.nodes[i] < n_alive && alive[r.nodes[i]]) return true;
    if (r.num_replicas > kInlineReplicas)
        for (const auto& x : overflow_.at(s).extra)
            if (x.node < n_alive && alive[x.node]) return true;
    return false;
}

uint16_t EntryTable::repair_target(Slot s) const {
    if (!(rec(s).flags & kOverflow)) return kNoNode;
    return overflow_.at(s).repair_target;
}

int64_t EntryTable::repair_deadline(Slot s) const {
    if (!(rec(s).flags & kOverflow)) return 0;
    return overflow_.at(s).repair_deadline_ms;
}

void EntryTable::set_repair(Slot s, uint16_t target, int64_t deadline_ms) {
    if (target == kNoNode && !(rec(s).flags & kOverflow)) return;
    Overflow& o = overflow(s);
    o.repair_target = target;
    o.repair_deadline_ms = target == kNoNode ? 0 : deadline_ms;
    drop_overflow_if_empty(s);
}

int EntryTable::stored_probe(const KeyRef& k, uint64_t object_id, uint64_t size_bytes,
                             uint64_t checksum, uint16_t node, Slot* slot) const {
    Slot s = find(k);
    *slot = s;
    if (s == kNoSlot) return kProbeAbsent;
    const EntryRecord& r = rec(s);
    if (r.object_id != object_id) return kProbeOtherVersion;
    if (r.size_bytes != size_bytes || r.checksum != checksum) return kProbeOtherBytes;
    return has_replica(s, node) ? kProbeReplica : kProbeNewReplica;
}

std::string EntryTable::holders(Slot s) const {
    std::vector<ReplicaRef> reps;
    replicas(s, reps);
    std::vector<uint16_t> nodes;
    for (const auto& x : reps) nodes.push_back(x.node);
    std::sort(nodes.begin(), nodes.end());
    return std::string(reinterpret_cast<const char*>(nodes.data()), nodes.size() * 2);
}

void EntryTable::count(Slot s, int sign) {
    // One holder (nearly every entry): its two bytes, as holders() makes them, without
    // the two vectors and the sort.
    const EntryRecord& r = rec(s);
    std::string h = r.num_replicas == 1
        ? std::string(reinterpret_cast<const char*>(&r.nodes[0]), 2) : holders(s);
    Held& held = held_[h];
    held.objects += sign;
    held.bytes += sign * int64_t(rec(s).size_bytes);
    if (!held.objects) held_.erase(h);
}

std::pair<uint64_t, uint64_t> EntryTable::unavailable(const uint8_t* alive,
                                                      size_t n_alive) const {
    uint64_t objects = 0, bytes = 0;
    for (const auto& [h, held] : held_) {
        bool any = false;
        for (size_t i = 0; i < h.size(); i += 2) {
            uint16_t n;
            std::memcpy(&n, h.data() + i, 2);
            if (n < n_alive && alive[n]) {
                any = true;
                break;
            }
        }
        if (!any) {
            objects += held.objects;
            bytes += held.bytes;
        }
    }
    return {objects, bytes};
}

std::string EntryTable::check() const {
    std::map<std::string, Held> recount;
    std::unordered_map<std::string, Held> by_tenant;
    size_t n = 0;
    for (size_t s = 0; s < high_; ++s) {
        if (!used(Slot(s))) continue;
        ++n;
        Held& h = recount[holders(Slot(s))];
        h.objects += 1;
        h.bytes += rec(Slot(s)).size_bytes;
        std::string k = key(Slot(s));
        std::string_view t = key_tenant(k);
        if (!t.empty()) {
            Held& th = by_tenant[std::string(t)];
            th.objects += 1;
            th.bytes += rec(Slot(s)).size_bytes;
        }
        if (find(make_key(key(Slot(s)))) != Slot(s)) return "entry " + key(Slot(s)) + " not found";
    }
    if (n != count_) return "count " + std::to_string(count_) + " != " + std::to_string(n);
    if (recount.size() != held_.size()) return "holder sets differ";
    if (by_tenant.size() != tenants_.size()) return "tenant sets differ";
    for (const auto& [t, th] : by_tenant) {
        auto it = tenants_.find(t);
        if (it == tenants_.end() || it->second.objects != th.objects ||
            it->second.bytes != th.bytes)
            return "counts by tenant differ";
    }
    for (const auto& [h, held] : recount) {
        auto it = held_.find(h);
        if (it == held_.end() || it->second.objects != held.objects ||
            it->second.bytes != held.bytes)
            return "counts by holders differ";
    }
    return "";
}

SliceResult EntryTable::forget_slice(size_t start, size_t count, const uint8_t* gone,
                                     size_t n_gone) {
    SliceResult out;
    size_t end = std::min(high_, start + count);
    std::vector<ReplicaRef> reps;
    for (size_t i = start; i < end; ++i) {
        Slot s = Slot(i);
        if (!used(s)) continue;
        replicas(s, reps);
        auto is_gone = [&](uint16_t n) { return n < n_gone && gone[n]; };
        uint16_t target = repair_target(s);
        if (target != kNoNode && is_gone(target)) set_repair(s, kNoNode, 0);
        size_t before = reps.size();
        reps.erase(std::remove_if(reps.begin(), reps.end(),
                                  [&](const ReplicaRef& x) { return is_gone(x.node); }),
                   reps.end());
        if (reps.size() == before) continue;
        if (reps.empty()) {
            out.deleted += 1;
            out.deleted_bytes += rec(s).size_bytes;
            remove(s);
        } else {
            set_replicas(s, reps);
        }
    }
    out.next = end;
    return out;
}

SliceResult EntryTable::sweep_slice(size_t start, size_t count, uint16_t node,
                                    const uint8_t* listed, size_t n_listed) {
    SliceResult out;
    size_t end = std::min(high_, start + count);
    for (size_t i = start; i < end; ++i) {
        Slot s = Slot(i);
        if (!used(s) || (i < n_listed && listed[i])) continue;
        if (!remove_replica(s, node)) continue;
        if (rec(s).num_replicas == 0) {
            out.deleted += 1;
            out.deleted_bytes += rec(s).size_bytes;
            remove(s);
        }
    }
    out.next = end;
    return out;
}

size_t EntryTable::short_slice(size_t start, size_t count, int64_t now_ms, const uint8_t* alive,
                               size_t n_alive, std::vector<ShortEntry>& out,
                               uint64_t* in_flight, uint64_t* timeouts) {
    size_t end = std::min(high_, start + count);
    std::vector<ReplicaRef> live;
    for (size_t i = start; i < end; ++i) {
        Slot s = Slot(i);
        if (!used(s)) continue;
        const EntryRecord& r = rec(s);
        if (r.flags & kOverflow) {
            Overflow& o = overflow_.at(s);
            if (o.repair_target != kNoNode) {
                if (now_ms <= o.repair_deadline_ms) {
                    ++*in_flight;
                    continue;
                }
                ++*timeouts;
                set_repair(s, kNoNode, 0);
            }
        }
        if (r.num_replicas >= r.replica_num && r.num_replicas <= kInlineReplicas) {
            // Quick skip: enough replicas listed and all of them alive.
            bool all = true;
            for (int k = 0; k < r.num_replicas && all; ++k)
                all = r.nodes[k] < n_alive && alive[r.nodes[k]];
            if (all) continue;
        }
        live_replicas(s, alive, n_alive, live);
        if (!live.empty() && live.size() < r.replica_num) {
            ShortEntry e{s, {}};
            for (const auto& x : live) e.live.push_back(x.node);
            out.push_back(std::move(e));
        }
    }
    return end;
}

std::vector<Slot> EntryTable::list(std::string_view prefix, std::string_view start_after,
                                   size_t limit, const uint8_t* alive, size_t n_alive) const {
    // A max-heap of the `limit` smallest matching keys seen so far.
    using Item = std::pair<std::string, Slot>;
    std::priority_queue<Item> heap;
    std::string k;
    for (size_t i = 0; i < high_; ++i) {
        Slot s = Slot(i);
        if (!used(s)) continue;
        k.clear();
        append_key(s, k);
        if (k.compare(0, prefix.size(), prefix) != 0) continue;
        if (!start_after.empty() && std::string_view(k) <= start_after) continue;
        if (heap.size() == limit && !(k < heap.top().first)) continue;
        if (!visible(s, alive, n_alive)) continue;
        heap.emplace(k, s);
        if (heap.size() > limit) heap.pop();
    }
    std::vector<Slot> out(heap.size());
    for (size_t i = heap.size(); i-- > 0;) {
        out[i] = heap.top().second;
        heap.pop();
    }
    return out;
}

size_t EntryTable::memory_bytes() const {
    size_t b = chunks_.size() * (sizeof(EntryRecord) << kChunkBits) + free_.capacity() * 4;
    for (const auto& p : parts_) b += p.buckets.capacity() * sizeof(Bucket);
    return b;
}

}  // namespace kvstore_native
