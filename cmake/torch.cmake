# Locate the torch installed in the target Python environment. Works under pip's build
# isolation too: sysconfig gives the environment's site-packages even when torch is not
# importable from the isolated build environment.
set(DUALKV_TORCH_HAS_CUDA OFF)
if(NOT DUALKV_BUILD_TORCH)
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
# TorchConfig looks for CUDA itself when torch is a CUDA build; the op library links only libtorch.
find_package(Torch REQUIRED CONFIG)
if(EXISTS "${Torch_DIR}/../../../lib/libtorch_cuda.so")
  set(DUALKV_TORCH_HAS_CUDA ON)
endif()
