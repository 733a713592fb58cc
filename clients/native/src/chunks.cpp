// Chunking and reassembly (docs/protocol.md section 8; edge/protocol/wire.py split and Reassembler).
#include "chunks.hpp"

#include <stdexcept>

#include "wire.hpp"

namespace fedge {

namespace {
constexpr int64_t kMinChunkBytes = 256;  // a chunk other than the last shorter than this is refused
constexpr size_t kMaxDone = 4096;        // completed ids remembered (the oldest forgotten first)
}  // namespace

std::vector<Bytes> split(const Bytes& payload, const std::string& transfer_id, size_t chunk_bytes) {
  if (payload.size() <= chunk_bytes) return {payload};
  if (chunk_bytes == 0) throw std::invalid_argument("chunk_bytes must be positive");
  const size_t n = (payload.size() + chunk_bytes - 1) / chunk_bytes;
  std::vector<Bytes> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    Chunk c;
    c.id = transfer_id;
    c.i = int64_t(i);
    c.n = int64_t(n);
    c.t = int64_t(payload.size());
    const size_t end = std::min(payload.size(), (i + 1) * chunk_bytes);
    c.b.assign(payload.begin() + long(i * chunk_bytes), payload.begin() + long(end));
    out.push_back(encode(c));
  }
  return out;
}

Reassembler::Reassembler(size_t max_bytes, double forget_s, size_t max_open)
    : max_bytes_(max_bytes), forget_s_(forget_s), max_open_(max_open) {}

std::optional<Bytes> Reassembler::add(const Chunk& c, double now) {
  if (!(0 <= c.i && c.i < c.n)) throw WireError("chunk " + std::to_string(c.i) + " of " + std::to_string(c.n) + " is out of range");
  auto done = done_.find(c.id);
  if (done != done_.end()) {
    if (now - done->second <= forget_s_) return std::nullopt;  // the tail of a resend of a transfer already whole
    done_.erase(done);
  }
  auto it = open_.find(c.id);
  if (it == open_.end()) {
    if (c.t > 0 && uint64_t(c.t) > max_bytes_)
      throw WireError("chunked message of " + std::to_string(c.t) + " bytes exceeds the limit of " + std::to_string(max_bytes_));
    if (c.t <= 0 || c.n > std::max<int64_t>(1, (c.t + kMinChunkBytes - 1) / kMinChunkBytes))
      throw WireError("chunked message of " + std::to_string(c.t) + " bytes in " + std::to_string(c.n) + " chunks");
    if (open_.size() >= max_open_) throw WireError("busy: too many incomplete chunked transfers");
    Transfer tr;
    tr.n = c.n;
    tr.t = c.t;
    it = open_.emplace(c.id, std::move(tr)).first;
  }
  Transfer& tr = it->second;
  if (c.n != tr.n || c.t != tr.t) {
    open_.erase(it);
    throw WireError("chunk " + std::to_string(c.i) + " of " + c.id + " disagrees with earlier chunks");
  }
  if (!tr.parts.count(c.i)) {
    if (c.b.empty() || (int64_t(c.b.size()) < kMinChunkBytes && c.i != c.n - 1)) {
      open_.erase(it);
      throw WireError("chunk " + std::to_string(c.i) + " of " + c.id + " is too small");
    }
    tr.have_bytes += int64_t(c.b.size());
    if (tr.have_bytes > tr.t) {
      open_.erase(it);
      throw WireError("chunks of " + c.id + " exceed the announced size");
    }
    tr.parts.emplace(c.i, c.b);
  }
  tr.last = now;
  if (int64_t(tr.parts.size()) < tr.n) return std::nullopt;
  Bytes payload;
  payload.reserve(size_t(tr.t));
  for (auto& kv : tr.parts) payload.insert(payload.end(), kv.second.begin(), kv.second.end());
  const int64_t t = tr.t;
  open_.erase(it);
  done_[c.id] = now;
  while (done_.size() > kMaxDone) {  // bounded: the oldest completion goes first
    auto oldest = done_.begin();
    for (auto d = done_.begin(); d != done_.end(); ++d)
      if (d->second < oldest->second) oldest = d;
    done_.erase(oldest);
  }
  if (int64_t(payload.size()) != t)
    throw WireError("reassembled " + std::to_string(payload.size()) + " bytes, announced " + std::to_string(t));
  return payload;
}

void Reassembler::expire(double now) {
  for (auto it = open_.begin(); it != open_.end();)
    it = now - it->second.last > forget_s_ ? open_.erase(it) : std::next(it);
  for (auto it = done_.begin(); it != done_.end();)
    it = now - it->second > forget_s_ ? done_.erase(it) : std::next(it);
}

Message decode_reassembled(const Bytes& payload, size_t max_bytes) {
  Message m = decode(payload, max_bytes);
  if (std::holds_alternative<Chunk>(m)) throw WireError("a reassembled payload is itself a chunk");
  return m;
}

}  // namespace fedge
