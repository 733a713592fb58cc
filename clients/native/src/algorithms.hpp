// Client halves (edge/algorithms/*.py) on the native trainer: FedAvg, FedProx, FedSparse.
#pragma once

#include <string>

#include "messages.hpp"
#include "trainer.hpp"

namespace fedge {

// A device's local data: x [n, features] float32, y [n] int64 (an .npz with `x` and `y`, as the Python
// device reads it).
struct Dataset {
  int64_t n = 0, features = 0;
  std::vector<float> x;
  std::vector<int64_t> y;
};
Dataset load_npz(const std::string& path);  // std::runtime_error with a readable message

// What training one plan gives: the trained weights (plan order, without FedSparse's `.v`), row masks for
// the tensors that send only some rows, and the metrics (train_loss, steps, and the algorithm's own).
struct TrainResult {
  Tensors weights;
  Ordered<std::vector<int64_t>> masks;  // tensor name -> active rows
  Scalars metrics;
};

// Runs `strategy` with `hparams` (checked strictly: unknown key, wrong type or out of range -> PlanError)
// from `weights` on the data, seed for every random draw.
TrainResult train_plan(const std::string& strategy, const Scalars& hparams, const Tensors& weights,
                       uint64_t seed, Trainer& trainer, const Dataset& data);

// What one run drew, for tests (the native PRNG is not numpy's, so a reference needs the draws): the rows of
// every batch in order, per step the noise inputs fed (`u0`, `u1`, ...), and per gated layer the uniforms the
// final Bernoulli masks compared with pi (z = r < pi).
struct TrainTrace {
  std::vector<std::vector<int64_t>> batches;
  std::vector<Ordered<std::vector<float>>> noise;
  Ordered<std::vector<double>> mask_uniforms;
};

// train_plan recording its draws into `trace` (when not null).
TrainResult train_plan(const std::string& strategy, const Scalars& hparams, const Tensors& weights,
                       uint64_t seed, Trainer& trainer, const Dataset& data, TrainTrace* trace);

// The strategies train_plan runs.
const std::vector<std::string>& known_strategies();

}  // namespace fedge
