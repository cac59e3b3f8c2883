// The data protocol's headers (see frames.hpp). Pure C++: codec_bind.cpp binds it.
#include "frames.hpp"

#include <cstring>

namespace kvstore_native::frames {
namespace {

// Little-endian loads and stores, byte by byte: no alignment, any host.
template <typename T>
T load(const uint8_t* p) noexcept {
    T v = 0;
    for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(static_cast<T>(p[i]) << (8 * i));
    return v;
}

template <typename T>
void store(uint8_t* p, T v) noexcept {
    for (size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

}  // namespace

const char* error_name(FrameError e) noexcept {
    switch (e) {
        case FrameError::kOk: return "ok";
        case FrameError::kShort: return "short";
        case FrameError::kUnknownOp: return "unknown_op";
        case FrameError::kKeyTooLong: return "key_too_long";
        case FrameError::kParentTooLong: return "parent_too_long";
        case FrameError::kValueTooLarge: return "value_too_large";
        case FrameError::kMessageTooLong: return "message_too_long";
        case FrameError::kBadFlags: return "bad_flags";
    }
    return "unknown";
}

bool known_op(uint8_t op) noexcept {
    return (op >= static_cast<uint8_t>(Op::kPut) && op <= static_cast<uint8_t>(Op::kShmTouch))
        || op == static_cast<uint8_t>(Op::kRdmaConnect);
}

bool op_carries_value(uint8_t op) noexcept {
    switch (static_cast<Op>(op)) {
        case Op::kPut: case Op::kShmAlloc: case Op::kAuthProve: case Op::kRdmaConnect:
            return true;
        default:
            return false;
    }
}

FrameError decode_request(const uint8_t* in, size_t len, const Limits& limits,
                          Request* out) noexcept {
    std::memset(out, 0, sizeof *out);
    if (in == nullptr || len < kRequestBytes) return FrameError::kShort;
    out->op = in[0];
    out->flags = in[1];
    out->key_len = load<uint16_t>(in + 2);
    out->parent_len = load<uint32_t>(in + 4);
    out->object_id = load<uint64_t>(in + 8);
    out->size = load<uint64_t>(in + 16);
    out->checksum = load<uint64_t>(in + 24);
    if (!known_op(out->op)) return FrameError::kUnknownOp;
    // flags is the replica count of a put (protocol.py); every other op sends 0.
    bool put = out->op == static_cast<uint8_t>(Op::kPut)
            || out->op == static_cast<uint8_t>(Op::kShmAlloc);
    if (out->flags != 0 && !put) return FrameError::kBadFlags;
    if (out->key_len > limits.max_key_bytes) return FrameError::kKeyTooLong;
    if (out->parent_len > limits.max_parent_bytes) return FrameError::kParentTooLong;
    if (op_carries_value(out->op)) {
        uint64_t most = out->op == static_cast<uint8_t>(Op::kRdmaConnect)
                      ? limits.max_connect_bytes : limits.max_value_bytes;
        if (out->size > most) return FrameError::kValueTooLarge;
    }
    return FrameError::kOk;
}

FrameError decode_response(const uint8_t* in, size_t len, const Limits& limits,
                           Response* out) noexcept {
    std::memset(out, 0, sizeof *out);
    if (in == nullptr || len < kResponseBytes) return FrameError::kShort;
    out->code = in[0];
    out->flags = in[1];
    out->msg_len = load<uint16_t>(in + 2);
    out->reserved = load<uint32_t>(in + 4);
    out->object_id = load<uint64_t>(in + 8);
    out->size = load<uint64_t>(in + 16);
    out->checksum = load<uint64_t>(in + 24);
    out->offset = load<uint64_t>(in + 32);
    out->serial = load<uint64_t>(in + 40);
    if (out->msg_len > limits.max_message_bytes) return FrameError::kMessageTooLong;
    // Only an OK answer carries a value (of ``size`` bytes, for GET, STATS and
    // AUTH_HELLO); the caller knows the op and bounds it against its buffer.
    return FrameError::kOk;
}

void encode_request(const Request& r, uint8_t* out) noexcept {
    out[0] = r.op;
    out[1] = r.flags;
    store<uint16_t>(out + 2, r.key_len);
    store<uint32_t>(out + 4, r.parent_len);
    store<uint64_t>(out + 8, r.object_id);
    store<uint64_t>(out + 16, r.size);
    store<uint64_t>(out + 24, r.checksum);
}

void encode_response(const Response& r, uint8_t* out) noexcept {
    out[0] = r.code;
    out[1] = r.flags;
    store<uint16_t>(out + 2, r.msg_len);
    store<uint32_t>(out + 4, r.reserved);
    store<uint64_t>(out + 8, r.object_id);
    store<uint64_t>(out + 16, r.size);
    store<uint64_t>(out + 24, r.checksum);
    store<uint64_t>(out + 32, r.offset);
    store<uint64_t>(out + 40, r.serial);
}

}  // namespace kvstore_native::frames
