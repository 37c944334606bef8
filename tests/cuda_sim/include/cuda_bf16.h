// Stand-in for the CUDA toolkit header in the CPU emulation (see cuda_sim.h).
#pragma once
#include "cuda_sim.h"
