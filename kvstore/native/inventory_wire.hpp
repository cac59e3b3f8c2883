// A node's inventory chunk on the wire: a serialized SyncInventoryRequest
// (proto/kvstore.proto), decoded into columns on the master and encoded from
// rows on the node, without a protobuf object per item.
//
// Pure C++ (no Python types): the binding is inventory_bind.cpp, the fuzz target
// fuzz/inventory_fuzz.cpp links this file alone.
//
// The format is protobuf's published wire encoding (varints, length-delimited
// fields: https://protobuf.dev/programming-guides/encoding/), written from that
// specification. Decoding follows what the Python protobuf runtime accepts:
//
//     field 1 node_id, 2 incarnation   UTF-8 strings (invalid UTF-8: refused)
//     field 3 sync_id, 4 seq, 6 last   varints (seq truncated to 32 bits, last != 0)
//     field 5 items                    InventoryItem messages, each into the columns:
//         1 key (UTF-8), 2 object_id, 3 size_bytes, 4 checksum, 5 tier (int32),
//         6 pending, 7 replica_num (uint32)
//     other fields, or a known field with another wire type: skipped
//     a later value of a field replaces an earlier one
//
// Refused (the whole chunk, nothing applied): a truncated varint or field, a
// length past the bytes left, wire types 3/4/6/7, field number 0, invalid UTF-8
// in a string. Every length is checked against the bytes left before use; items
// past `max_items` are parsed (so the count is exact) but not stored, and the
// caller refuses the chunk by its count. A chunk over 4 GiB is refused (key
// offsets are 32-bit).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvstore_native {

struct InventoryChunk {
    std::string raw;                  // the request's bytes (keys point into them)
    std::string node_id, incarnation;
    uint64_t sync_id = 0;
    uint32_t seq = 0;
    bool last = false;
    size_t count = 0;                 // items in the request (stored: min(count, max_items))
    // Columns, one row per stored item.
    std::vector<uint32_t> key_offset, key_size;
    std::vector<uint64_t> object_id, size_bytes, checksum;
    std::vector<int32_t> tier;        // as sent (the enum is open: any int32)
    std::vector<uint32_t> replica_num;
    std::vector<uint8_t> pending;
    std::vector<uint64_t> key_hash;   // XXH3-64 of the key (its hash slot: % 16384, keys.py)
    std::vector<uint8_t> repeated;    // 1: a key of the same hash came earlier in the chunk

    size_t size() const { return object_id.size(); }
    std::string_view key(size_t i) const {
        return std::string_view(raw.data() + key_offset[i], key_size[i]);
    }
};

// Decodes a serialized SyncInventoryRequest into `out` (its previous content is
// replaced). Returns "" or why the bytes are not one.
std::string decode_inventory(std::string raw, size_t max_items, InventoryChunk& out);

// The first stored item no node could hold: object id outside [1, max_object_id],
// replica_num above max_replicas, a tier outside 0-3; or -1.
int64_t first_invalid_item(const InventoryChunk& c, uint64_t max_object_id,
                           uint32_t max_replicas);

// One item for encode_inventory (the node side).
struct InventoryRow {
    std::string_view key;
    uint64_t object_id, size_bytes, checksum;
    int32_t tier;
    bool pending;
    uint32_t replica_num;
};

// Appends a serialized SyncInventoryRequest to `out`; fields at their default
// value are left out, as protobuf's serializer does (its bytes parse the same).
void encode_inventory(std::string_view node_id, std::string_view incarnation, uint64_t sync_id,
                      uint32_t seq, bool last, const std::vector<InventoryRow>& rows,
                      std::string& out);

// Whether `s` is well-formed UTF-8 (no overlong forms, no surrogates, <= U+10FFFF).
bool valid_utf8(std::string_view s);

}  // namespace kvstore_native
