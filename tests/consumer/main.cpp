// Uses dtrain from an installed package: a one-rank Gloo group and an all-reduce.
#include <ATen/ATen.h>
#include <dtrain/dtrain.h>

#include <iostream>

int main() {
  auto group = dtrain::dist::init_process_group(dtrain::dist::Store::in_memory(), 0, 1);
  at::Tensor t = at::full({3}, 2.0);
  group.all_reduce(t).wait();
  const bool ok = t.sum().item<double>() == 6.0 && dtrain::parse_devices("cpu").size() == 1;
  std::cout << (ok ? "consumer ok" : "consumer WRONG") << std::endl;
  return ok ? 0 : 1;
}
