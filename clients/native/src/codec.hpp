// Masks and value formats (docs/protocol.md sections 5 and 6; byte layouts in edge/protocol/codec.py's
// docstring), and the update a device sends (the driver's encode_update, edge/algorithms/driver.py).
#pragma once

#include <cstdint>
#include <random>
#include <string>

#include "messages.hpp"

namespace fedge {

// ---- values
// Decodes a floating array (f4 f2 f8 bf16 q8 q8r) to float32; WireError on a wrong length, a non-finite
// value or scale, a negative scale or int8 -128. f2 decodes to its binary16 value, widened.
Tensor decode_values(const WireArray& a);
// Encodes float64 values of `shape` in `code` (f4 f2 bf16 q8 q8r). q8 and q8r round stochastically with `rng`
// (codec.py, "Stochastic rounding"); f4, f2 and bf16 round to nearest even, as the Python device does (its driver
// passes no rounding, and codec.py's default for bf16 is nearest); f2 saturates at +-65504. Non-finite values
// (or beyond float32 for f4 and bf16), and an unknown code, are a PlanError: a device never sends them.
WireArray encode_values(const std::vector<double>& values, const std::vector<int64_t>& shape,
                        const std::string& code, std::mt19937_64& rng);
// Bytes the value format takes for `shape`.
int64_t value_nbytes(const std::string& code, const std::vector<int64_t>& shape);

// How encode_values rounds bf16 (q8 and q8r always round stochastically, f4 and f2 to nearest even).
// Default is the driver's choice: bf16 to nearest even (codec.py's default; the driver passes no rounding).
// Nearest: bf16, q8 and q8r all to nearest even (the coordinator's coded downlink); Stochastic: bf16, q8 and q8r
// stochastically from rng.
enum class Rounding { Default, Nearest, Stochastic };
WireArray encode_values(const std::vector<double>& values, const std::vector<int64_t>& shape,
                        const std::string& code, std::mt19937_64& rng, Rounding bf16_rounding);

// ---- masks
// A k-of-n support by its minority (codec.py's Support): `rows` are the active rows, or the inactive ones when
// `inactive`. Decoding one costs O(len(bytes) + K), whatever n says (a hostile n of 2^31 allocates nothing).
struct Support {
  int64_t n = 0;
  std::vector<int64_t> rows;  // strictly increasing
  bool inactive = false;
  int64_t k() const { return inactive ? n - static_cast<int64_t>(rows.size()) : static_cast<int64_t>(rows.size()); }
  std::vector<int64_t> active() const;  // O(n) when inactive
};
// decode_mask without expanding the support. `bitmask_padding`: refuse nonzero padding bits of a bitmask (codec.py
// does; wire.py ignores them in a record's own "m" and checks them in a sample's).
Support decode_support(const MaskField& m, int64_t n, int64_t k, bool bitmask_padding = true);
// The mask of these active rows in one given format (Dense is not a format here); std::invalid_argument when that
// format cannot code them (index16 with n > 65536, enum with K > 64).
MaskField encode_mask_as(const std::vector<int64_t>& active, int64_t n, MaskField::Format f, int width = 0);
// encode_mask restricted to bitmask and index lists when `coded` is false (golomb and enum need rows with values).
MaskField encode_mask(const std::vector<int64_t>& active, int64_t n, bool coded);

// The active rows (strictly increasing) a mask of n rows with k active codes; WireError when it does not
// decode or disagrees with k.
std::vector<int64_t> decode_mask(const MaskField& m, int64_t n, int64_t k);
// The smallest of bitmask / index / golomb / enum for these active rows of n.
MaskField encode_mask(const std::vector<int64_t>& active, int64_t n);

// ---- the update a device sends
// Per tensor of `trained` (plan order), its record under the plan's `upload` map (section 6): value format
// (dtype, dtype_1d), differences from `plan_weights` (delta), rows of `masks` only (a tensor absent from
// masks goes dense), and, where upload.sample asks and `sampled_upload` is on, a sampled update (h) by the
// driver's rule (inclusion probabilities within keep / p_min, systematic sampling from the plan's seed).
// PlanError for an upload format it cannot produce, bad sample options (design not norm/uniform, sampling
// without delta, keep outside (0, 1] or p_min outside [0, 1]), a mask that is not strictly increasing rows, or a
// delta with no plan weight of the same name and shape. The random streams are std::mt19937_64 seeded with
// seed_seq{seed low 32 bits, seed high 32 bits, stream}: stream 100 rounds q8/q8r, stream 101 draws the sample
// (the driver's streams; not numpy's bits, which nothing checks). `masks` are active rows, strictly increasing.
Ordered<UpdateRecord> encode_update(const Tensors& trained, const Tensors& plan_weights,
                                    const Ordered<std::vector<int64_t>>& masks, const Scalars& upload,
                                    uint64_t seed);

// ---- the coded downlink (section 6.1)
// The plan's weights as float32: absolute, or `held + decoded` for every tensor the held model has under
// the same name and shape when the plan names a base. PlanError when the base is not the held tag.
Tensors plan_weights(const Plan& p, const std::string& held_tag, const Tensors& held);

}  // namespace fedge
