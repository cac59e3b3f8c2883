// Python binding of the master's entry table (entry_table.hpp): kvstore._native.EntryTable.
//
// Thin: each method converts its arguments, calls the core, converts the result.
// Batch calls (lookup, exists, list, the scans) take the keys' UTF-8 bytes while
// holding the GIL, then release it for the loop over the table. Node ids are
// small integers interned by the caller (kvstore/master/entries.py); `alive`,
// `gone` and `listed` are bytes-like masks indexed by node or by slot.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>

#include "entry_table.hpp"
#include "module.hpp"

namespace py = pybind11;

namespace kvstore_native {
namespace {

std::string_view utf8(PyObject* o) {
    Py_ssize_t n = 0;
    const char* p = PyUnicode_AsUTF8AndSize(o, &n);
    if (!p) throw py::error_already_set();
    if (size_t(n) > kMaxKeyBytes) throw py::value_error("key over 512 bytes");
    return std::string_view(p, size_t(n));
}

std::string_view utf8(const py::handle& h) { return utf8(h.ptr()); }

// A key to look for: false when it cannot be indexed (not str, not UTF-8, over
// 512 bytes), which a lookup answers as absent instead of raising.
bool probe_key(PyObject* o, std::string_view* out) {
    Py_ssize_t n = 0;
    const char* p = PyUnicode_Check(o) ? PyUnicode_AsUTF8AndSize(o, &n) : nullptr;
    if (!p) {
        PyErr_Clear();
        return false;
    }
    if (size_t(n) > kMaxKeyBytes) return false;
    *out = std::string_view(p, size_t(n));
    return true;
}

// Any string's UTF-8 bytes (a prefix or cursor), unbounded.
std::string text(const py::handle& h) {
    Py_ssize_t n = 0;
    const char* p = PyUnicode_AsUTF8AndSize(h.ptr(), &n);
    if (!p) throw py::error_already_set();
    return std::string(p, size_t(n));
}

struct Mask {
    const uint8_t* data = nullptr;
    size_t size = 0;
    py::buffer_info info;
    explicit Mask(const py::buffer& b) : info(b.request()) {
        data = static_cast<const uint8_t*>(info.ptr);
        size = size_t(info.size * info.itemsize);
    }
};

py::tuple replica_tuple(const std::vector<ReplicaRef>& reps) {
    py::tuple t(reps.size());
    for (size_t i = 0; i < reps.size(); ++i)
        t[i] = py::make_tuple(reps[i].node, reps[i].tier);
    return t;
}

Slot check_slot(const EntryTable& t, int64_t s) {
    if (s < 0 || !t.used(Slot(s))) throw py::index_error("no entry at slot " + std::to_string(s));
    return Slot(s);
}

std::vector<std::string_view> keys_of(const py::list& keys) {
    std::vector<std::string_view> out;
    out.reserve(keys.size());
    for (const auto& k : keys) out.push_back(utf8(k));
    return out;
}

void register_entry_table(py::module_& m) {

    py::class_<EntryTable>(m, "EntryTable", R"doc(
A master shard's entries in a compact native table (kvstore/native/entry_table.hpp).

Entries are addressed by key or by slot (an int, stable while the entry lives).
Nodes are small ints (0-65534), tiers the wire enum values (0-3); times are ms.
Not thread-safe: one owner (the master's event loop).)doc")
        .def(py::init<>())
        .def("__len__", &EntryTable::size)
        .def("positions", &EntryTable::positions,
             "Slots handed out so far: scans run over range(positions()).")
        .def("memory_bytes", &EntryTable::memory_bytes,
             "Bytes of the records and buckets (the side tables excluded).")
        .def("find", [](const EntryTable& t, py::handle key) -> int64_t {
            std::string_view k;
            if (!probe_key(key.ptr(), &k)) return -1;
            Slot s = t.find(make_key(k));
            return s == kNoSlot ? -1 : int64_t(s);
        }, "The slot of `key`, or -1.")
        .def("insert", [](EntryTable& t, py::handle key, uint64_t size_bytes, uint64_t checksum,
                          uint64_t object_id, int64_t created_ms, int replica_num, uint16_t node,
                          uint8_t tier) -> int64_t {
            KeyRef k = make_key(utf8(key));
            if (t.find(k) != kNoSlot) throw py::key_error("key is indexed already");
            if (t.positions() >= kNoSlot - 1 && t.size() == t.positions())
                throw std::length_error("entry table full (2^32 - 1 slots)");
            if (node == kNoNode) throw py::value_error("node 65535 is reserved");
            return t.insert(k, size_bytes, checksum, object_id, created_ms,
                            uint8_t(std::max(1, std::min(replica_num, 255))), node, tier & 3);
        }, "Index a new entry with one replica; returns its slot. Raises KeyError if held.")
        .def("remove", [](EntryTable& t, int64_t s) { t.remove(check_slot(t, s)); })
        .def("key", [](const EntryTable& t, int64_t s) { return t.key(check_slot(t, s)); })
        .def("head", [](const EntryTable& t, int64_t s) {
            const EntryRecord& r = t.rec(check_slot(t, s));
            return py::make_tuple(r.object_id, r.size_bytes, r.checksum);
        }, "(object_id, size_bytes, checksum) of the entry at slot `s`.")
        .def("record", [](const EntryTable& t, int64_t s) {
            Slot x = check_slot(t, s);
            const EntryRecord& r = t.rec(x);
            std::vector<ReplicaRef> reps;
            t.replicas(x, reps);
            uint16_t target = t.repair_target(x);
            return py::make_tuple(t.key(x), r.size_bytes, r.checksum, r.object_id, r.created_ms,
                                  r.access_count, r.last_access_ms, r.replica_num,
                                  replica_tuple(reps),
                                  target == kNoNode ? -1 : int(target), t.repair_deadline(x));
        }, "(key, size_bytes, checksum, object_id, created_ms, access_count, last_access_ms, "
           "replica_num, ((node, tier), ...), repair_target or -1, repair_deadline_ms).")
        .def("replicas", [](const EntryTable& t, int64_t s) {
            std::vector<ReplicaRef> reps;
            t.replicas(check_slot(t, s), reps);
            return replica_tuple(reps);
        }, "((node, tier), ...) in the order they were added.")
        .def("nodes", [](const EntryTable& t, int64_t s) {
            std::vector<ReplicaRef> reps;
            t.replicas(check_slot(t, s), reps);
            py::list out(reps.size());
            for (size_t i = 0; i < reps.size(); ++i) out[i] = py::int_(reps[i].node);
            return out;
        }, "The replicas' nodes, in order.")
        .def("set_replicas", [](EntryTable& t, int64_t s, const std::vector<std::pair<int, int>>& r) {
            std::vector<ReplicaRef> reps;
            for (auto [n, tier] : r) reps.push_back(ReplicaRef{uint16_t(n), uint8_t(tier & 3)});
            t.set_replicas(check_slot(t, s), reps);
        })
        .def("has_replica", [](const EntryTable& t, int64_t s, uint16_t node) {
            return t.has_replica(check_slot(t, s), node);
        })
        .def("add_replica", [](EntryTable& t, int64_t s, uint16_t node, uint8_t tier) {
            Slot x = check_slot(t, s);
            if (!t.has_replica(x, node)) t.add_replica(x, node, tier & 3);
            else t.set_tier(x, node, tier & 3);
        }, "Add `node` as a replica in `tier` (or set its tier if it is one).")
        .def("remove_replica", [](EntryTable& t, int64_t s, uint16_t node) {
            return t.remove_replica(check_slot(t, s), node);
        }, "Forget `node` as a replica; False when it was none.")
        .def("set_tier", [](EntryTable& t, int64_t s, uint16_t node, uint8_t tier) {
            return t.set_tier(check_slot(t, s), node, tier & 3);
        })
        .def("replica_num", [](const EntryTable& t, int64_t s) {
            return int(t.rec(check_slot(t, s)).replica_num);
        })
        .def("set_replica_num", [](EntryTable& t, int64_t s, int n) {
            t.rec(check_slot(t, s)).replica_num = uint8_t(std::max(1, std::min(n, 255)));
        })
        .def("repair", [](const EntryTable& t, int64_t s) {
            Slot x = check_slot(t, s);
            uint16_t target = t.repair_target(x);
            return py::make_tuple(target == kNoNode ? -1 : int(target), t.repair_deadline(x));
        }, "(target node or -1, deadline ms) of the repair copy in flight.")
        .def("set_repair", [](EntryTable& t, int64_t s, int target, int64_t deadline_ms) {
            t.set_repair(check_slot(t, s), target < 0 ? kNoNode : uint16_t(target), deadline_ms);
        }, "Note a repair copy to `target` until `deadline_ms` (target -1: none).")
        .def("visible", [](const EntryTable& t, int64_t s, const py::buffer& alive) {
            Mask a(alive);
            return t.visible(check_slot(t, s), a.data, a.size);
        })
        .def("live_nodes", [](const EntryTable& t, int64_t s, const py::buffer& alive) {
            Mask a(alive);
            std::vector<ReplicaRef> reps;
            t.live_replicas(check_slot(t, s), a.data, a.size, reps);
            py::list out(reps.size());
            for (size_t i = 0; i < reps.size(); ++i) out[i] = py::int_(reps[i].node);
            return out;
        })
        .def("stored_probe", [](const EntryTable& t, py::handle key, uint64_t object_id,
                                uint64_t size_bytes, uint64_t checksum, uint16_t node) {
            Slot s = kNoSlot;
            std::string_view k;
            int code = probe_key(key.ptr(), &k)
                ? t.stored_probe(make_key(k), object_id, size_bytes, checksum, node, &s)
                : int(kProbeAbsent);
            return py::make_tuple(code, s == kNoSlot ? int64_t(-1) : int64_t(s));
        }, "(code, slot) of a STORED report: 0 absent, 1 another version, 2 this version "
           "with other bytes, 3 a replica already, 4 a new replica of this version.")
        .def("lookup", [](EntryTable& t, const py::list& keys, int64_t now_ms,
                          const py::buffer& alive) {
            Mask a(alive);
            std::vector<std::string_view> ks = keys_of(keys);
            std::vector<Slot> slots(ks.size());
            std::vector<uint8_t> vis(ks.size());
            {
                py::gil_scoped_release unlocked;
                for (size_t i = 0; i < ks.size(); ++i) {
                    Slot s = t.find(make_key(ks[i]));
                    slots[i] = s;
                    vis[i] = s != kNoSlot && t.visible(s, a.data, a.size);
                    if (vis[i]) {
                        EntryRecord& r = t.rec(s);
                        if (r.access_count != 0xffffffffu) ++r.access_count;
                        r.last_access_ms = now_ms;
                    }
                }
            }
            py::list out(ks.size());
            std::vector<ReplicaRef> reps;
            for (size_t i = 0; i < ks.size(); ++i) {
                Slot s = slots[i];
                if (s == kNoSlot) {
                    out[i] = py::none();
                    continue;
                }
                if (!vis[i]) {
                    t.replicas(s, reps);
                    py::list dead(reps.size());
                    for (size_t j = 0; j < reps.size(); ++j) dead[j] = py::int_(reps[j].node);
                    out[i] = dead;
                    continue;
                }
                const EntryRecord& r = t.rec(s);
                t.live_replicas(s, a.data, a.size, reps);
                out[i] = py::make_tuple(r.size_bytes, r.checksum, r.object_id, r.created_ms,
                                        r.access_count, r.last_access_ms, replica_tuple(reps));
            }
            return out;
        }, R"doc(Per key: None (absent); a list of its replicas' nodes when none of them is
alive (not readable); else (size_bytes, checksum, object_id, created_ms, access_count,
last_access_ms, ((node, tier), ...) live only), counting the access at `now_ms`.)doc")
        .def("exists", [](const EntryTable& t, const py::list& keys, const py::buffer& alive) {
            Mask a(alive);
            std::vector<std::string_view> ks = keys_of(keys);
            std::vector<uint8_t> vis(ks.size());
            {
                py::gil_scoped_release unlocked;
                for (size_t i = 0; i < ks.size(); ++i) {
                    Slot s = t.find(make_key(ks[i]));
                    vis[i] = s != kNoSlot && t.visible(s, a.data, a.size);
                }
            }
            py::list out(ks.size());
            for (size_t i = 0; i < ks.size(); ++i) out[i] = py::bool_(vis[i] != 0);
            return out;
        }, "Per key, whether it is indexed with a live replica.")
        .def("unavailable", [](const EntryTable& t, const py::buffer& alive) {
            Mask a(alive);
            auto [objects, bytes] = t.unavailable(a.data, a.size);
            return py::make_tuple(objects, bytes);
        }, "(objects, bytes) no live node holds: O(sets of holders).")
        .def("tenant_usage", [](const EntryTable& t, py::handle name) {
            auto [objects, bytes] = t.tenant_usage(text(name));
            return py::make_tuple(objects, bytes);
        }, "(objects, bytes) of tenant `name`'s entries (keys \"@name/...\"); (0, 0) for "
           "\"default\" (the rest of the table) and unknown names: O(1).")
        .def("tenants", [](const EntryTable& t) {
            py::dict out;
            for (const auto& [name, ob] : t.tenants())
                out[py::str(name)] = py::make_tuple(ob.first, ob.second);
            return out;
        }, "Every named tenant with entries: {name: (objects, bytes)} (the default tenant's "
           "are the rest of the table).")
        .def("check", [](const EntryTable& t) {
            std::string err = t.check();
            if (!err.empty()) throw std::logic_error("entry table: " + err);
        }, "Raises RuntimeError when the counts by holders or the key map disagree with a "
           "recount (tests).")
        .def("forget_slice", [](EntryTable& t, size_t start, size_t count, const py::buffer& gone) {
            Mask g(gone);
            SliceResult r;
            {
                py::gil_scoped_release unlocked;
                r = t.forget_slice(start, count, g.data, g.size);
            }
            return py::make_tuple(r.next, r.deleted, r.deleted_bytes);
        }, R"doc(Drop the replicas on nodes marked in `gone` of slots [start, start + count)
(a repair to one is given up; an entry left without replicas is deleted).
Returns (next start, entries deleted, their bytes).)doc")
        .def("sweep_slice", [](EntryTable& t, size_t start, size_t count, uint16_t node,
                               const py::buffer& listed) {
            Mask l(listed);
            SliceResult r;
            {
                py::gil_scoped_release unlocked;
                r = t.sweep_slice(start, count, node, l.data, l.size);
            }
            return py::make_tuple(r.next, r.deleted, r.deleted_bytes);
        }, R"doc(Drop `node` as a replica of the slots in [start, start + count) not marked in
`listed` (an entry left without replicas is deleted). Returns (next, deleted, bytes).)doc")
        .def("short_slice", [](EntryTable& t, size_t start, size_t count, int64_t now_ms,
                               const py::buffer& alive) {
            Mask a(alive);
            std::vector<ShortEntry> found;
            uint64_t in_flight = 0, timeouts = 0;
            size_t next;
            {
                py::gil_scoped_release unlocked;
                next = t.short_slice(start, count, now_ms, a.data, a.size, found, &in_flight,
                                     &timeouts);
            }
            py::list out(found.size());
            for (size_t i = 0; i < found.size(); ++i)
                out[i] = py::make_tuple(found[i].slot, py::cast(found[i].live));
            return py::make_tuple(next, out, in_flight, timeouts);
        }, R"doc(Entries of slots [start, start + count) with a live replica but fewer than
wanted and no repair in flight (a repair past its deadline at `now_ms` is given up).
Returns (next, [(slot, [live nodes])], repairs in flight, repairs timed out).)doc")
        .def("list", [](const EntryTable& t, py::handle prefix, py::handle start_after,
                        size_t limit, const py::buffer& alive) {
            Mask a(alive);
            std::string p(text(prefix)), after(text(start_after));
            std::vector<Slot> slots;
            {
                py::gil_scoped_release unlocked;
                slots = t.list(p, after, limit, a.data, a.size);
            }
            return slots;
        }, R"doc(Slots of the visible keys starting with `prefix`, above `start_after` (if
not empty), in key order (UTF-8 bytes: Python's str order), at most `limit`: one scan of
every entry (about 0.1-0.3 s at 10M entries).)doc");
}

Registered reg_entry_table(&register_entry_table);

}  // namespace
}  // namespace kvstore_native
