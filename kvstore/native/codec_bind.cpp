// Python bindings of the per-byte codec: xxh3 (hash, Hasher), io (copy_hashed,
// recv_into_hashed) and frames (decode/encode of the data protocol's headers).
//
// A thin layer: buffers are taken through the buffer protocol (bytes,
// bytearray, memoryview, mmap, numpy arrays, torch CPU tensors through a
// memoryview), C-contiguous, checked for writability and size, and held (the
// export pins them: a bytearray cannot be resized, an mmap not closed) while
// the GIL is released around every pass over bytes and every system call.
// Python code reaches these through kvstore/transfer/codec.py only.
#include <Python.h>

#include <cerrno>
#include <cmath>
#include <climits>
#include <cstring>
#include <string>

#include "frames.hpp"
#include "io.hpp"
#include "module.hpp"
#include "pybuffer.hpp"
#include "xxh3.hpp"

namespace py = pybind11;

namespace kvstore_native {
namespace {

// Below this many bytes the GIL is kept: releasing and taking it back costs
// more than the work (and wakes another thread for nothing).
constexpr size_t kReleaseGilBytes = 16 * 1024;

uint64_t hash(py::handle data, uint64_t seed) {
    Buffer b(data, false);
    if (b.size() < kReleaseGilBytes) return xxh3::hash64(b.data(), b.size(), seed);
    py::gil_scoped_release nogil;
    return xxh3::hash64(b.data(), b.size(), seed);
}

uint64_t copy_hashed(py::handle dst, py::handle src, uint64_t seed) {
    Buffer d(dst, true);
    Buffer s(src, false);
    if (d.size() != s.size())
        throw py::value_error("copy_hashed: dst holds " + std::to_string(d.size()) +
                              " B, src " + std::to_string(s.size()) + " B (they must be equal)");
    const uint8_t *dp = d.data(), *sp = s.data();
    size_t n = s.size();
    if (n > 0 && dp < sp + n && sp < dp + n)
        throw py::value_error("copy_hashed: dst and src overlap");
    if (n < kReleaseGilBytes) return io::copy_hashed(d.data(), s.data(), n, seed);
    py::gil_scoped_release nogil;
    return io::copy_hashed(d.data(), s.data(), n, seed);
}

// EINTR while the GIL is released: run the signal handlers as CPython's own
// recv does (PEP 475); a handler that raised stops the receive.
bool run_signal_handlers(void*) {
    py::gil_scoped_acquire gil;
    return PyErr_CheckSignals() == 0;
}

int timeout_ms_of(py::object timeout_s) {
    if (timeout_s.is_none()) return -1;
    double t = timeout_s.cast<double>();
    if (std::isnan(t) || t < 0) throw py::value_error("timeout_s must be None or >= 0");
    if (t == 0) return 0;
    double ms = std::ceil(t * 1000.0);
    return ms >= INT_MAX ? INT_MAX : (ms < 1 ? 1 : static_cast<int>(ms));
}

uint64_t recv_into_hashed(int fd, py::handle buffer, size_t nbytes, size_t have,
                          py::object timeout_s, uint64_t seed) {
    Buffer b(buffer, true);
    if (nbytes > b.size())
        throw py::value_error("recv_into_hashed: nbytes " + std::to_string(nbytes) +
                              " > buffer of " + std::to_string(b.size()) + " B");
    if (have > nbytes)
        throw py::value_error("recv_into_hashed: have " + std::to_string(have) + " > nbytes " +
                              std::to_string(nbytes));
    if (fd < 0) throw py::value_error("recv_into_hashed: fd " + std::to_string(fd) + " is closed");
    int timeout_ms = timeout_ms_of(timeout_s);
    xxh3::State state(seed);
    io::RecvResult r{io::RecvStatus::kOk, 0, 0};
    {
        py::gil_scoped_release nogil;
        state.update(b.data(), have);
        r = io::recv_hashed(fd, b.data() + have, nbytes - have, state, timeout_ms,
                            &run_signal_handlers, nullptr);
    }
    switch (r.status) {
        case io::RecvStatus::kOk:
            return state.digest();
        case io::RecvStatus::kClosed:
            PyErr_SetString(PyExc_EOFError, "connection closed by peer");
            throw py::error_already_set();
        case io::RecvStatus::kTimedOut:
            PyErr_SetString(PyExc_TimeoutError, "timed out");
            throw py::error_already_set();
        case io::RecvStatus::kWouldBlock:
            errno = EAGAIN;
            PyErr_SetFromErrno(PyExc_OSError);    // BlockingIOError, as socket.recv_into
            throw py::error_already_set();
        case io::RecvStatus::kError:
            errno = r.error;
            PyErr_SetFromErrno(PyExc_OSError);    // the errno's subclass (ConnectionResetError...)
            throw py::error_already_set();
        case io::RecvStatus::kInterrupted:
            throw py::error_already_set();        // what the signal handler raised
    }
    throw std::logic_error("recv_into_hashed: unknown status");
}

// Streaming XXH3-64 for Python (python-xxhash's xxh3_64 interface, the part we use).
class Hasher {
public:
    explicit Hasher(uint64_t seed) : state_(seed), seed_(seed) {}
    void update(py::handle data) {
        Buffer b(data, false);
        if (b.size() < kReleaseGilBytes) {
            state_.update(b.data(), b.size());
            return;
        }
        py::gil_scoped_release nogil;
        state_.update(b.data(), b.size());
    }
    uint64_t intdigest() const { return state_.digest(); }
    void reset() { state_.reset(seed_); }
    uint64_t total_bytes() const { return state_.total_bytes(); }

private:
    xxh3::State state_;
    uint64_t seed_;
};

frames::Limits limits_of(uint32_t max_key_bytes, uint32_t max_parent_bytes,
                         uint64_t max_value_bytes, uint64_t max_connect_bytes,
                         uint32_t max_message_bytes) {
    return frames::Limits{max_key_bytes, max_parent_bytes, max_value_bytes, max_connect_bytes,
                          max_message_bytes};
}

void register_codec(py::module_& m) {
    m.def("xxh3_64", &hash, py::arg("data"), py::arg("seed") = 0,
          "XXH3-64 of a buffer (any C-contiguous buffer; bytes as laid out in memory).\n\n"
          "Bit-identical to python-xxhash's xxh3_64_intdigest; written from the xxHash\n"
          "specification (doc/xxhash_spec.md). The GIL is released from 16 KiB on.\n\n"
          "Raises:\n    TypeError / BufferError: not a C-contiguous buffer.");
    m.def("copy_hashed", &copy_hashed, py::arg("dst"), py::arg("src"), py::arg("seed") = 0,
          "Copy src into dst (equal lengths, no overlap) and return the XXH3-64 of the\n"
          "bytes, in one pass (each 64-byte stripe is loaded once, stored and hashed).\n\n"
          "Raises:\n    ValueError: lengths differ, or the buffers overlap.\n"
          "    TypeError / BufferError: dst not writable, or not C-contiguous.");
    m.def("recv_into_hashed", &recv_into_hashed, py::arg("fd"), py::arg("buffer"),
          py::arg("nbytes"), py::arg("have") = 0, py::arg("timeout_s") = py::none(),
          py::arg("seed") = 0,
          "Receive buffer[have:nbytes] from the stream socket fd and return the XXH3-64\n"
          "of buffer[:nbytes] (the first ``have`` bytes are already there), hashing each\n"
          "piece as it arrives. GIL released; EINTR runs the signal handlers and retries.\n\n"
          "Args:\n    timeout_s: the socket's timeout (sock.gettimeout()): None waits as the\n"
          "        fd does; > 0 waits that long for each piece (a non-blocking fd).\n\n"
          "Raises:\n    EOFError: the peer closed the stream first.\n"
          "    TimeoutError: no byte came within timeout_s.\n"
          "    BlockingIOError: EAGAIN with no timeout (SO_RCVTIMEO ran out).\n"
          "    OSError: recv failed (its errno).\n"
          "    ValueError: nbytes > len(buffer), have > nbytes, or fd < 0.");
    py::class_<Hasher>(m, "Hasher",
                       "Streaming XXH3-64: update() with pieces of any sizes; intdigest()\n"
                       "equals xxh3_64 of their concatenation (python-xxhash's xxh3_64 API).")
        .def(py::init<uint64_t>(), py::arg("seed") = 0)
        .def("update", &Hasher::update, py::arg("data"))
        .def("intdigest", &Hasher::intdigest)
        .def("reset", &Hasher::reset)
        .def_property_readonly("total_bytes", &Hasher::total_bytes);

    py::class_<frames::Limits>(m, "FrameLimits",
                               "Bounds a decoder applies to a header's lengths (inclusive).")
        .def(py::init(&limits_of), py::arg("max_key_bytes"), py::arg("max_parent_bytes"),
             py::arg("max_value_bytes"), py::arg("max_connect_bytes") = 4096,
             py::arg("max_message_bytes") = 4096)
        .def_readonly("max_key_bytes", &frames::Limits::max_key_bytes)
        .def_readonly("max_parent_bytes", &frames::Limits::max_parent_bytes)
        .def_readonly("max_value_bytes", &frames::Limits::max_value_bytes)
        .def_readonly("max_connect_bytes", &frames::Limits::max_connect_bytes)
        .def_readonly("max_message_bytes", &frames::Limits::max_message_bytes);
    m.attr("REQUEST_BYTES") = frames::kRequestBytes;
    m.attr("RESPONSE_BYTES") = frames::kResponseBytes;
    m.def("decode_request",
          [](py::handle data, const frames::Limits& limits) {
              Buffer b(data, false);
              frames::Request r;
              frames::FrameError e = frames::decode_request(b.data(), b.size(), limits, &r);
              return py::make_tuple(frames::error_name(e), r.op, r.flags, r.key_len,
                                    r.parent_len, r.object_id, r.size, r.checksum);
          },
          py::arg("data"), py::arg("limits"),
          "Decode a 32-byte request header and bound its lengths.\n\n"
          "Returns:\n    (error, op, flags, key_len, parent_len, object_id, size, checksum);\n"
          "    error is 'ok' or the violation ('short', 'unknown_op', 'key_too_long',\n"
          "    'parent_too_long', 'value_too_large', 'bad_flags'); fields decoded so far.");
    m.def("decode_response",
          [](py::handle data, const frames::Limits& limits) {
              Buffer b(data, false);
              frames::Response r;
              frames::FrameError e = frames::decode_response(b.data(), b.size(), limits, &r);
              return py::make_tuple(frames::error_name(e), r.code, r.flags, r.msg_len,
                                    r.reserved, r.object_id, r.size, r.checksum, r.offset,
                                    r.serial);
          },
          py::arg("data"), py::arg("limits"),
          "Decode a 48-byte response header and bound its message length.\n\n"
          "Returns:\n    (error, code, flags, msg_len, reserved, object_id, size, checksum,\n"
          "    offset, serial); error is 'ok', 'short' or 'message_too_long'.");
    m.def("encode_request",
          [](uint8_t op, uint8_t flags, uint16_t key_len, uint32_t parent_len, uint64_t object_id,
             uint64_t size, uint64_t checksum) {
              frames::Request r{op, flags, key_len, parent_len, object_id, size, checksum};
              char out[frames::kRequestBytes];
              frames::encode_request(r, reinterpret_cast<uint8_t*>(out));
              return py::bytes(out, sizeof out);
          },
          py::arg("op"), py::arg("flags"), py::arg("key_len"), py::arg("parent_len"),
          py::arg("object_id"), py::arg("size"), py::arg("checksum"),
          "The 32-byte request header (protocol.REQUEST's layout).");
    m.def("encode_response",
          [](uint8_t code, uint8_t flags, uint16_t msg_len, uint32_t reserved, uint64_t object_id,
             uint64_t size, uint64_t checksum, uint64_t offset, uint64_t serial) {
              frames::Response r{code, flags, msg_len, reserved, object_id, size, checksum,
                                 offset, serial};
              char out[frames::kResponseBytes];
              frames::encode_response(r, reinterpret_cast<uint8_t*>(out));
              return py::bytes(out, sizeof out);
          },
          py::arg("code"), py::arg("flags"), py::arg("msg_len"), py::arg("reserved"),
          py::arg("object_id"), py::arg("size"), py::arg("checksum"), py::arg("offset"),
          py::arg("serial"),
          "The 48-byte response header (protocol.RESPONSE's layout).");
}

Registered reg_codec(&register_codec);

}  // namespace
}  // namespace kvstore_native
