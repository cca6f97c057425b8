# Locate the torch installed in the target Python environment. Works under pip's build
# isolation too: sysconfig gives the environment's site-packages even when torch is not
# importable from the isolated build environment. Also resolves DUALKV_CUDA=AUTO: the CUDA
# library is built when torch is a CUDA build and nvcc is found.
set(DUALKV_TORCH_HAS_CUDA OFF)
if(NOT DUALKV_BUILD_TORCH)
  if(DUALKV_CUDA STREQUAL "AUTO")
    set(DUALKV_CUDA OFF)
  endif()
  return()
endif()
if(NOT Torch_DIR)
  find_package(Python COMPONENTS Interpreter REQUIRED)
  execute_process(
    COMMAND ${Python_EXECUTABLE} -c
      "import sysconfig; print(sysconfig.get_paths()['purelib']); print(sysconfig.get_paths()['platlib'])"
    OUTPUT_VARIABLE _dualkv_site OUTPUT_STRIP_TRAILING_WHITESPACE)
  string(REPLACE "\n" ";" _dualkv_site "${_dualkv_site}")
  foreach(_dir ${_dualkv_site})
    if(EXISTS "${_dir}/torch/share/cmake/Torch/TorchConfig.cmake")
      set(Torch_DIR "${_dir}/torch/share/cmake/Torch")
      break()
    endif()
  endforeach()
  if(NOT Torch_DIR)
    execute_process(COMMAND ${Python_EXECUTABLE} -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
                    OUTPUT_VARIABLE _dualkv_prefix OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(_dualkv_prefix)
      set(Torch_DIR "${_dualkv_prefix}/Torch")
    endif()
  endif()
endif()
if(NOT Torch_DIR)
  message(FATAL_ERROR "DualKV builds against an installed torch, and none was found in "
                      "${_dualkv_site}. Install torch first (e.g. pip install torch), then DualKV.")
endif()
get_filename_component(_dualkv_torch_root "${Torch_DIR}/../../.." ABSOLUTE)
if(EXISTS "${_dualkv_torch_root}/lib/libtorch_cuda.so")
  set(DUALKV_TORCH_HAS_CUDA ON)
endif()
if(DUALKV_CUDA STREQUAL "AUTO")
  set(DUALKV_CUDA OFF)
  if(DUALKV_TORCH_HAS_CUDA)
    # (nvcc on PATH, or under CUDA_HOME as torch's own lookup accepts)
    if(NOT DEFINED ENV{CUDACXX} AND EXISTS "$ENV{CUDA_HOME}/bin/nvcc")
      set(ENV{CUDACXX} "$ENV{CUDA_HOME}/bin/nvcc")
    endif()
    include(CheckLanguage)
    check_language(CUDA)
    if(CMAKE_CUDA_COMPILER)
      set(DUALKV_CUDA ON)
    endif()
  endif()
endif()
if(DUALKV_TORCH_HAS_CUDA AND NOT DUALKV_CUDA)
  # A CUDA build of torch (PyPI's default on Linux) without DualKV's CUDA library: TorchConfig
  # would stop on a machine without a complete CUDA toolkit ("cannot find the CUDA libraries"),
  # yet the op library needs only torch's CPU side. Link that directly, as torch's own C++
  # extension builder does: its headers, libtorch_cpu and libc10.
  add_library(dualkv_torch_cpu INTERFACE)
  target_include_directories(dualkv_torch_cpu SYSTEM INTERFACE "${_dualkv_torch_root}/include"
                             "${_dualkv_torch_root}/include/torch/csrc/api/include")
  target_link_libraries(dualkv_torch_cpu INTERFACE "${_dualkv_torch_root}/lib/libtorch_cpu.so"
                        "${_dualkv_torch_root}/lib/libc10.so")
  set(TORCH_LIBRARIES dualkv_torch_cpu)
else()
  # TorchConfig looks for CUDA itself when torch is a CUDA build.
  find_package(Torch REQUIRED CONFIG)
endif()
