// Registration of the native parts into one extension module (module.cpp).
#pragma once
#include <pybind11/pybind11.h>
#include <vector>

namespace kvstore_native {

using Register = void (*)(pybind11::module_&);

// Every part's register function, in the order its file lists it (module.cpp calls them).
inline std::vector<Register>& registrations() {
    static std::vector<Register> all;
    return all;
}

// A part adds itself with `static Registered reg(&register_part);` in its .cpp.
struct Registered {
    explicit Registered(Register fn) { registrations().push_back(fn); }
};

}  // namespace kvstore_native
