// Chunking and reassembly (docs/protocol.md section 8).
#pragma once

#include <map>
#include <optional>
#include <string>

#include "messages.hpp"

namespace fedge {

// The payload as is when it fits in chunk_bytes, else ceil(len / chunk_bytes) encoded `chunk` messages.
std::vector<Bytes> split(const Bytes& payload, const std::string& transfer_id, size_t chunk_bytes);

// Per-sender reassembly of chunked transfers, with every refusal rule of section 8: chunks that disagree on n or t,
// data over t, an empty chunk, a chunk other than the last shorter than 256 bytes, n > max(1, ceil(t / 256)), t <= 0
// or over max_bytes (the transfer is dropped whole, WireError); a chunk whose index is held is ignored; transfers
// with no new chunk for forget_s are forgotten (expire); chunks of a transfer completed in the last forget_s are
// ignored (the tail of a resend). The payload add returns is decoded by the caller, who MUST refuse a payload that
// is itself a chunk: decode_reassembled does both. One Reassembler per sender (a device: one, for its plan topic).
class Reassembler {
 public:
  // max_open: incomplete transfers held at once; a chunk that would start another is refused (WireError, "busy"),
  // as the Python device's Reassembler does (max_open_per_sender = 2).
  explicit Reassembler(size_t max_bytes = 64u << 20, double forget_s = 60.0, size_t max_open = 2);
  // A decoded chunk received at time `now`: the whole payload once the last chunk is in, else nullopt.
  // A transfer that breaks a rule is dropped whole (WireError says why).
  std::optional<Bytes> add(const Chunk& c, double now);
  // Forgets transfers with no new chunk for forget_s, and completed ids older than forget_s.
  void expire(double now);
  size_t open() const { return open_.size(); }

 private:
  struct Transfer {
    int64_t n = 0, t = 0, have_bytes = 0;
    std::map<int64_t, Bytes> parts;
    double last = 0.0;
  };
  size_t max_bytes_;
  double forget_s_;
  size_t max_open_ = 2;
  std::map<std::string, Transfer> open_;
  std::map<std::string, double> done_;
};

// Decodes a reassembled payload (wire.hpp decode) and refuses a chunk inside a chunked transfer (section 8).
Message decode_reassembled(const Bytes& payload, size_t max_bytes = 64u << 20);

}  // namespace fedge
