# Finds the Debian packages fp8rl builds against (installed by tools/setup).
find_package(Threads REQUIRED)
find_package(TBB REQUIRED)
find_package(spdlog REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(GTest REQUIRED)

# Debian's libcaf-dev ships no CAFConfig.cmake, FindCAF.cmake or .pc file (caf-0.17.md §2).
find_path(CAF_INCLUDE_DIR caf/all.hpp)
find_library(CAF_CORE_LIBRARY caf_core)
find_library(CAF_IO_LIBRARY caf_io)
if(NOT CAF_INCLUDE_DIR OR NOT CAF_CORE_LIBRARY OR NOT CAF_IO_LIBRARY)
  message(FATAL_ERROR "CAF not found: run tools/setup (apt-get install libcaf-dev)")
endif()
file(STRINGS "${CAF_INCLUDE_DIR}/caf/config.hpp" _caf_ver REGEX "^#define CAF_VERSION [0-9]+")
string(REGEX REPLACE ".* ([0-9]+)$" "\\1" CAF_VERSION "${_caf_ver}")
if(CAF_VERSION VERSION_LESS 1706 OR NOT CAF_VERSION VERSION_LESS 1800)
  message(FATAL_ERROR "need CAF 0.17.6+ in the 0.17 line, found ${CAF_VERSION}")
endif()
add_library(CAF::core SHARED IMPORTED)
set_target_properties(CAF::core PROPERTIES
  IMPORTED_LOCATION "${CAF_CORE_LIBRARY}"
  INTERFACE_INCLUDE_DIRECTORIES "${CAF_INCLUDE_DIR}"
  INTERFACE_LINK_LIBRARIES Threads::Threads)
add_library(CAF::io SHARED IMPORTED)
set_target_properties(CAF::io PROPERTIES
  IMPORTED_LOCATION "${CAF_IO_LIBRARY}"
  INTERFACE_LINK_LIBRARIES CAF::core)

# Benchmark baselines (oneDNN, OpenBLAS) and the CPU collective library (Gloo).
find_path(DNNL_INCLUDE_DIR dnnl.hpp)
find_library(DNNL_LIBRARY dnnl)
if(NOT DNNL_INCLUDE_DIR OR NOT DNNL_LIBRARY)
  message(FATAL_ERROR "oneDNN not found: run tools/setup (libdnnl-dev)")
endif()
add_library(fp8rl::dnnl SHARED IMPORTED)
set_target_properties(fp8rl::dnnl PROPERTIES IMPORTED_LOCATION "${DNNL_LIBRARY}"
  INTERFACE_INCLUDE_DIRECTORIES "${DNNL_INCLUDE_DIR}")
find_library(OPENBLAS_LIBRARY NAMES openblas)
find_path(CBLAS_INCLUDE_DIR cblas.h PATH_SUFFIXES openblas x86_64-linux-gnu/openblas-pthread)
if(NOT OPENBLAS_LIBRARY OR NOT CBLAS_INCLUDE_DIR)
  message(FATAL_ERROR "OpenBLAS not found: run tools/setup (libopenblas-dev)")
endif()
add_library(fp8rl::openblas SHARED IMPORTED)
set_target_properties(fp8rl::openblas PROPERTIES IMPORTED_LOCATION "${OPENBLAS_LIBRARY}"
  INTERFACE_INCLUDE_DIRECTORIES "${CBLAS_INCLUDE_DIR}")
find_package(Gloo CONFIG REQUIRED)

# PCRE2 runs the pre-tokenizer regexes of Hugging Face tokenizer.json files (\p{L}, lookahead).
find_path(PCRE2_INCLUDE_DIR pcre2.h)
find_library(PCRE2_LIBRARY pcre2-8)
if(NOT PCRE2_INCLUDE_DIR OR NOT PCRE2_LIBRARY)
  message(FATAL_ERROR "PCRE2 not found: run tools/setup (libpcre2-dev)")
endif()
add_library(fp8rl::pcre2 SHARED IMPORTED)
set_target_properties(fp8rl::pcre2 PROPERTIES IMPORTED_LOCATION "${PCRE2_LIBRARY}"
  INTERFACE_INCLUDE_DIRECTORIES "${PCRE2_INCLUDE_DIR}" INTERFACE_COMPILE_DEFINITIONS PCRE2_CODE_UNIT_WIDTH=8)
