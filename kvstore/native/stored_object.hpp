// A node's object record's key (stored_object.cpp) as other native parts read it:
// the key map (key_map.cpp) finds records by key without a string per record.
//
// A key is compared in one of two forms: 32 lowercase hex characters (every key
// kvstore.keys makes) as their 16 bytes, any other str as itself. A key has one
// form only, so two keys are equal exactly when their forms and contents are.
#pragma once
#include <Python.h>

#include <cstddef>

namespace kvstore_native {

constexpr size_t kKeyBytes = 16;

struct KeyRef {
    bool bytes = false;               // bin holds the key; else str does
    unsigned char bin[kKeyBytes] = {};
    PyObject* str = nullptr;          // borrowed
};

// Whether ``str`` (a str) is 32 lowercase hex characters; if so, their bytes in ``out``.
bool key_bytes(PyObject* str, unsigned char out[kKeyBytes]) noexcept;
// The 32 lowercase hex characters of ``bin`` (a new str; null with an error set).
PyObject* key_text(const unsigned char bin[kKeyBytes]);
// ``key`` in its compared form; false (no error set) when it is not a str.
bool key_ref(PyObject* key, KeyRef* out) noexcept;
// A record's key in its compared form; false (no error set): not a record, or no key.
bool record_key(PyObject* record, KeyRef* out) noexcept;
// Whether two keys are equal (a str compare cannot fail: both are str).
bool key_equal(const KeyRef& a, const KeyRef& b) noexcept;
// The slot field of a record (-1 when not a record).
int record_slot(PyObject* record) noexcept;

}  // namespace kvstore_native
