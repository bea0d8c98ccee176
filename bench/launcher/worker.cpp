// The worker both launchers start in bench/launcher: joins the process group
// (env contract, Gloo), runs one all-reduce as its "first training step",
// records the wall-clock time of that moment in $BENCH_DIR/step_<restart>_<rank>,
// then, in the first round, waits to be killed; in later rounds it exits.
#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include "dtrain/dtrain.h"

int main() {
  try {
    auto group = dtrain::dist::init_process_group();
    at::Tensor t = at::ones({1024});
    group.all_reduce(t).wait();
    const auto now =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count();
    const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
    const std::string round = restart != nullptr ? restart : "0";
    const std::string path =
        std::string(std::getenv("BENCH_DIR")) + "/step_" + round + "_" + std::to_string(group.rank());
    std::ofstream(path + ".tmp") << now << "\n";
    std::rename((path + ".tmp").c_str(), path.c_str());
    if (round == "0") std::this_thread::sleep_for(std::chrono::seconds(120));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "launcher bench worker: %s\n", e.what());
    return 1;
  }
}
