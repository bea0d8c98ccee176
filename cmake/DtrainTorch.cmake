# Finds LibTorch (from the pinned `torch` wheel) and papers over what its CMake
# package needs on a machine with a CUDA toolkit but no GPU. Included by our
# top-level CMakeLists.txt and by the installed dtrainConfig.cmake, so an
# outside project that does find_package(dtrain) gets the same treatment.
#
# - TorchConfig enables CUDA when the wheel is a CUDA build; without an explicit
#   architecture list it try_run()s a GPU probe, which fails with no GPU.
# - CMake 3.25 does not know a CUDA20 dialect for nvcc; we compile no CUDA
#   sources, so CUDA 17 is enough for Torch's checks.
# - libtorch_cuda.so needs the wheel's own NCCL/CUDA libraries (nvidia/*/lib),
#   which are newer than /usr/local/cuda's: point the linker at them
#   (-rpath-link) and the loader too (-rpath), so a binary that links the
#   toolkit's libcudart still loads the wheel's at run time.

if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
  set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc CACHE FILEPATH "nvcc used by Torch's CMake checks")
endif()
if(NOT DEFINED CUDAToolkit_ROOT AND EXISTS /usr/local/cuda)
  set(CUDAToolkit_ROOT /usr/local/cuda)
endif()
if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST "8.0;9.0" CACHE STRING "CUDA architectures (set to skip Torch's GPU probe)")
endif()
if(NOT DEFINED CMAKE_CUDA_STANDARD)
  set(CMAKE_CUDA_STANDARD 17)
endif()

# The LibTorch versions dtrain builds against (README "Supported LibTorch";
# the differences are bridged in src/core/torch_compat.h). Asking for the
# lower end lets CMake pass over older packages on the search path; the upper
# end is checked once one is found, so both mistakes get the same message.
set(DTRAIN_TORCH_MIN_VERSION 2.11)
set(DTRAIN_TORCH_MAX_VERSION 2.15)
set(_dtrain_torch_window "LibTorch ${DTRAIN_TORCH_MIN_VERSION} through ${DTRAIN_TORCH_MAX_VERSION}")
set(_dtrain_torch_hint "HINT: point CMAKE_PREFIX_PATH (or Torch_DIR) at a LibTorch in that window, e.g. the \
prefix a torch wheel prints with `python -c 'import torch; print(torch.utils.cmake_prefix_path)'`; \
scripts/setup.sh installs 2.15 (scripts/setup.sh --torch 2.11.0: 2.11).")
find_package(Torch ${DTRAIN_TORCH_MIN_VERSION} QUIET)
if(NOT Torch_FOUND)
  if(Torch_CONSIDERED_VERSIONS)
    set(_dtrain_found "")
    foreach(_config _version IN ZIP_LISTS Torch_CONSIDERED_CONFIGS Torch_CONSIDERED_VERSIONS)
      string(APPEND _dtrain_found "\n  LibTorch ${_version} (${_config})")
    endforeach()
    message(FATAL_ERROR "dtrain supports ${_dtrain_torch_window}; found only:${_dtrain_found}\n${_dtrain_torch_hint}")
  endif()
  message(FATAL_ERROR "dtrain needs ${_dtrain_torch_window}; no LibTorch (TorchConfig.cmake) was found.\n${_dtrain_torch_hint}")
endif()
string(REGEX MATCH "^[0-9]+\\.[0-9]+" _dtrain_torch_minor "${Torch_VERSION}")
if(_dtrain_torch_minor VERSION_GREATER DTRAIN_TORCH_MAX_VERSION)
  message(FATAL_ERROR "dtrain supports ${_dtrain_torch_window}; found LibTorch ${Torch_VERSION} (${Torch_DIR}).\n"
    "${_dtrain_torch_hint}")
endif()

if(NOT TARGET dtrain_torch_link)
  add_library(dtrain_torch_link INTERFACE IMPORTED)
  # Note [no libtorch.so]: TORCH_LIBRARIES names libtorch.so (targets `torch`
  # and `torch_library`), a shim whose only job is to pull in torch_cpu and
  # torch_cuda. The 2.11 CUDA wheel's shim also exports 182 partial copies of
  # libstdc++ symbols (std::filesystem, std::chrono::tzdb, stringstream
  # members) whose weak references to recursive_directory_iterator are null:
  # an executable listing libtorch.so among its direct dependencies resolves
  # every std::filesystem call in the process to the shim (it comes before
  # libstdc++.so.6 in the global symbol scope), and remove_all or
  # create_directories jumps to address 0, from the program's code and from
  # libdtrain's (checkpoints). Seen on an H100 (docs/gpu.md), reproduced
  # without a GPU. So we link the two libraries the shim stands for, each
  # kept with --no-as-needed by its own imported target (torch_cuda must load
  # to register LibTorch's CUDA hooks, though nothing references it).
  set(_dtrain_torch_libs "${TORCH_LIBRARIES}")
  list(REMOVE_ITEM _dtrain_torch_libs torch torch_library)
  set(_dtrain_torch_parts torch_cpu_library)
  if(TARGET torch_cuda_library)
    list(APPEND _dtrain_torch_parts torch_cuda_library)
  endif()
  set_target_properties(dtrain_torch_link PROPERTIES
    INTERFACE_LINK_LIBRARIES "${_dtrain_torch_parts};${_dtrain_torch_libs}"
    INTERFACE_INCLUDE_DIRECTORIES "${TORCH_INCLUDE_DIRS}")
  if(TARGET torch)
    get_target_property(_dtrain_torch_options torch INTERFACE_COMPILE_OPTIONS)
    if(_dtrain_torch_options)
      set_property(TARGET dtrain_torch_link PROPERTY INTERFACE_COMPILE_OPTIONS "${_dtrain_torch_options}")
    endif()
  endif()
  file(GLOB _dtrain_nvidia_libdirs "${TORCH_INSTALL_PREFIX}/../nvidia/*/lib")
  foreach(_dir IN LISTS _dtrain_nvidia_libdirs)
    get_filename_component(_dir "${_dir}" REALPATH)
    # rpath-link: resolve libtorch_cuda's NEEDED at link time; rpath (ahead of
    # CMake's own, which lists /usr/local/cuda/lib): load the wheel's CUDA
    # runtime, not the toolkit's older one, when a binary links libcudart.
    set_property(TARGET dtrain_torch_link APPEND PROPERTY INTERFACE_LINK_OPTIONS
      "LINKER:-rpath-link,${_dir}" "LINKER:-rpath,${_dir}")
  endforeach()
endif()

# True when this LibTorch can drive CUDA devices (and so NCCL); decides which
# backend file src/comm compiles.
# LibTorch's CPU part only (torch_cpu and c10, no CUDA libraries): what
# libdtrain links. A CPU-only process then does not load libtorch_cuda and the
# CUDA runtime, which took 0.16 of 0.4 s at every process start here. Programs
# that put tensors on CUDA devices link dtrain_torch_link (all of LibTorch) too;
# the NCCL backend is a module, libdtrain_nccl, loaded when first used.
if(NOT TARGET dtrain_torch_cpu_link)
  add_library(dtrain_torch_cpu_link INTERFACE IMPORTED)
  set_target_properties(dtrain_torch_cpu_link PROPERTIES
    INTERFACE_LINK_LIBRARIES "torch_cpu_library"
    INTERFACE_INCLUDE_DIRECTORIES "${TORCH_INCLUDE_DIRS}")
endif()

if(TORCH_CUDA_LIBRARIES OR TARGET torch_cuda)
  set(DTRAIN_TORCH_HAS_CUDA ON)
else()
  set(DTRAIN_TORCH_HAS_CUDA OFF)
endif()
