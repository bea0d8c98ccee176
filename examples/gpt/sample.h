// The sample the GPT example prints at the end of every strategy's run:
// `tokens` characters after a newline, by temperature and top-k sampling
// from a generator with a fixed seed.
//
// Contract: `forward` maps idx int64 [1, T] (T <= block size) to logits
// [1, T, vocab] and must not need other ranks, since only one rank samples.
// A sharded or pipelined strategy first gathers full weights on that rank
// (collectively, every rank taking part) and passes a local forward.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>

#include "corpus.h"

namespace gpt {

struct SampleOptions {
  std::int64_t tokens = 500;
  std::int64_t block_size = 64;
  double temperature = 0.8;
  std::int64_t top_k = 200;  // 0: all
  std::uint64_t seed = 1337;
};

inline std::string generate(const SampleOptions& o, const Corpus& corpus,
                            const std::function<at::Tensor(const at::Tensor&)>& forward, c10::Device device) {
  torch::NoGradGuard no_grad;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  const auto newline = static_cast<std::int64_t>(corpus.vocab.find('\n'));
  at::Tensor idx = at::full({1, 1}, newline, at::kLong);
  for (std::int64_t i = 0; i < o.tokens; ++i) {
    const at::Tensor context = idx.slice(1, std::max<std::int64_t>(0, idx.size(1) - o.block_size));
    at::Tensor logits = forward(context.to(device)).select(1, -1).to(at::kCPU, at::kFloat);
    logits = logits / o.temperature;
    if (o.top_k > 0 && o.top_k < logits.size(-1)) {
      const at::Tensor kth = std::get<0>(logits.topk(o.top_k)).select(1, -1).unsqueeze(1);
      logits = logits.masked_fill(logits < kth, -INFINITY);
    }
    idx = at::cat({idx, at::multinomial(at::softmax(logits, -1), 1, false, gen)}, 1);
  }
  return corpus.decode(idx.slice(1, 1));
}

// Prints a sample as every strategy of the example does.
inline void print_sample(std::ostream& out, const SampleOptions& o, const std::string& sample) {
  out << "--- sample (temperature " << o.temperature << ", top-k " << o.top_k << ", seed " << o.seed << ") ---\n"
      << sample << "\n--- end of sample ---" << std::endl;
}

}  // namespace gpt
