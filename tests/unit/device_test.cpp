// Device specs against fake inventories (no GPU needed).
#include <gtest/gtest.h>

#include "dtrain/comm/device.h"
#include "dtrain/error.h"

using dtrain::DeviceError;
using dtrain::DeviceInventory;
using dtrain::parse_devices;

namespace {
DeviceInventory gpus(int n, std::optional<std::string> visible = std::nullopt) {
  return DeviceInventory{.cuda_count = n, .cuda_visible_devices = std::move(visible)};
}

std::string error_of(const std::string& spec, const DeviceInventory& inv) {
  try {
    parse_devices(spec, inv);
  } catch (const DeviceError& e) {
    return e.what();
  }
  return "<no error>";
}
}  // namespace

TEST(Devices, ParsesCpuAndCuda) {
  EXPECT_EQ(dtrain::format_devices(parse_devices("cpu", gpus(0))), "cpu");
  EXPECT_EQ(dtrain::format_devices(parse_devices("cpu,cpu, cpu", gpus(0))), "cpu,cpu,cpu");
  EXPECT_EQ(dtrain::format_devices(parse_devices("cuda", gpus(3))), "cuda:0,cuda:1,cuda:2");
  EXPECT_EQ(dtrain::format_devices(parse_devices("CUDA:1", gpus(3))), "cuda:1");
  EXPECT_EQ(dtrain::format_devices(parse_devices("0,2", gpus(3))), "cuda:0,cuda:2");
  EXPECT_EQ(dtrain::format_devices(parse_devices("all", gpus(2))), "cuda:0,cuda:1");
  EXPECT_EQ(dtrain::format_devices(parse_devices("all", gpus(0))), "cpu");
}

TEST(Devices, FormatRoundTrips) {
  const auto d = parse_devices("2,cuda:0,cpu", gpus(4));
  EXPECT_EQ(parse_devices(dtrain::format_devices(d), gpus(4)), d);
}

TEST(Devices, MissingDeviceNamesVisibleCountAndEnv) {
  const auto what = error_of("cuda:3", gpus(2, "4,5"));
  EXPECT_NE(what.find("device 'cuda:3' does not exist"), std::string::npos) << what;
  EXPECT_NE(what.find("2 CUDA devices are visible (CUDA_VISIBLE_DEVICES=4,5)"), std::string::npos) << what;
  EXPECT_NE(what.find("0..1"), std::string::npos) << what;
  EXPECT_NE(error_of("7", gpus(1)).find("device '7' does not exist: 1 CUDA device is visible"), std::string::npos);
}

TEST(Devices, CudaWithoutGpus) {
  for (const char* spec : {"cuda", "cuda:0", "0"}) {
    const auto what = error_of(spec, gpus(0, ""));
    EXPECT_NE(what.find("asks for CUDA, but 0 CUDA devices are visible"), std::string::npos) << what;
  }
}

TEST(Devices, RejectsGarbageDuplicatesAndEmpty) {
  EXPECT_NE(error_of("gpu7", gpus(8)).find("unknown device 'gpu7'"), std::string::npos);
  EXPECT_NE(error_of("cuda:x", gpus(8)).find("no valid CUDA index"), std::string::npos);
  EXPECT_NE(error_of("cuda:-1", gpus(8)).find("no valid CUDA index"), std::string::npos);
  EXPECT_NE(error_of("1,cuda:1", gpus(8)).find("cuda:1 appears more than once"), std::string::npos);
  EXPECT_NE(error_of("", gpus(8)).find("empty"), std::string::npos);
  EXPECT_NE(error_of("0,,1", gpus(8)).find("empty item"), std::string::npos);
}

TEST(Devices, DeviceForLocalRank) {
  EXPECT_EQ(dtrain::device_for_local_rank("cuda", 1, 2, gpus(2)), c10::Device("cuda:1"));
  EXPECT_EQ(dtrain::device_for_local_rank("1,3", 1, 2, gpus(4)), c10::Device("cuda:3"));
  EXPECT_EQ(dtrain::device_for_local_rank("cpu", 3, 4, gpus(0)), c10::Device("cpu"));
  EXPECT_THROW(dtrain::device_for_local_rank("cuda:0", 1, 2, gpus(2)), DeviceError);
}

TEST(Devices, CurrentInventoryMatchesRuntime) {
  const auto inv = DeviceInventory::current();
  EXPECT_GE(inv.cuda_count, 0);
  EXPECT_EQ(parse_devices("all", inv).front().is_cuda(), inv.cuda_count > 0);
}
