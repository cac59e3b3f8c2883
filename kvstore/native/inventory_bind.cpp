// Python binding of inventory chunks (inventory_wire.hpp, entry_inventory.hpp):
// kvstore._native.InventoryChunk (the master decodes a SyncInventoryRequest into
// one and applies it to its EntryTable) and kvstore._native.encode_inventory
// (the node serializes its chunk from rows). Thin: conversions only.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>

#include "entry_inventory.hpp"
#include "inventory_wire.hpp"
#include "module.hpp"

namespace py = pybind11;

namespace kvstore_native {
namespace {

size_t check_item(const InventoryChunk& c, int64_t i) {
    if (i < 0 || size_t(i) >= c.size()) throw py::index_error("no item " + std::to_string(i));
    return size_t(i);
}

py::str key_str(const InventoryChunk& c, size_t i) {
    std::string_view k = c.key(i);
    return py::str(k.data(), k.size());   // valid UTF-8: checked by the decoder
}

// A read-only or writable bytes-like argument (None: null).
struct Buf {
    py::buffer_info info;
    uint8_t* data = nullptr;
    size_t size = 0;
    Buf(const py::object& o, bool writable) {
        if (o.is_none()) return;
        info = o.cast<py::buffer>().request(writable);
        data = static_cast<uint8_t*>(info.ptr);
        size = size_t(info.size * info.itemsize);
    }
};

uint64_t u64(PyObject* o) {
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) throw py::error_already_set();
    return v;
}

void register_inventory(py::module_& m) {
    py::class_<InventoryChunk>(m, "InventoryChunk", R"doc(
A SyncInventoryRequest decoded into columns (kvstore/native/inventory_wire.hpp): its
header fields as attributes, its items by position (len() counts every item sent; at
most `max_items` of them are kept).)doc")
        .def_static("decode", [](const py::bytes& raw, size_t max_items) {
            std::string bytes = raw;
            auto c = std::make_unique<InventoryChunk>();
            std::string err;
            {
                py::gil_scoped_release unlocked;
                err = decode_inventory(std::move(bytes), max_items, *c);
            }
            if (!err.empty()) throw py::value_error("not a SyncInventoryRequest: " + err);
            return c;
        }, py::arg("raw"), py::arg("max_items"), R"doc(Decode a serialized SyncInventoryRequest.

Raises:
    ValueError: the bytes are not one (truncated, a length past the end, invalid UTF-8 ...).)doc")
        .def("__len__", [](const InventoryChunk& c) { return c.count; })
        .def_property_readonly("node_id", [](const InventoryChunk& c) { return c.node_id; })
        .def_property_readonly("incarnation", [](const InventoryChunk& c) { return c.incarnation; })
        .def_readonly("sync_id", &InventoryChunk::sync_id)
        .def_readonly("seq", &InventoryChunk::seq)
        .def_readonly("last", &InventoryChunk::last)
        .def("stored", &InventoryChunk::size, "Items kept (min(len(), max_items)).")
        .def("item", [](const InventoryChunk& c, int64_t i) {
            size_t x = check_item(c, i);
            return py::make_tuple(key_str(c, x), c.object_id[x], c.size_bytes[x], c.checksum[x],
                                  c.tier[x], bool(c.pending[x]), c.replica_num[x]);
        }, "(key, object_id, size_bytes, checksum, tier, pending, replica_num) as sent.")
        .def("key", [](const InventoryChunk& c, int64_t i) { return key_str(c, check_item(c, i)); })
        .def("first_invalid", &first_invalid_item, py::arg("max_object_id"),
             py::arg("max_replicas"), "The first item no node could hold (object id outside "
             "[1, max_object_id], replica_num above max_replicas, a tier not 0-3), or -1.")
        .def("apply", [](const InventoryChunk& c, EntryTable& t, size_t start, size_t end,
                         uint16_t node, int64_t now_ms, const py::object& owned,
                         const py::object& defer, const py::object& listed,
                         uint64_t max_objects) {
            Buf o(owned, false), d(defer, false), l(listed, true);
            if (o.size < kKeySlots) throw py::value_error("owned: one byte per hash slot (16384)");
            end = std::min(end, c.size());
            if (d.data && d.size < c.size()) throw py::value_error("defer: one byte per item");
            if (l.data && l.size < t.positions() + (end - std::min(start, end)))
                throw py::value_error("listed: positions() + items bytes at least");
            if (node == kNoNode) throw py::value_error("node 65535 is reserved");
            InventoryApplyArgs a;
            a.node = node;
            a.now_ms = now_ms;
            a.owned = o.data;
            a.defer = d.data;
            a.listed = l.data;
            a.n_listed = l.size;
            a.max_objects = max_objects;
            InventoryApplied r;
            {
                py::gil_scoped_release unlocked;
                r = inventory_apply(t, c, start, end, a);
            }
            return py::make_tuple(r.stop, r.inserted, r.inserted_bytes, r.over_limit,
                                  r.max_object_id);
        }, py::arg("table"), py::arg("start"), py::arg("end"), py::arg("node"),
           py::arg("now_ms"), py::arg("owned"), py::arg("defer"), py::arg("listed"),
           py::arg("max_objects"), R"doc(Apply items [start, end) to `table` for node number
`node` until one needs the caller's rules (kvstore/native/entry_inventory.hpp).

Args:
    owned: 16384 bytes, 1 where this shard owns the hash slot, 0 where another shard
        does (its keys are skipped), else (2) leave its keys to the caller.
    defer: None, or a byte per item: 1 = leave it to the caller.
    listed: None, or a writable buffer of positions() + (end - start) bytes at least:
        1 is written at the slot of every entry this node's version is kept in.
    max_objects: an entry indexed at or past this many counts over the limit.

Returns:
    (stop: the first item left to the caller, or end; entries indexed; their bytes;
    of them over the limit; the largest object id past the pending check, or 0).)doc");

    m.def("encode_inventory", [](const std::string& node_id, const std::string& incarnation,
                                 uint64_t sync_id, uint32_t seq, bool last, const py::list& rows) {
        std::vector<InventoryRow> out;
        out.reserve(rows.size());
        for (const auto& h : rows) {
            PyObject* row = h.ptr();
            if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 7)
                throw py::type_error("a row is (key, object_id, size_bytes, checksum, tier, "
                                     "pending, replica_num)");
            Py_ssize_t n = 0;
            const char* k = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(row, 0), &n);
            if (!k) throw py::error_already_set();
            long tier = PyLong_AsLong(PyTuple_GET_ITEM(row, 4));
            if (tier == -1 && PyErr_Occurred()) throw py::error_already_set();
            int pending = PyObject_IsTrue(PyTuple_GET_ITEM(row, 5));
            if (pending < 0) throw py::error_already_set();
            uint64_t replicas = u64(PyTuple_GET_ITEM(row, 6));
            if (tier < 0 || tier > 3 || replicas > 0xffffffffu)
                throw py::value_error("a tier is 0-3, a replica_num 32 bits");
            out.push_back(InventoryRow{std::string_view(k, size_t(n)), u64(PyTuple_GET_ITEM(row, 1)),
                                       u64(PyTuple_GET_ITEM(row, 2)), u64(PyTuple_GET_ITEM(row, 3)),
                                       int32_t(tier), pending != 0, uint32_t(replicas)});
        }
        std::string raw;
        raw.reserve(64 + rows.size() * 56);
        encode_inventory(node_id, incarnation, sync_id, seq, last, out, raw);
        return py::bytes(raw);
    }, py::arg("node_id"), py::arg("incarnation"), py::arg("sync_id"), py::arg("seq"),
       py::arg("last"), py::arg("rows"), R"doc(A serialized SyncInventoryRequest of `rows`,
each (key, object_id, size_bytes, checksum, tier 0-3, pending, replica_num): the bytes
protobuf's serializer makes of the same message.

Raises:
    TypeError, ValueError, OverflowError: a row of another shape or out of range.)doc");
}

Registered reg_inventory(&register_inventory);

}  // namespace
}  // namespace kvstore_native
