# Finds the torch that is installed in the Python doing the build and defines the interface target
# zerocore_torch with the flags torch.utils.cpp_extension would use. We do not use find_package(Torch):
# its CUDA probing is slow and brittle, and _C only needs headers, the C++ ABI flag and four libraries.
# pybind11 comes from torch/include/pybind11 so that ProcessGroup/Work/Tensor cross the boundary
# (pybind11 internals must match torch._C's: see STYLE.md pitfall 5).
find_package(Python 3.9 REQUIRED COMPONENTS Interpreter Development.Module)

execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "
import importlib.util, sys
if importlib.util.find_spec('torch') is None:
    sys.exit(3)
import os, sysconfig, torch
from torch.utils import cpp_extension
print(torch.__version__)
print('|'.join(cpp_extension.include_paths()))
print(os.path.join(os.path.dirname(torch.__file__), 'lib'))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(sysconfig.get_config_var('EXT_SUFFIX'))
print(torch.version.cuda or '')
"
  RESULT_VARIABLE _torch_rc
  OUTPUT_VARIABLE _torch_out
  ERROR_VARIABLE _torch_err
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(_torch_rc EQUAL 3)
  message(FATAL_ERROR
    "zerocore builds against the PyTorch installed in ${Python_EXECUTABLE}, and torch is not installed there.\n"
    "Install torch first (for example `pip install torch`), then build without isolation:\n"
    "  pip install --no-build-isolation .")
elseif(NOT _torch_rc EQUAL 0)
  message(FATAL_ERROR "zerocore: importing torch in ${Python_EXECUTABLE} failed:\n${_torch_err}")
endif()

string(REPLACE "\n" ";" _torch_lines "${_torch_out}")
list(GET _torch_lines 0 ZEROCORE_TORCH_VERSION)
list(GET _torch_lines 1 _torch_includes)
list(GET _torch_lines 2 _torch_libdir)
list(GET _torch_lines 3 ZEROCORE_TORCH_CXX11_ABI)
list(GET _torch_lines 4 ZEROCORE_PY_EXT_SUFFIX)
string(REPLACE "|" ";" _torch_includes "${_torch_includes}")
message(STATUS "zerocore: building against torch ${ZEROCORE_TORCH_VERSION} (${_torch_libdir})")

add_library(zerocore_torch INTERFACE)
target_include_directories(zerocore_torch SYSTEM INTERFACE ${_torch_includes} ${Python_INCLUDE_DIRS})
target_compile_definitions(zerocore_torch INTERFACE
  _GLIBCXX_USE_CXX11_ABI=${ZEROCORE_TORCH_CXX11_ABI}
  TORCH_EXTENSION_NAME=_C
  TORCH_API_INCLUDE_EXTENSION_H
  ZEROCORE_TORCH_VERSION="${ZEROCORE_TORCH_VERSION}")
foreach(_lib c10 torch torch_cpu torch_python)
  find_library(ZEROCORE_LIB_${_lib} NAMES ${_lib} PATHS "${_torch_libdir}" NO_DEFAULT_PATH REQUIRED)
  target_link_libraries(zerocore_torch INTERFACE "${ZEROCORE_LIB_${_lib}}")
endforeach()
# The extension finds torch's libraries next to it at run time through torch's own import, which loads
# them first; an rpath would pin one install location.
