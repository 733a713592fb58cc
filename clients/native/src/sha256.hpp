// SHA-256 (FIPS 180-4): programs are stored and named by the hex digest of their bytes (section 14).
#pragma once

#include <string>

#include "messages.hpp"

namespace fedge {
std::string sha256_hex(const uint8_t* data, size_t size);
inline std::string sha256_hex(const Bytes& b) { return sha256_hex(b.data(), b.size()); }
}  // namespace fedge
