// et-smoke FILE.pte: loads a program with the ExecuTorch runtime and prints its methods, each with its
// number of inputs and outputs. Exit 0 when it has at least one method.
#include <cstdio>

#include <executorch/extension/module/module.h>

using executorch::extension::Module;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: et-smoke FILE.pte\n");
    return 2;
  }
  Module module(argv[1]);
  auto names = module.method_names();
  if (!names.ok()) {
    std::fprintf(stderr, "et-smoke: cannot load %s (error 0x%x)\n", argv[1], static_cast<unsigned>(names.error()));
    return 1;
  }
  for (const auto& name : *names) {
    auto meta = module.method_meta(name);
    if (meta.ok())
      std::printf("%s: %zu inputs, %zu outputs\n", name.c_str(), meta->num_inputs(), meta->num_outputs());
    else
      std::printf("%s\n", name.c_str());
  }
  std::printf("%zu methods\n", names->size());
  return names->empty() ? 1 : 0;
}
