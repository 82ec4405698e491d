// models/clones.hpp -- FP8RL_VECTOR_CLONES: hot host loops compiled for x86-64-v4 / v3 / baseline
// and picked at load time (GCC function multiversioning). Every clone computes the same bits: fma
// is exact in each, reductions keep their source order (no -ffast-math), and -ffp-contract=off
// everywhere. Sanitizer builds compile one version: ifunc resolvers run before the TSan runtime.
#pragma once

#ifdef FP8RL_NO_CLONES
#define FP8RL_VECTOR_CLONES
#else
#define FP8RL_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
