// KeyMap: a store node's key -> object record map, with no string per key.
//
// A node looks up the record in service under a key on every operation, and
// keeps one entry per object: tens of millions. A dict entry costs the key's
// string (88 B for the 32 hex characters of a kvstore key) and 24-30 B of the
// dict's own; here an entry is one 8-byte cell naming the record's slot, and
// the key is read from the record itself, which keeps a hex key as its 16
// bytes (stored_object.cpp): 11-16 B an object in all.
//
//     slots   the table's list: slot -> record in service, or None (table.py)
//     parts   256 open-addressing tables (linear probing, at most 3/4 full, a
//             power of two each), chosen by the hash's top 8 bits, so a growth
//             copies a 256th of the cells (no long stall of the node's lock)
//     cell    (slot + 1) << 32 | the hash's low 32 bits (0: empty)
//
// A lookup hashes the key's compared form (stored_object.hpp: a hex key's 16
// bytes with xxh3-64 under a seed drawn at start, so keys chosen by a client
// cannot be made to collide; any other str by its own hash, randomised per
// process), probes for cells whose 32 bits match, and compares the key with
// the record at that slot. Deletion shifts the run back (Knuth, TAOCP vol. 3,
// 6.4, Algorithm R): no tombstones.
//
// A record enters under its own key at its own slot (``slots[record.slot] is
// record``), checked at insertion; the table keeps both in step (enter/_leave).
//
// Thread safety: under the GIL (nothing here releases it); the node's lock
// orders its users.
#include <Python.h>

#include <cstdint>
#include <new>
#include <random>
#include <vector>

#include "module.hpp"
#include "stored_object.hpp"
#include "xxh3.hpp"

namespace kvstore_native {
namespace {

constexpr size_t kParts = 256;
constexpr size_t kNone = ~size_t(0);

struct Part {
    std::vector<uint64_t> cells;
    size_t live = 0;
};

struct KeyMap {
    PyObject_HEAD
    PyObject* slots;      // a list
    Part* parts;
    Py_ssize_t len;
    uint64_t seed;
};

uint64_t key_hash(const KeyMap* m, const KeyRef& k) {
    if (k.bytes) return xxh3::hash64(k.bin, kKeyBytes, m->seed);
    // A str's hash (as a str's, whatever a subclass says: no Python code runs here),
    // cached in it and randomised per process; its bits spread.
    return uint64_t(PyUnicode_Type.tp_hash(k.str)) * 0x9E3779B97F4A7C15ull;
}

// The record at ``slot`` (borrowed), or null.
PyObject* record_at(const KeyMap* m, uint64_t slot) {
    if (slot >= uint64_t(PyList_GET_SIZE(m->slots))) return nullptr;
    PyObject* r = PyList_GET_ITEM(m->slots, Py_ssize_t(slot));
    return r == Py_None ? nullptr : r;
}

// The cell of key ``k`` in ``part``, or kNone.
size_t find(const KeyMap* m, const Part& part, uint32_t tag, const KeyRef& k) {
    if (part.cells.empty()) return kNone;
    const size_t mask = part.cells.size() - 1;
    for (size_t i = tag & mask;; i = (i + 1) & mask) {
        const uint64_t c = part.cells[i];
        if (c == 0) return kNone;
        if (uint32_t(c) != tag) continue;
        KeyRef rk;
        PyObject* rec = record_at(m, (c >> 32) - 1);
        if (rec != nullptr && record_key(rec, &rk) && key_equal(rk, k)) return i;
    }
}

void place(Part& part, uint64_t cell) {
    const size_t mask = part.cells.size() - 1;
    size_t i = uint32_t(cell) & mask;
    while (part.cells[i] != 0) i = (i + 1) & mask;
    part.cells[i] = cell;
}

void grow(Part& part) {
    std::vector<uint64_t> old;
    old.swap(part.cells);
    part.cells.assign(old.empty() ? 16 : old.size() * 2, 0);
    for (uint64_t c : old)
        if (c) place(part, c);
}

void erase(Part& part, size_t i) {
    const size_t mask = part.cells.size() - 1;
    size_t hole = i;
    for (size_t j = (i + 1) & mask; part.cells[j] != 0; j = (j + 1) & mask) {
        const size_t h = uint32_t(part.cells[j]) & mask;
        const bool stays = hole <= j ? (hole < h && h <= j) : (hole < h || h <= j);
        if (!stays) {
            part.cells[hole] = part.cells[j];
            hole = j;
        }
    }
    part.cells[hole] = 0;
    --part.live;
}

// The key's part, tag and cell (kNone: absent); false with TypeError: not a str.
bool locate(KeyMap* m, PyObject* key, KeyRef* k, Part** part, uint32_t* tag, size_t* cell) {
    if (!key_ref(key, k)) {
        PyErr_Format(PyExc_TypeError, "a key is a str, not %s", Py_TYPE(key)->tp_name);
        return false;
    }
    const uint64_t h = key_hash(m, *k);
    *part = &m->parts[h >> 56];
    *tag = uint32_t(h);
    *cell = find(m, **part, *tag, *k);
    return true;
}

PyObject* keymap_new(PyTypeObject* type, PyObject* args, PyObject* kwds) {
    PyObject* slots = nullptr;
    static const char* names[] = {"slots", nullptr};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!", const_cast<char**>(names), &PyList_Type,
                                     &slots))
        return nullptr;
    auto* self = reinterpret_cast<KeyMap*>(type->tp_alloc(type, 0));
    if (self == nullptr) return nullptr;
    self->parts = new (std::nothrow) Part[kParts];
    if (self->parts == nullptr) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    Py_INCREF(slots);
    self->slots = slots;
    std::random_device rd;
    self->seed = uint64_t(rd()) << 32 | rd();
    return reinterpret_cast<PyObject*>(self);
}

void keymap_dealloc(PyObject* obj) {
    auto* self = reinterpret_cast<KeyMap*>(obj);
    PyTypeObject* type = Py_TYPE(obj);
    Py_CLEAR(self->slots);
    delete[] self->parts;
    type->tp_free(obj);
    Py_DECREF(type);
}

Py_ssize_t keymap_len(PyObject* obj) { return reinterpret_cast<KeyMap*>(obj)->len; }

PyObject* keymap_lookup(PyObject* obj, PyObject* key, PyObject* dflt) {
    auto* self = reinterpret_cast<KeyMap*>(obj);
    KeyRef k;
    Part* part;
    uint32_t tag;
    size_t cell;
    if (!locate(self, key, &k, &part, &tag, &cell)) return nullptr;
    PyObject* r = cell == kNone ? dflt : record_at(self, (part->cells[cell] >> 32) - 1);
    if (r == nullptr) {
        PyErr_SetObject(PyExc_KeyError, key);
        return nullptr;
    }
    Py_INCREF(r);
    return r;
}

PyObject* keymap_subscript(PyObject* obj, PyObject* key) {
    return keymap_lookup(obj, key, nullptr);
}

PyObject* keymap_get(PyObject* obj, PyObject* const* args, Py_ssize_t n) {
    if (n < 1 || n > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return nullptr;
    }
    return keymap_lookup(obj, args[0], n == 2 ? args[1] : Py_None);
}

int keymap_contains(PyObject* obj, PyObject* key) {
    auto* self = reinterpret_cast<KeyMap*>(obj);
    KeyRef k;
    Part* part;
    uint32_t tag;
    size_t cell;
    if (!PyUnicode_Check(key)) return 0;
    if (!locate(self, key, &k, &part, &tag, &cell)) return -1;
    return cell != kNone;
}

int keymap_assign(PyObject* obj, PyObject* key, PyObject* value) {
    auto* self = reinterpret_cast<KeyMap*>(obj);
    KeyRef k;
    Part* part;
    uint32_t tag;
    size_t cell;
    if (!locate(self, key, &k, &part, &tag, &cell)) return -1;
    if (value == nullptr) {                       // del map[key]
        if (cell == kNone) {
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        erase(*part, cell);
        --self->len;
        return 0;
    }
    KeyRef rk;
    const int slot = record_slot(value);
    if (!record_key(value, &rk) || !key_equal(rk, k) || slot < 0 ||
        record_at(self, uint64_t(slot)) != value) {
        PyErr_SetString(PyExc_ValueError,
                        "a KeyMap holds a record under its own key at its own slot "
                        "(slots[record.slot] is record)");
        return -1;
    }
    const uint64_t c = (uint64_t(slot) + 1) << 32 | tag;
    if (cell != kNone) {
        part->cells[cell] = c;
        return 0;
    }
    try {
        if ((part->live + 1) * 4 > part->cells.size() * 3) grow(*part);
    } catch (const std::bad_alloc&) {
        PyErr_NoMemory();
        return -1;
    }
    place(*part, c);
    ++part->live;
    ++self->len;
    return 0;
}

// The records (kind 0), keys (1) or (key, record) pairs (2), as a new list.
PyObject* keymap_list(KeyMap* self, int kind) {
    PyObject* out = PyList_New(0);
    if (out == nullptr) return nullptr;
    for (size_t p = 0; p < kParts; ++p) {
        for (uint64_t c : self->parts[p].cells) {
            PyObject* rec = c ? record_at(self, (c >> 32) - 1) : nullptr;
            if (rec == nullptr) continue;
            PyObject* item = nullptr;
            if (kind == 0) {
                Py_INCREF(rec);
                item = rec;
            } else {
                PyObject* key = PyObject_GetAttrString(rec, "key");
                item = kind == 1 || key == nullptr ? key : PyTuple_Pack(2, key, rec);
                if (kind == 2) Py_XDECREF(key);
            }
            if (item == nullptr || PyList_Append(out, item) < 0) {
                Py_XDECREF(item);
                Py_DECREF(out);
                return nullptr;
            }
            Py_DECREF(item);
        }
    }
    return out;
}

PyObject* keymap_values(PyObject* obj, PyObject*) {
    return keymap_list(reinterpret_cast<KeyMap*>(obj), 0);
}
PyObject* keymap_keys(PyObject* obj, PyObject*) {
    return keymap_list(reinterpret_cast<KeyMap*>(obj), 1);
}
PyObject* keymap_items(PyObject* obj, PyObject*) {
    return keymap_list(reinterpret_cast<KeyMap*>(obj), 2);
}

PyObject* keymap_iter(PyObject* obj) {
    PyObject* keys = keymap_list(reinterpret_cast<KeyMap*>(obj), 1);
    if (keys == nullptr) return nullptr;
    PyObject* it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

PyObject* keymap_nbytes(PyObject* obj, PyObject*) {
    auto* self = reinterpret_cast<KeyMap*>(obj);
    size_t n = sizeof(Part) * kParts;
    for (size_t p = 0; p < kParts; ++p) n += self->parts[p].cells.capacity() * sizeof(uint64_t);
    return PyLong_FromSize_t(n);
}

PyMethodDef keymap_methods[] = {
    {"get", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(keymap_get)), METH_FASTCALL,
     "get(key, default=None): the record in service under key, or default."},
    {"values", keymap_values, METH_NOARGS, "A list of the records."},
    {"keys", keymap_keys, METH_NOARGS, "A list of the keys."},
    {"items", keymap_items, METH_NOARGS, "A list of (key, record) pairs."},
    {"nbytes", keymap_nbytes, METH_NOARGS, "Bytes of the map's own arrays."},
    {nullptr, nullptr, 0, nullptr},
};

PyType_Slot keymap_type_slots[] = {
    {Py_tp_new, reinterpret_cast<void*>(keymap_new)},
    {Py_tp_dealloc, reinterpret_cast<void*>(keymap_dealloc)},
    {Py_tp_methods, keymap_methods},
    {Py_tp_iter, reinterpret_cast<void*>(keymap_iter)},
    {Py_mp_length, reinterpret_cast<void*>(keymap_len)},
    {Py_mp_subscript, reinterpret_cast<void*>(keymap_subscript)},
    {Py_mp_ass_subscript, reinterpret_cast<void*>(keymap_assign)},
    {Py_sq_contains, reinterpret_cast<void*>(keymap_contains)},
    {Py_tp_doc, const_cast<char*>(
        "KeyMap(slots): key -> the record in service at its slot of ``slots`` (a list the\n"
        "owner keeps in step); a mapping of 8 bytes an entry (kvstore/native/key_map.cpp).")},
    {0, nullptr},
};

PyType_Spec keymap_spec = {
    "kvstore._native.KeyMap", sizeof(KeyMap), 0, Py_TPFLAGS_DEFAULT, keymap_type_slots,
};

void register_key_map(pybind11::module_& m) {
    PyObject* type = PyType_FromSpec(&keymap_spec);
    if (type == nullptr) throw pybind11::error_already_set();
    m.add_object("KeyMap", pybind11::reinterpret_steal<pybind11::object>(type));
}

Registered reg(&register_key_map);

}  // namespace
}  // namespace kvstore_native
