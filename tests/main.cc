#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cstdlib>

// The CUDA driver double reads CUDA_VISIBLE_DEVICES as the real driver does; a value the
// machine running the tests happens to have (a scheduler's) names its real GPUs, not the
// double's, so the tests start without it and set it where they mean to.
static const int kNoAmbientVisibleDevices = (unsetenv("CUDA_VISIBLE_DEVICES"), 0);
