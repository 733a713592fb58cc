// The ExecuTorch trainer: runs a `fedge-executorch/2` program (docs/protocol.md section 14) through the
// C++ runtime of the executorch wheel. No torch, no Python.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "messages.hpp"

namespace fedge {

// One program input as its metadata names it: shape uses -1 for the batch dimension "B".
struct ProgramInput {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;  // f4 or i8
  bool batched() const;
};

// An input value: float32 or int64 data in C order.
struct Feed {
  std::vector<int64_t> shape;
  std::vector<float> f;
  std::vector<int64_t> i;
};

struct ProgramMeta {
  std::string objective, batch, weights;  // weights: external | embedded
  std::string model_json, layout_json;    // the spec and layout, as JSON text
  std::vector<std::string> params;
  Ordered<std::vector<int64_t>> shapes;
  std::vector<ProgramInput> inputs;
  std::vector<std::string> outputs;
  int64_t min_batch = 1, max_batch = 1;
};

class Trainer {
 public:
  Trainer();
  ~Trainer();
  // Threads of ExecuTorch's shared thread pool (process-wide); 1 unless set (the Python backend's default).
  static void set_threads(uint32_t n);
  // Loads a program (bytes kept alive by the trainer); std::runtime_error when it is not one it runs.
  void load(const Bytes& program);
  const ProgramMeta& meta() const;
  // Overwrites every parameter (names and shapes must match the program).
  void set_weights(const Tensors& w);
  Tensors get_weights() const;
  // The objective and every parameter's gradient (params order) at the current weights; `aux` gets the
  // auxiliary outputs (e.g. logits) for the real rows. Batches longer than max_batch are an error.
  double loss_and_grads(const Ordered<Feed>& inputs, Tensors* grads, Tensors* aux = nullptr);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fedge
