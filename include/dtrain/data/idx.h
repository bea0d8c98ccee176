// Reader for IDX files (the MNIST family's format), plain or gzip-compressed.
//
// Layout: two zero bytes, a type code (0x08 u8, 0x09 i8, 0x0B i16, 0x0C i32,
// 0x0D f32, 0x0E f64), the number of dimensions, each dimension as a
// big-endian u32, then the data, big-endian, row-major. The file must hold
// exactly the data its header announces.
#pragma once

#include <ATen/core/Tensor.h>

#include <filesystem>

namespace dtrain::data {

// Reads a whole IDX file into a CPU tensor of the file's type and shape.
// Throws DataError naming the file for a missing file, bad magic, unknown
// type, truncated data, trailing bytes, or a damaged gzip stream.
at::Tensor read_idx(const std::filesystem::path& path);

}  // namespace dtrain::data
