// sim_cuda_names.hpp — renames the CUDA runtime calls CUB makes to the
// simulated runtime's symbols (vramscope_sim_cuda*).
//
// Included before any CUDA header in the peer's translation units, so CUB's
// calls and the runtime headers' declarations name the simulated functions.
// The real libcudart (which the allocator's CUDA device links) keeps its own
// symbols: both can live in one binary without interposing on each other.
#pragma once

#define cudaMalloc vramscope_sim_cudaMalloc
#define cudaFree vramscope_sim_cudaFree
#define cudaGetDevice vramscope_sim_cudaGetDevice
#define cudaSetDevice vramscope_sim_cudaSetDevice
#define cudaEventCreateWithFlags vramscope_sim_cudaEventCreateWithFlags
#define cudaEventRecord vramscope_sim_cudaEventRecord
#define cudaEventQuery vramscope_sim_cudaEventQuery
#define cudaEventDestroy vramscope_sim_cudaEventDestroy
#define cudaGetLastError vramscope_sim_cudaGetLastError
#define cudaPeekAtLastError vramscope_sim_cudaPeekAtLastError
#define cudaGetErrorString vramscope_sim_cudaGetErrorString
