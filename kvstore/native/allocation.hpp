// kvstore._native.Allocation from other native parts (allocator_bind.cpp defines it):
// the DRAM copy a node's object record keeps inline is handed out as one.
#pragma once
#include <Python.h>

namespace kvstore_native {

// A new Allocation(offset, size_bytes, reserved_bytes, serial); null with a Python error set.
PyObject* allocation_make(unsigned long long offset, unsigned long long size,
                          unsigned long long reserved, unsigned long long serial);

// The fields of ``h`` when it is an Allocation (no error set either way).
bool allocation_fields(PyObject* h, unsigned long long* offset, unsigned long long* size,
                       unsigned long long* reserved, unsigned long long* serial);

}  // namespace kvstore_native
