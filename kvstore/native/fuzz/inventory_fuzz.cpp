// libFuzzer target of the inventory chunk decoder and its apply (inventory_wire.hpp,
// entry_inventory.hpp): the bytes a node sends the master's SyncInventory. Built by
// .ci/native_checks.sh with
//   clang++ -fsanitize=fuzzer,address,undefined inventory_fuzz.cpp inventory_wire.cpp
//           entry_inventory.cpp entry_table.cpp xxh3.cpp
// and run for a bounded time; any trap, sanitizer report or leak fails CI.
//
// Properties checked on every input:
//  1. decode_inventory never reads past the input; an accepted chunk's keys lie
//     inside its bytes, are UTF-8, and its columns agree in length (<= max_items).
//  2. encode(decode(x)) decodes to the same items and header (a round trip).
//  3. Applying the chunk twice to an entry table, with the input choosing which
//     hash slots are owned and which items are deferred, stops only where the
//     rules say, keeps `listed` in bounds, and leaves a table whose counts and
//     key map agree with a recount (EntryTable::check).
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "entry_inventory.hpp"
#include "inventory_wire.hpp"

using namespace kvstore_native;

namespace {

void check(bool ok) {
    if (!ok) __builtin_trap();
}

constexpr size_t kMaxItems = 64;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    std::string raw(reinterpret_cast<const char*>(data), size);
    InventoryChunk c;
    if (!decode_inventory(raw, kMaxItems, c).empty()) return 0;
    check(c.size() <= kMaxItems && c.size() == std::min(c.count, kMaxItems));
    check(c.key_size.size() == c.size() && c.tier.size() == c.size() &&
          c.repeated.size() == c.size() && c.key_hash.size() == c.size());
    std::vector<InventoryRow> rows;
    for (size_t i = 0; i < c.size(); ++i) {
        check(size_t(c.key_offset[i]) + c.key_size[i] <= c.raw.size());
        check(valid_utf8(c.key(i)));
        rows.push_back(InventoryRow{c.key(i), c.object_id[i], c.size_bytes[i], c.checksum[i],
                                    c.tier[i], c.pending[i] != 0, c.replica_num[i]});
    }
    check(valid_utf8(c.node_id) && valid_utf8(c.incarnation));

    std::string again;
    encode_inventory(c.node_id, c.incarnation, c.sync_id, c.seq, c.last, rows, again);
    InventoryChunk d;
    check(decode_inventory(again, kMaxItems, d).empty());
    check(d.size() == c.size() && d.node_id == c.node_id && d.incarnation == c.incarnation &&
          d.sync_id == c.sync_id && d.seq == c.seq && d.last == c.last);
    for (size_t i = 0; i < c.size(); ++i)
        check(d.key(i) == c.key(i) && d.object_id[i] == c.object_id[i] &&
              d.size_bytes[i] == c.size_bytes[i] && d.checksum[i] == c.checksum[i] &&
              d.tier[i] == c.tier[i] && d.pending[i] == c.pending[i] &&
              d.replica_num[i] == c.replica_num[i] && d.repeated[i] == c.repeated[i]);

    // Apply: the input's first bytes choose the owned slots (0, 1 or 2 each) and the
    // deferred items; a stop is "applied by the caller" as a skip.
    std::vector<uint8_t> owned(kKeySlots), defer(c.size());
    for (size_t i = 0; i < kKeySlots; ++i) owned[i] = size ? data[i % size] % 3 : 1;
    for (size_t i = 0; i < c.size(); ++i) defer[i] = size && (data[(i * 7) % size] & 16);
    EntryTable t;
    for (int round = 0; round < 2; ++round) {
        std::vector<uint8_t> listed(t.positions() + c.size() + 1, 0);
        InventoryApplyArgs a;
        a.node = uint16_t(round);
        a.now_ms = 1;
        a.owned = owned.data();
        a.defer = round ? defer.data() : nullptr;
        a.listed = listed.data();
        a.n_listed = listed.size();
        a.max_objects = 3;
        size_t i = 0;
        while (i < c.size()) {
            InventoryApplied r = inventory_apply(t, c, i, c.size(), a);
            check(r.stop >= i && r.stop <= c.size());
            check(r.over_limit <= r.inserted);
            i = r.stop + 1;
        }
        check(t.check().empty());
    }
    return 0;
}
