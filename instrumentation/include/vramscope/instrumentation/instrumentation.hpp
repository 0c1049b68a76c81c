// instrumentation.hpp — everything of vramscope::instrumentation in one include.
#pragma once

#include "vramscope/instrumentation/exports.hpp"
#include "vramscope/instrumentation/history.hpp"
#include "vramscope/instrumentation/hooks.hpp"
#include "vramscope/instrumentation/memory_logger.hpp"
#include "vramscope/instrumentation/module_scope.hpp"
#include "vramscope/instrumentation/module_tracker.hpp"
#include "vramscope/instrumentation/snapshot.hpp"
#include "vramscope/instrumentation/summary.hpp"
#include "vramscope/instrumentation/timeline.hpp"
