// A node's inventory chunk (inventory_wire.hpp) applied to the master's entry table,
// the common cases in one call, the others left to the full rules in Python.
//
// Pure C++ (no Python types); the binding is inventory_bind.cpp. The rules are
// kvstore/master/inventory.py's (InventorySync.apply): this applies, in the
// chunk's order, only the items whose outcome needs nothing but the table, and
// stops at the first item that needs more, which the caller applies with the
// full rules before calling again from the next one. So the items are applied
// in order, each by the same rule as in Python:
//
//     key not in this shard's slots      -> skipped (another shard's key)
//     key absent, pending                -> nothing (its replayed STORED decides)
//     key indexed, same object id        -> this node a replica (its tier); pending: kept
//     key absent, not pending            -> indexed, this node its replica
//     anything else                      -> stop: the caller's rules
//
// "Anything else": an entry of another object id (a superseded or older version,
// a pending item of another version), a key that is not 32 lowercase hex
// characters (the caller validates it), a key whose hash came earlier in the
// chunk (a decision about it may have changed what the caller knows), an item
// the caller marks in `defer` (keys it holds notes about: superseded versions,
// drops ordered to the node), a key of a hash slot the caller marks neither
// ours nor another shard's in `owned`, and a table at 2^32 - 1 slots.
#pragma once

#include <cstddef>
#include <cstdint>

#include "entry_table.hpp"
#include "inventory_wire.hpp"

namespace kvstore_native {

// Hash slots of the key space (kvstore/keys.py NUM_SLOTS): a key's slot is its
// XXH3-64 modulo this.
constexpr size_t kKeySlots = 16384;

struct InventoryApplyArgs {
    uint16_t node = kNoNode;        // the registering node's number
    int64_t now_ms = 0;             // created_ms of the entries indexed
    const uint8_t* owned = nullptr; // kKeySlots bytes: 1 where this shard owns the slot, 0
                                    //   where another does (skipped), else the caller's rules
    const uint8_t* defer = nullptr; // null, or c.size() bytes: 1 = the caller's rules
    uint8_t* listed = nullptr;      // null, or n_listed bytes: 1 at the slot of each entry
    size_t n_listed = 0;            //   the node's version is kept in (>= positions() + items)
    uint64_t max_objects = ~0ull;   // past this many entries an insert counts over_limit
};

struct InventoryApplied {
    size_t stop = 0;                // the first item left to the caller (== end: none)
    uint64_t inserted = 0;          // entries indexed
    uint64_t inserted_bytes = 0;
    uint64_t over_limit = 0;        // of them, indexed at or past max_objects
    uint64_t max_object_id = 0;     // largest object id of the items past the pending check
};

// Applies items [start, end) of `c` (see the file comment) until one needs the
// caller. `a.listed` must hold positions() + (end - start) bytes (checked by the
// binding: each insert may add one position).
InventoryApplied inventory_apply(EntryTable& t, const InventoryChunk& c, size_t start,
                                 size_t end, const InventoryApplyArgs& a);

}  // namespace kvstore_native
