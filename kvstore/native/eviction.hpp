// A tier's eviction bookkeeping by object slot, in compact arrays (no object per key).
//
// Pure C++ (no Python types); eviction_bind.cpp is the thin binding and
// kvstore/store/eviction/slotted.py its Python face. The Python policies in
// kvstore/store/eviction/ (lru.py, lfu.py, default.py) are the specification:
// they choose the kind and its parameters, and a differential test replays the
// same events through both and asks for the same victims.
//
// Objects are named by their slot in the node's object table (a small
// non-negative int, reused once the object leaves service). Per slot:
//
//     entries_[slot]  last_access, score, seq, size, parent, parent_gen,
//                     gen, children, freq, heap_pos        56 bytes (chunks of 4096)
//     heap_           the slots in the heap                  4 bytes each
//
// seq == 0 marks an untracked slot. The priority, smallest first:
//
//     LRU      (last_access, seq)
//     LFU      (freq, last_access, seq)
//     DEFAULT  (last_access + score, seq), leaves only, where the score is fixed
//              when the slot is (re)queued: credit * [freq >= 2],
//              credit = protect_s * min(1, fade_ratio * protect_s / retention)
//
// A slot's fields change only when it is requeued (or while out of the heap),
// so the heap stays ordered.
//
// The heap is an indexed binary heap (Cormen et al.,
// "Introduction to Algorithms", 6.5, with each slot's position kept so a
// touched slot moves in place): O(log n) per touch, no stale items.
//
// Prefix chains (DEFAULT, leaf first): a slot inserted with a tracked parent
// makes the parent an inner node, out of the heap until its last child goes.
// `gen` counts the inserts into a slot, so a child whose parent slot was
// removed and reused (parent_gen != gen[parent]) no longer counts on it.
//
// Ghost history (DEFAULT): the use counts of the last ghost_factor * n removed
// objects, by a 64-bit fingerprint of the key (FNV-1a), oldest first in a ring
// of (fingerprint, count) with an open-addressing index of ring positions:
// 17-35 bytes per ghost (it was a table of 16-byte cells and a FIFO of 16-byte
// entries, 58 B a ghost: with the default ghost_factor of 4, 232 B for every
// object a full node holds, more than the rest of its bookkeeping). The
// fingerprint comes with the insert (a ghost's count back) and with the
// remove (a new ghost); a slot does not keep it (8 B an object less).
//
// NONE tracks only which slots it holds and their sizes (8 bytes a slot) and
// proposes nothing.
//
// Victims: pop() takes the best slot out of the heap; the caller either removes
// it (an eviction, if it is the one last proposed) or keeps it, and hands every
// kept one back with restore() once its iteration ends.
//
// Thread safety: none; the node's lock serialises every call.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kvstore_native {

enum class PolicyKind : int { LRU = 0, LFU = 1, DEFAULT = 2, NONE = 3 };

struct PolicyParams {
    PolicyKind kind = PolicyKind::LRU;
    bool leaf_first = false;
    double protect_s = 0.0;
    double ghost_factor = 0.0;
    double fade_ratio = 1.0;
    double retention_weight = 1.0;
};

// FNV-1a 64 (Fowler, Noll, Vo; the IETF draft-eastlake-fnv): a stable key fingerprint.
uint64_t fnv1a64(std::string_view bytes);

class GhostHistory {
 public:
    // The use count remembered for fp, forgotten now; 0 when none.
    uint32_t take(uint64_t fp);
    // Remembers (or refreshes, as the newest) fp's use count. fp != 0.
    void put(uint64_t fp, uint32_t freq);
    // Forgets the oldest until at most `limit` remain.
    void trim(size_t limit);
    size_t size() const { return live_; }
    size_t bytes() const {
        return fps_.capacity() * sizeof(uint64_t) + freqs_.capacity() * sizeof(uint32_t) +
               index_.capacity() * sizeof(uint32_t);
    }
    std::string check() const;        // "" when the ring and its index agree

 private:
    // The ring: ghosts oldest first at absolute positions head_ .. tail_ - 1 (at
    // index p & (capacity - 1), a power of two); fingerprint 0 marks one taken or
    // refreshed since (dead), skipped at the head and dropped by a relayout.
    std::vector<uint64_t> fps_;
    std::vector<uint32_t> freqs_;
    uint64_t head_ = 0, tail_ = 0;
    // fingerprint -> its ring index + 1 (0: empty); linear probing, at most 3/4
    // full, backward-shift deletion (Knuth, TAOCP vol. 3, 6.4, Algorithm R).
    std::vector<uint32_t> index_;
    size_t live_ = 0;

    size_t home(uint64_t fp) const;
    size_t find(uint64_t fp) const;   // its index cell, or index_.size()
    void unindex(size_t cell);
    void reindex(size_t cells);       // an index of `cells` over the live ring
    void relayout(size_t capacity);   // the live ghosts, in order, into a new ring
    void forget(size_t cell);         // the ghost of an index cell: dead, unindexed
};

class EvictionCore {
 public:
    // Raises std::invalid_argument: an unknown kind.
    explicit EvictionCore(const PolicyParams& params);

    // A new object is resident at `slot` (a tracked slot: an access instead).
    // parent: the slot of the previous block of its prefix chain, or -1;
    // ignored when not tracked. fp: its key's fingerprint (its ghost's use
    // count is taken back; 0: no key).
    // Raises std::invalid_argument: slot < 0 or > kMaxSlot.
    void insert(int64_t slot, uint64_t size, double now, int64_t parent, uint64_t fp);
    void access(int64_t slot, double now);      // untracked: ignored
    void prefetch(int64_t slot, double now);    // DEFAULT only: recency, not a use
    // fp: the key's fingerprint, remembered with its use count by the ghost
    // history (0: no key, kept out of it). Untracked: ignored.
    void remove(int64_t slot, uint64_t fp = 0);

    int64_t pop();                              // best slot out of the heap, or -1
    void propose(int64_t slot) { proposed_ = slot; }   // its remove() is an eviction
    void restore(const std::vector<int64_t>& held);    // requeue kept slots; ends proposing

    bool contains(int64_t slot) const;
    size_t size() const { return count_; }
    uint64_t used_bytes() const { return used_; }
    uint64_t size_of(int64_t slot) const;       // 0 when untracked
    uint32_t freq(int64_t slot) const;          // 0 when untracked (or NONE)
    size_t heap_size() const { return heap_.size(); }
    double retention_s() const { return retention_; }
    double credit_s() const;
    size_t ghosts() const { return ghosts_.size(); }
    size_t native_bytes() const;                // heap bytes of every array
    std::string check() const;                  // "" when the bookkeeping holds

    static constexpr int64_t kMaxSlot = (int64_t(1) << 31) - 2;

 private:
    struct Entry {
        double last_access;
        double score;        // DEFAULT: the credit fixed at its last (re)queue
        uint64_t seq;        // 0: untracked
        uint64_t size;
        int32_t parent;      // -1: none
        uint32_t parent_gen;
        uint32_t gen;
        uint32_t children;
        uint32_t freq;
        int32_t heap_pos;    // -1: not in the heap
    };
    static_assert(sizeof(Entry) == 56, "one per slot: 56 bytes");

    static constexpr size_t kChunk = 4096;    // entries per chunk: no 2x growth at 10M slots
    Entry& at(int64_t slot) { return chunks_[size_t(slot) / kChunk][size_t(slot) % kChunk]; }
    const Entry& at(int64_t slot) const {
        return chunks_[size_t(slot) / kChunk][size_t(slot) % kChunk];
    }
    size_t slots() const { return chunks_.size() * kChunk; }
    void reach(int64_t slot);                   // make room for entries up to slot

    bool less(int32_t a, int32_t b) const;
    void requeue(int32_t slot);                 // into the heap at its kept score
    void push(int32_t slot);                    // (re)queue at its current priority
    void heap_remove(int32_t slot);
    void sift_up(size_t i);
    void sift_down(size_t i);
    void place(size_t i, int32_t slot) { heap_[i] = slot; at(slot).heap_pos = int32_t(i); }
    bool tracked(int64_t slot) const;
    int32_t live_parent(const Entry& e) const;  // -1 when gone

    PolicyParams p_;
    std::vector<std::unique_ptr<Entry[]>> chunks_;
    std::vector<int32_t> heap_;
    std::vector<uint64_t> none_size_;           // NONE: size + 1 per tracked slot, else 0
    GhostHistory ghosts_;
    size_t count_ = 0;
    uint64_t used_ = 0;
    uint64_t seq_ = 0;
    double clock_;
    double retention_ = 0.0;
    int64_t proposed_ = -1;
};

}  // namespace kvstore_native
