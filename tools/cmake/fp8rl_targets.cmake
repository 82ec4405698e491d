# Project-wide compile options and the helpers that register every target and test.
include(GoogleTest)

add_library(fp8rl_options INTERFACE)
target_compile_options(fp8rl_options INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Werror -ffp-contract=off>
  $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings -Xcompiler=-Wall,-Wextra,-Werror>)  # the host side of .cu files
target_include_directories(fp8rl_options INTERFACE ${CMAKE_SOURCE_DIR})
if(NOT FP8RL_SANITIZE STREQUAL "")
  target_compile_definitions(fp8rl_options INTERFACE FP8RL_NO_CLONES)
endif()
if(FP8RL_SANITIZE STREQUAL "address")
  target_compile_options(fp8rl_options INTERFACE -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  target_link_options(fp8rl_options INTERFACE -fsanitize=address,undefined)
elseif(FP8RL_SANITIZE STREQUAL "thread")
  target_compile_options(fp8rl_options INTERFACE -fsanitize=thread -fno-omit-frame-pointer)
  target_link_options(fp8rl_options INTERFACE -fsanitize=thread)
elseif(NOT FP8RL_SANITIZE STREQUAL "")
  message(FATAL_ERROR "FP8RL_SANITIZE must be '', 'address' or 'thread'")
endif()

# AVX-512 flags for the translation units that hold intrinsics (quant/ only).
# -Wno-maybe-uninitialized: GCC 12's own avx512fintrin.h trips it through _mm512_undefined_*
# (GCC PR 105593, fixed in GCC 13); it is off only in these files.
set(FP8RL_AVX512_FLAGS -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mavx512vbmi -mfma
    -Wno-maybe-uninitialized)

# fp8rl_add_test(name SOURCES a.cpp ... LIBS ... LABELS ... [TIMEOUT s])
function(fp8rl_add_test name)
  cmake_parse_arguments(T "" "TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE fp8rl_options ${T_LIBS} GTest::gtest GTest::gtest_main)
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 600)
  endif()
  # GoogleTest's PRE_TEST discovery flattens list-valued properties, so several labels become one
  # joined by '_' ("quant_exhaustive"); ctest -L takes a regex, so -L exhaustive and -L quant
  # both select it.
  string(REPLACE ";" "_" labels "${T_LABELS}")
  set(props LABELS "${labels}" TIMEOUT ${T_TIMEOUT})
  if(FP8RL_SANITIZE STREQUAL "address")  # CAF's own leaks at exit (tests/lsan.supp says which)
    list(APPEND props ENVIRONMENT "LSAN_OPTIONS=suppressions=${CMAKE_SOURCE_DIR}/tests/lsan.supp")
  endif()
  gtest_discover_tests(${name} DISCOVERY_MODE PRE_TEST PROPERTIES ${props} WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
endfunction()

# fp8rl_add_tool(name SOURCES ... LIBS ...) -> build/bin/name
function(fp8rl_add_tool name)
  cmake_parse_arguments(T "" "" "SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE fp8rl_options ${T_LIBS})
endfunction()
