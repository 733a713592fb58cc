// .npz files as np.savez writes them (a stored zip of .npy files), read and written without numpy: the
// device's local data (x, y) and the test CLI's weights and results.
#pragma once

#include <string>

#include "messages.hpp"

namespace fedge {

// One .npy array: dtype as numpy's descr ("<f4", "<f8", "<i8", "<i4", ...), C-order shape, raw bytes.
struct NpyArray {
  std::string dtype;
  std::vector<int64_t> shape;
  Bytes data;
  int64_t numel() const;
};

// Every array of an .npz (name without ".npy"), in the archive's order. Stored (uncompressed) entries,
// .npy format 1.0/2.0/3.0, little-endian, C order; std::runtime_error with a readable message otherwise.
Ordered<NpyArray> read_npz(const std::string& path);

// As float32 / int64 (converting from f4/f8, resp. i8/i4/u1...); std::runtime_error for other dtypes.
std::vector<float> npy_floats(const NpyArray& a, const std::string& what);
std::vector<int64_t> npy_ints(const NpyArray& a, const std::string& what);

NpyArray npy_of(const Tensor& t);                                         // <f4
NpyArray npy_of(const std::vector<int64_t>& shape, const std::vector<int64_t>& v);  // <i8
NpyArray npy_scalar(double v);                                            // <f8, shape ()

// Writes a stored zip (CRC-32, no compression) that np.load reads.
void write_npz(const std::string& path, const Ordered<NpyArray>& arrays);

}  // namespace fedge
