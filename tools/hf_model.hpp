// hf_model.hpp — --hf-model NAME: a model's config.json from the local Hugging Face cache.
//
// huggingface_hub keeps what it downloaded under $HF_HUB_CACHE (default $HF_HOME/hub, with
// HF_HOME defaulting to $XDG_CACHE_HOME/huggingface or ~/.cache/huggingface), one folder per
// repository: models--<org>--<name>/refs/main holds the commit of the main revision, and
// snapshots/<commit>/config.json the file (huggingface_hub's constants.py and
// file_download.py, try_to_load_from_cache). Nothing is downloaded: what is not there is said,
// with the command that fetches the config alone.
#pragma once

#include <string>

namespace mem::tools {

/// The config.json of `name`: a folder holding one, or a Hub repository id ("org/name") found
/// in the local cache. Throws UsageError saying where it looked and what to do.
std::string find_hf_config(const std::string& name);

}  // namespace mem::tools
