// The master shard's compact entry table: key -> one record of fixed size.
//
// Pure C++ (no Python types): the pybind layer is entry_table_bind.cpp.
// It replaces a Python object graph per entry (an Entry dataclass, its replica
// list and tiers dict, the key string, dict slots: about 670 B an object at
// 10M) with one 72-byte record in arrays and an 8-byte bucket of an open
// addressing table:
//
//     key ──hash──> part (hash & 255) ──linear probe──> Bucket{slot, tag}
//                                                         │
//     records  [chunk 0: 65536 x EntryRecord][chunk 1] ... <┘  record = slot
//     side     slot -> the key's bytes     (keys that are not 32 lowercase hex)
//     overflow slot -> replicas past the third, a repair in flight (rare)
//
// Keys: a key of 32 lowercase hex characters (an xxh3-128 digest, kvstore/keys.py:
// nearly every key) is stored packed in the record's 16 bytes; any other key
// (up to 512 B, validated by the caller) lives in a side table by slot.
// Packed hex keeps the string order (nibble values order as '0'-'9' < 'a'-'f').
//
// Parts: the table is 256 open addressing tables (linear probing, backward-shift
// deletion: no tombstones; Knuth, TAOCP vol. 3, 6.4, Algorithm R). A part doubles
// when it passes 70 % load, so a growth rehashes 1/256 of the keys: at 10M keys
// a few hundred microseconds, never a stall of the owner (the BigMap's reason).
// Records live in chunks of 65536 that are never moved; a deleted record's slot
// goes on a free list and is reused. Slots are stable while an entry lives.
//
// Hash: 64-bit, in process only (never stored or sent): the packed key's two
// words, or the raw bytes 8 at a time, mixed with MurmurHash3's fmix64
// finalizer (Austin Appleby, public domain).
//
// Holders: objects and bytes are also counted by the sorted set of nodes holding
// them, kept with every replica change, so "objects with no live replica" is
// O(sets of holders), not O(entries) (Stat, every few seconds).
//
// Tenants: objects and bytes are also counted by tenant for the keys that name one
// ("@NAME/...", kvstore/tenants.py; never a packed hex key), kept at insert and
// remove (every path that adds or deletes an entry goes through them), so a
// tenant's usage is one map lookup; the default tenant's is the rest of the table.
//
// Nodes are small integers (uint16, interned by the caller); tiers are the wire
// enum's values 0-3 (2 bits each). Times are int64 ms of the caller's clock.
//
// Thread safety: none; one owner (the master's event loop) at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kvstore_native {

using Slot = uint32_t;
constexpr Slot kNoSlot = 0xffffffffu;
constexpr uint16_t kNoNode = 0xffff;
constexpr int kInlineReplicas = 3;
constexpr size_t kMaxKeyBytes = 512;

struct ReplicaRef {
    uint16_t node;
    uint8_t tier;   // wire enum value (0: unspecified, 1 GPU, 2 DRAM, 3 SSD)
};

// One entry, 72 bytes.
struct EntryRecord {
    uint8_t key[16];            // packed hex key (kHexKey), else unused
    uint64_t size_bytes;
    uint64_t checksum;          // xxh3-64 of the value
    uint64_t object_id;
    int64_t created_ms;
    int64_t last_access_ms;
    uint32_t access_count;      // saturates at 2^32 - 1
    uint8_t replica_num;        // replicas wanted
    uint8_t num_replicas;       // inline and overflow together
    uint8_t flags;              // kUsed | kHexKey | kOverflow
    uint8_t tiers;              // 2 bits per inline replica
    uint16_t nodes[kInlineReplicas];
    uint16_t pad;
};
static_assert(sizeof(EntryRecord) == 72, "the record is the table's memory per object");

// A key as the table sees it: packed (hex) or raw bytes, and its hash.
struct KeyRef {
    std::string_view raw;
    uint64_t hash = 0;
    bool hex = false;
    uint8_t packed[16] = {};
};

KeyRef make_key(std::string_view raw);

// What a STORED report meets (stored_probe).
enum StoredProbe : int {
    kProbeAbsent = 0,        // no entry of the key
    kProbeOtherVersion = 1,  // an entry of another object id
    kProbeOtherBytes = 2,    // this object id, but another size or checksum
    kProbeReplica = 3,       // this version, and the node holds it already
    kProbeNewReplica = 4,    // this version, the node does not hold it yet
};

struct SliceResult {
    size_t next = 0;         // the position to go on from (== end: done)
    uint64_t deleted = 0;    // entries deleted (no replica left)
    uint64_t deleted_bytes = 0;
};

struct ShortEntry {
    Slot slot;
    std::vector<uint16_t> live;   // live replicas, in the entry's order
};

class EntryTable {
public:
    EntryTable();

    size_t size() const { return count_; }
    size_t positions() const { return high_; }   // scans run over [0, positions())
    bool used(Slot s) const { return s < high_ && (rec(s).flags & kUsed); }

    Slot find(const KeyRef& k) const;
    // A hint: the bucket find(k) starts at is loaded into the cache (a batch looks a few
    // keys ahead: the bucket array is the one random access of a find at 10M keys).
    void prefetch(const KeyRef& k) const {
        const Part& p = parts_[k.hash & (kParts - 1)];
        __builtin_prefetch(&p.buckets[(k.hash >> 8) & (p.buckets.size() - 1)]);
    }
    // Adds an entry (the caller checked the key is absent). Returns its slot.
    Slot insert(const KeyRef& k, uint64_t size_bytes, uint64_t checksum, uint64_t object_id,
                int64_t created_ms, uint8_t replica_num, uint16_t node, uint8_t tier);
    void remove(Slot s);

    const EntryRecord& rec(Slot s) const { return chunks_[s >> kChunkBits][s & kChunkMask]; }
    EntryRecord& rec(Slot s) { return chunks_[s >> kChunkBits][s & kChunkMask]; }
    std::string key(Slot s) const;
    void append_key(Slot s, std::string& out) const;

    void replicas(Slot s, std::vector<ReplicaRef>& out) const;
    void set_replicas(Slot s, const std::vector<ReplicaRef>& reps);
    bool has_replica(Slot s, uint16_t node) const;
    void add_replica(Slot s, uint16_t node, uint8_t tier);
    bool remove_replica(Slot s, uint16_t node);
    bool set_tier(Slot s, uint16_t node, uint8_t tier);
    // Live replicas (alive[node] != 0) of an entry, in its order.
    void live_replicas(Slot s, const uint8_t* alive, size_t n_alive,
                       std::vector<ReplicaRef>& out) const;
    bool visible(Slot s, const uint8_t* alive, size_t n_alive) const;

    uint16_t repair_target(Slot s) const;
    int64_t repair_deadline(Slot s) const;
    void set_repair(Slot s, uint16_t target, int64_t deadline_ms);

    int stored_probe(const KeyRef& k, uint64_t object_id, uint64_t size_bytes, uint64_t checksum,
                     uint16_t node, Slot* slot) const;

    // (objects, bytes) whose every holder is dead.
    std::pair<uint64_t, uint64_t> unavailable(const uint8_t* alive, size_t n_alive) const;
    // Fails (returns a message) when the counts by holders disagree with a recount.
    std::string check() const;

    // Scans, a slice of positions [start, start + count) at a time.
    SliceResult forget_slice(size_t start, size_t count, const uint8_t* gone, size_t n_gone);
    SliceResult sweep_slice(size_t start, size_t count, uint16_t node, const uint8_t* listed,
                            size_t n_listed);
    size_t short_slice(size_t start, size_t count, int64_t now_ms, const uint8_t* alive,
                       size_t n_alive, std::vector<ShortEntry>& out, uint64_t* in_flight,
                       uint64_t* timeouts);
    // Slots of the visible keys that start with `prefix` and are above `start_after`
    // (when not empty), in key order, at most `limit`: a scan of every entry.
    std::vector<Slot> list(std::string_view prefix, std::string_view start_after, size_t limit,
                           const uint8_t* alive, size_t n_alive) const;

    size_t memory_bytes() const;

    // (objects, bytes) of the entries of tenant `name` (keys "@name/..."); (0, 0) for
    // "default" and unknown names (the default tenant's are the rest of the table).
    std::pair<uint64_t, uint64_t> tenant_usage(std::string_view name) const;
    // Every named tenant with entries: name -> (objects, bytes).
    std::vector<std::pair<std::string, std::pair<uint64_t, uint64_t>>> tenants() const;
    // The tenant a key names ("@NAME/..." with NAME 1-64 of A-Z a-z 0-9 _ . -), or "".
    static std::string_view key_tenant(std::string_view key);

    static constexpr uint8_t kUsed = 1, kHexKey = 2, kOverflow = 4;

private:
    static constexpr int kChunkBits = 16;
    static constexpr Slot kChunkMask = (1u << kChunkBits) - 1;
    static constexpr int kParts = 256;

    struct Bucket {
        Slot slot;
        uint32_t tag;   // the hash's high 32 bits: most mismatches never touch a record
    };
    struct Part {
        std::vector<Bucket> buckets;
        size_t count = 0;
    };
    struct Overflow {
        std::vector<ReplicaRef> extra;   // replicas past kInlineReplicas
        uint16_t repair_target = kNoNode;
        int64_t repair_deadline_ms = 0;
    };
    struct Held {
        uint64_t objects = 0;
        uint64_t bytes = 0;
    };

    bool matches(Slot s, const KeyRef& k) const;
    uint64_t slot_hash(Slot s) const;
    void bucket_insert(Part& p, Slot s, uint64_t h);
    void bucket_erase(Part& p, Slot s, uint64_t h);
    void grow(Part& p);
    std::string holders(Slot s) const;
    void count(Slot s, int sign);
    Overflow& overflow(Slot s);
    void drop_overflow_if_empty(Slot s);

    std::vector<std::unique_ptr<EntryRecord[]>> chunks_;
    std::vector<Slot> free_;
    size_t high_ = 0;     // positions ever handed out
    size_t count_ = 0;    // entries held
    Part parts_[kParts];
    std::unordered_map<Slot, std::string> other_keys_;
    std::unordered_map<Slot, Overflow> overflow_;
    std::map<std::string, Held> held_;   // sorted holders (uint16 each) -> counts
    std::unordered_map<std::string, Held> tenants_;   // named tenant -> counts (no zeros)
    void count_tenant(std::string_view key, uint64_t size_bytes, int sign);
};

}  // namespace kvstore_native
