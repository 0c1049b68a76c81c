// replay_command.hpp — `vramscope replay FILE`: replays a recorded allocation
// trace (PyTorch snapshot pickle, vramscope history CSV, RMM log CSV) through
// the allocator under one or more settings and through CUB, side by side.
//
//   vramscope replay snapshot.pickle --device sim:a100-40g
//       --alloc-conf "" --alloc-conf max_split_size_mb:128 --peer cub --format table
#pragma once

#include <CLI/CLI.hpp>

namespace mem::tools {

/// Registers the `replay` subcommand on `app`. Bad input throws UsageError
/// (exit 2), an unreadable or malformed trace CommandFailed (exit 1).
void add_replay_command(CLI::App& app);

}  // namespace mem::tools
