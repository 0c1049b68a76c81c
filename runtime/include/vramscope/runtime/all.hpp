// all.hpp — the whole public API of the vramscope runtime in one include.
#pragma once

#include "vramscope/runtime/autograd.hpp"
#include "vramscope/runtime/checkpoint_modules.hpp"
#include "vramscope/runtime/compiled.hpp"
#include "vramscope/runtime/decoder.hpp"
#include "vramscope/runtime/dtype.hpp"
#include "vramscope/runtime/encoder.hpp"
#include "vramscope/runtime/losses.hpp"
#include "vramscope/runtime/models.hpp"
#include "vramscope/runtime/modules.hpp"
#include "vramscope/runtime/ops.hpp"
#include "vramscope/runtime/optim.hpp"
#include "vramscope/runtime/runtime.hpp"
#include "vramscope/runtime/tensor.hpp"
#include "vramscope/runtime/training.hpp"
