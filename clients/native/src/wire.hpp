// msgpack encoding and strict decoding of every message kind (docs/protocol.md sections 3 to 8).
#pragma once

#include <cstddef>
#include <string>

#include "messages.hpp"

namespace fedge {

constexpr size_t kDefaultMaxMessageBytes = 64u << 20;

// Strictly decodes one payload (section 3): not msgpack, not a map, trailing bytes, v != 1, unknown kind or
// field, missing field, wrong type (a bool is never a number, a float never an int), bad id, string too
// long, non-finite float, an array or update record that breaks sections 4 to 6 -> WireError.
Message decode(const uint8_t* data, size_t size, size_t max_bytes = kDefaultMaxMessageBytes);
inline Message decode(const Bytes& b, size_t max_bytes = kDefaultMaxMessageBytes) {
  return decode(b.data(), b.size(), max_bytes);
}

// Encodes a message as the Python encoder does: v, k, then the fields in section 7's order.
Bytes encode(const Message& m);

// Whether s matches ^[A-Za-z0-9_.:\-]{1,128}$.
bool valid_id(const std::string& s);

}  // namespace fedge
